"""The dashboard (``GET /``) in a real headless Chromium, against the real daemon and server.

The daemon trains a real ``yolox-n`` on a tiny CPU dataset; the page is driven with Playwright's
async API in the daemon's own event loop, with Debian's ``chromium`` (``.ci/run`` installs it;
``playwright install`` is never run). The phone viewport (390 px wide) is the one users have.
docs/dashboard.png comes from this test:
``LIBREYOLO_AGENT_SCREENSHOT=docs/dashboard.png .venv/bin/python -m pytest tests/test_page.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent import demo
from agent.config.model import Env
from agent.daemon.spine import Daemon
from agent.state import Phase
from tests.support import HANG_S, tiny_job, wait_for

pytestmark = pytest.mark.training

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
try:
    from playwright.async_api import ConsoleMessage, Page, async_playwright, expect
except ImportError:  # pragma: no cover - the dev extra installs it
    async_playwright = None  # type: ignore[assignment]

requires_browser = pytest.mark.skipif(
    CHROMIUM is None or async_playwright is None,
    reason="needs Debian's chromium and playwright (.ci/run installs both)",
)
requires_libreyolo = pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None
    and shutil.which("libreyolo") is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)

#: Also save a screenshot (1200 px wide) here: how docs/dashboard.png is made.
SCREENSHOT_TO = os.environ.get("LIBREYOLO_AGENT_SCREENSHOT")
#: Generous waits for a loaded 2-core machine; they bound a hang, they time nothing (each ends
#: on what the page shows; under load an epoch takes ten seconds and more).
WAIT_MS = 240_000

#: Non-transparent pixels in the chart canvas: a blank one has none.
_INKED_PIXELS_JS = """c => {
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
  return n;
}"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.make_dataset(tmp_path_factory.mktemp("data") / "ds")


async def run_with_page(
    daemon: Daemon, state_dir: Path, during: Callable[[str, str], Awaitable[None]]
) -> int:
    """Run ``daemon``; once it serves HTTP, ``during(base_url, token)``. If ``during`` fails,
    the job is stopped through the API (no trainer may outlive the test), then the error raised.
    """
    ready = asyncio.Event()
    daemon.on_ready = lambda _d: ready.set()
    main = asyncio.create_task(daemon.run())
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait([main, waiter], timeout=120, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    assert not main.done(), f"the daemon ended before serving HTTP: {main.result()}"
    assert daemon.state.server is not None
    base = f"http://127.0.0.1:{daemon.state.server['port']}"
    token = (state_dir / "token").read_text().strip()
    try:
        await during(base, token)
    finally:
        if not main.done():
            with contextlib.suppress(aiohttp.ClientError):
                async with aiohttp.ClientSession() as s:
                    await s.post(f"{base}/stop", headers={"Authorization": f"Bearer {token}"})
    return await asyncio.wait_for(main, HANG_S)


async def get_json(base: str, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(base + path) as r:
        assert r.status == 200, (path, r.status, await r.text())
        return await r.json()


@requires_libreyolo
@requires_browser
def test_dashboard_shows_live_training_and_its_stop_button_stops_the_job(
    tmp_path: Path, dataset: Path
) -> None:
    job = tiny_job(
        tmp_path,
        dataset,
        epochs=300,
        sections='[limits]\nprice_usd_per_hour = 3.48\nbudget_usd = 50\nmax_runtime = "2h"\n',
    )
    env = Env(state_dir=tmp_path / "state")
    daemon = Daemon(job, env, poll_interval_s=0.5)
    seen: dict[str, Any] = {}

    async def during(base: str, token: str) -> None:
        await wait_for(
            lambda: daemon.status is not None and daemon.status.completed_epochs >= 2, timeout=120
        )
        assert async_playwright is not None and CHROMIUM is not None
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM, args=["--disable-dev-shm-usage", "--disable-gpu"]
            )
            try:
                page = await browser.new_page(viewport={"width": 390, "height": 844})
                await check_page(page, base, token, seen)
            finally:
                await browser.close()

    async def check_page(page: Page, base: str, token: str, seen: dict[str, Any]) -> None:
        errors: list[str] = []

        def on_console(msg: ConsoleMessage) -> None:
            if msg.type == "error":
                errors.append(f"console: {msg.text} @ {msg.location}")

        page.on("console", on_console)
        page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
        page.on("dialog", lambda dialog: dialog.accept())  # the stop button's confirm()
        expect.set_options(timeout=WAIT_MS)

        await page.goto(f"{base}/")
        await expect(page.locator("#phase")).to_have_text("TRAINING")
        # Subscribed to /events (not polling): the replayed history is listed.
        await expect(page.locator("#conn")).to_have_text("live")
        await expect(page.locator("#events")).to_contain_text("STAGING \u2192 TRAINING")

        # The progress bar says what /status says (an epoch may end in between: read again).
        for _ in range(100):
            status = await get_json(base, "/status")
            bar = await page.eval_on_selector("#progress", "e => [e.value, e.max]")
            if status["phase"] == "TRAINING" and bar == [status["epoch"], status["total_epochs"]]:
                break
            await asyncio.sleep(0.3)
        assert bar == [status["epoch"], status["total_epochs"]], (bar, status["epoch"])
        assert status["total_epochs"] == 300 and status["epoch"] >= 2
        await expect(page.locator("#epoch-text")).to_contain_text("/ 300")
        # Money is configured in this job, so it is shown, not "not configured".
        await expect(page.locator("#price")).to_have_text("$3.48/h")
        await expect(page.locator("#budget")).to_have_text("$50.00")

        # The chart is drawn from the run's real metrics.jsonl (via /history).
        canvas = page.locator("#chart")
        await page.wait_for_function(
            "Number(document.getElementById('chart').dataset.points) >= 2", timeout=WAIT_MS
        )
        points = int(await canvas.get_attribute("data-points") or 0)
        history = await get_json(base, "/history")
        with_loss = [r for r in history if isinstance(r.get("train/loss"), (int, float))]
        assert 2 <= points <= len(with_loss), (points, len(history))
        assert [r["epoch"] for r in history[:2]] == [1, 2]
        assert await canvas.evaluate(_INKED_PIXELS_JS) > 500  # lines, not a blank canvas

        if SCREENSHOT_TO:  # the README's picture, at a laptop's width
            await page.set_viewport_size({"width": 1200, "height": 900})
            await page.wait_for_timeout(500)  # the chart redraws 100 ms after a resize
            await page.screenshot(path=SCREENSHOT_TO, full_page=True)
            await page.set_viewport_size({"width": 390, "height": 844})
        await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

        # Usable on a phone: nothing wider than the screen.
        width = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1], f"horizontal scroll at 390 px: {width}"

        # Without a token a button asks for one and sends nothing.
        stop = page.get_by_role("button", name="Stop training")
        result = page.locator("#action-result")
        await stop.click()
        await expect(result).to_contain_text("enter the token")
        assert daemon.state.phase == Phase.TRAINING
        # With it: hold the teardown, stop training; the page follows the run to HELD live,
        # without a reload; release lets the job end.
        await page.get_by_label("Token").fill(token)
        await page.get_by_role("button", name="Hold").click()
        await expect(result).to_contain_text("\u2713 hold")
        await stop.click()
        await expect(result).to_contain_text("\u2713 stop")
        await expect(page.locator("#phase")).to_have_text("HELD")
        await expect(page.locator("#hold")).to_contain_text("held")
        seen["held_in_page"] = daemon.state.phase
        seen["errors"] = list(errors)
        await page.get_by_role("button", name="Release").click()
        await expect(result).to_contain_text("\u2713 release")
        # Released, the job ends and the agent with it: the page's requests then find no one
        # listening, which Chromium logs; nothing else may go wrong.
        seen["errors_after_release"] = [
            e for e in errors[len(seen["errors"]) :] if "ERR_CONNECTION_REFUSED" not in e
        ]

    code = asyncio.run(run_with_page(daemon, env.state_dir, during))

    assert seen["errors"] == []
    assert seen["errors_after_release"] == []
    assert seen["held_in_page"] == Phase.HELD
    assert code == 0
    assert daemon.state.reason is not None and daemon.state.reason.value == "stopped_by_user"
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
