"""The dashboard (``GET /``) in a real headless Chromium, against the real daemon and server.

Most tests open the page on a served run at a chosen moment (tests/fakes/page_agent.py: the
real /status document over a real ledger and run directory, the real HTTP server, the daemon's
own steering rules); one trains for real. There the daemon trains a real ``yolox-n`` on a tiny
CPU dataset; the page is driven with Playwright's async API in the daemon's own event loop.
The browser is Debian's ``chromium`` (``.ci/run`` installs it; ``playwright install`` is never
run). The phone viewport (390 px wide) is the one users have.
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
from agent.status.server import StatusServer
from agent.sync.ledger import ItemKind, Ledger
from tests.fakes.page_agent import TOKEN, Moment, Scene, make_scene
from tests.support import HANG_S, tiny_job, wait_for

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
    await asyncio.wait([main, waiter], timeout=HANG_S, return_when=asyncio.FIRST_COMPLETED)
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


@pytest.mark.training
@requires_libreyolo
@requires_browser
def test_dashboard_shows_live_training_and_its_stop_button_stops_the_job(
    tmp_path: Path, dataset: Path
) -> None:
    job = tiny_job(
        tmp_path,
        dataset,
        epochs=300,
        sections='[limits]\nprice_usd_per_hour = 3.48\nbudget_usd = 50\nmax_runtime = "2h"\n'
        f'[sync]\ntarget = "file://{tmp_path / "synced"}"\n',
    )
    env = Env(state_dir=tmp_path / "state")
    daemon = Daemon(job, env, poll_interval_s=0.5)
    seen: dict[str, Any] = {}

    async def during(base: str, token: str) -> None:
        await wait_for(lambda: daemon.status is not None and daemon.status.completed_epochs >= 2)
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
        # Subscribed to /events (not polling): the replayed history is listed (filtered to
        # phases: the uploads of every epoch would push it out of the feed's last 15).
        await expect(page.locator("#conn")).to_have_text("live")
        await page.locator("#event-filter").select_option("phase")
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
        # HELD: the teardown panel says what comes at the hold's end; extend is refused.
        await expect(page.locator("#teardown")).to_contain_text("the teardown goes ahead")
        await expect(page.locator("#btn-extend")).to_be_disabled()
        # The checkpoint list is the sync ledger's (the final sync is over in HELD).
        assert daemon.ctx.sync is not None
        want = ledger_checkpoints(daemon.ctx.sync.ledger)
        assert want and all(p.endswith(".pt") for p, _ in want)
        for _ in range(200):
            if await page_checkpoints(page) == want:
                break
            await asyncio.sleep(0.3)
        assert await page_checkpoints(page) == want
        seen["errors"] = list(errors)
        await page.get_by_role("button", name="Release").click()
        await expect(result).to_contain_text("\u2713 release")
        # Released, the job ends and the agent with it: the page says so, its clocks stop,
        # and it never claims to be "updating" from an agent that has gone.
        await expect(page.locator("#conn")).to_contain_text("not answering since")
        assert "updating" not in (await page.locator("#conn").text_content() or "")
        await expect(page.locator("#phase")).to_have_text("DONE")
        await expect(page.locator("#end-line")).to_contain_text("Run ended: stopped on request")
        await expect(page.locator("#deadline")).to_have_text("the run has ended")
        # The page's requests then find no one listening, which Chromium logs; nothing else
        # may go wrong.
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


# ---- served runs at chosen moments (no training) ------------------------------------------------

#: ``check(page, base_url, scene, server)``: what a test does on the served page.
ScenePage = Callable[[Page, str, Scene, StatusServer], Awaitable[None]]


def on_scene(
    tmp: Path,
    moment: Moment,
    check: ScenePage,
    *,
    target: str = "hf://acme/yolox-coco",
    clock: bool = False,
    prepare: Callable[[Scene], None] | None = None,
) -> list[str]:
    """Serve ``moment`` of a run (``prepare`` may change it first) and open the page on it in
    Chromium at 390 px; then ``check``. With ``clock``, the page's clock is Playwright's
    (``page.clock``), so a test can move it on. Returns the page's errors (refused connections
    left out: a test may stop the server, as the agent's exit does)."""
    errors: list[str] = []

    def on_console(msg: ConsoleMessage) -> None:
        if msg.type == "error" and "ERR_CONNECTION_REFUSED" not in msg.text:
            errors.append(f"console: {msg.text}")

    async def main() -> None:
        scene = make_scene(tmp, moment, target=target)
        if prepare is not None:
            prepare(scene)
        server = scene.server()
        port = await server.start()
        base = f"http://127.0.0.1:{port}"
        try:
            assert async_playwright is not None and CHROMIUM is not None
            async with async_playwright() as pw:
                browser = await pw.chromium.launch(
                    executable_path=CHROMIUM, args=["--disable-dev-shm-usage", "--disable-gpu"]
                )
                try:
                    page = await browser.new_page(viewport={"width": 390, "height": 844})
                    page.on("console", on_console)
                    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
                    page.on("dialog", lambda dialog: dialog.accept())
                    expect.set_options(timeout=30_000)
                    if clock:
                        await page.clock.install()
                    await page.goto(f"{base}/")
                    await check(page, base, scene, server)
                finally:
                    await browser.close()
        finally:
            await server.stop()

    asyncio.run(main())
    return errors


def ledger_checkpoints(ledger: Ledger) -> list[tuple[str, str]]:
    """The ledger's ``.pt`` files as the page must list them: newest first, sha256 prefix."""
    pts = [
        e
        for e in ledger.entries.values()
        if e.kind in (ItemKind.LAST, ItemKind.BEST, ItemKind.EPOCH)
    ]
    pts.sort(key=lambda e: (e.verified_at or e.queued_at, e.remote_path), reverse=True)
    return [(e.remote_path, e.sha256[:12]) for e in pts]


async def page_checkpoints(page: Page) -> list[tuple[str, str]]:
    items = page.locator("#ckpt-list li[data-path]")
    got = await items.evaluate_all("els => els.map(e => [e.dataset.path, e.dataset.sha])")
    return [(str(p), str(h)) for p, h in got]


@requires_browser
@pytest.mark.parametrize(
    "target", ["hf://acme/yolox-coco", "file:///srv/checkpoints"], ids=["hub", "folder"]
)
def test_checkpoint_list_is_the_ledgers(tmp_path: Path, target: str) -> None:
    async def check(page: Page, base: str, scene: Scene, server: StatusServer) -> None:
        want = ledger_checkpoints(scene.ledger)
        assert len(want) >= 5  # last, best, epoch_N; small files and logs are not listed
        first = page.locator("#ckpt-list li[data-path]").first
        await expect(page.locator("#ckpt-list li[data-path]")).to_have_count(len(want))
        assert await page_checkpoints(page) == want
        if target.startswith("hf://"):
            href = await first.locator("a").get_attribute("href")
            assert href == f"https://huggingface.co/acme/yolox-coco/blob/main/{want[0][0]}"
        else:
            await expect(first).to_contain_text(f"/srv/checkpoints/{want[0][0]}")
        # The one still queued says so; the verified ones say their size and when.
        await expect(first).to_contain_text("not verified yet")
        await expect(page.locator("#ckpt-list li[data-path]").nth(1)).to_contain_text("71.3 MB")
        await expect(page.locator("#ckpt-list li[data-path]").nth(1)).to_contain_text("verified ")

    assert on_scene(tmp_path, "mid", check, target=target) == []


@requires_browser
def test_page_after_the_agent_exits_is_frozen_and_says_the_outcome(tmp_path: Path) -> None:
    async def check(page: Page, base: str, scene: Scene, server: StatusServer) -> None:
        doc = await get_json(base, "/status")
        await expect(page.locator("#phase")).to_have_text("DONE")
        end = page.locator("#end")
        await expect(end).to_be_visible()
        await expect(page.locator("#end-line")).to_contain_text(
            "Run ended: training completed all its epochs"
        )
        assert doc["post_mortem"]["location"].endswith("/blob/main/agent/report.md")
        await expect(page.locator("#report-link")).to_have_attribute(
            "href", doc["post_mortem"]["location"]
        )
        await expect(page.locator("#elapsed")).not_to_have_text("-")
        elapsed = await page.locator("#elapsed").text_content()
        await server.stop()  # the agent exits: every request fails from now on
        await page.clock.fast_forward(10 * 60_000)  # ten minutes of polls and ticks
        conn = page.locator("#conn")
        await expect(conn).to_contain_text("not answering since")
        assert "updating" not in (await conn.text_content() or "")
        # The clocks stopped at the end: ten minutes later they say the same.
        assert await page.locator("#elapsed").text_content() == elapsed
        await expect(page.locator("#deadline")).to_have_text("the run has ended")
        await expect(end).to_be_visible()
        for name in ("stop", "extend", "hold", "release"):
            await expect(page.locator(f"#btn-{name}")).to_be_disabled()
        await expect(page.locator("#why-stop")).to_contain_text("nothing to stop")

    assert on_scene(tmp_path, "done", check, clock=True) == []


def _nearly_all_extensions(scene: Scene) -> None:
    # 29.5 days already added: one more day is past the 30-day cap, which only the request's
    # own duration can show; the page lets the button be pressed and the server answers 409.
    scene.state.extended_s = 29.5 * 86400


@requires_browser
def test_a_refused_control_shows_the_servers_reason(tmp_path: Path) -> None:
    async def check(page: Page, base: str, scene: Scene, server: StatusServer) -> None:
        await expect(page.locator("#phase")).to_have_text("TRAINING")
        await expect(page.locator("#token-file")).to_have_text(str(scene.state_dir / "token"))
        await page.get_by_label("Token").fill(TOKEN)
        extend = page.get_by_role("button", name="Extend")
        await expect(extend).to_be_enabled()
        await page.locator("#extend-by").fill("1d")
        await extend.click()
        result = page.locator("#action-result")
        await expect(result).to_contain_text("extend refused (HTTP 409)")
        await expect(result).to_contain_text("add up to at most 30d")
        # The token is kept in this tab: a reload needs no paste.
        await page.reload()
        await expect(page.get_by_label("Token")).to_have_value(TOKEN)
        # A hold that ends before training does is warned about.
        await expect(page.locator("#hold-warning")).to_be_visible()
        await expect(page.locator("#hold-warning")).to_contain_text(
            "before training is expected to end"
        )

    errors = on_scene(tmp_path, "mid", check, prepare=_nearly_all_extensions)
    # Chromium logs the refused request itself; nothing else may go wrong.
    assert [e for e in errors if "409 (Conflict)" not in e] == []


@requires_browser
def test_the_login_url_keeps_the_token_and_leaves_the_address_bar(tmp_path: Path) -> None:
    """`libreyolo-agent token --login-url` prints http://localhost:PORT/#token=...: opened, the
    page keeps the token (a control then works without a paste) and drops the fragment."""

    async def check(page: Page, base: str, scene: Scene, server: StatusServer) -> None:
        # Pasted into the tab already on the page (a hash change), then opened fresh.
        await page.goto(f"{base}/#token={TOKEN}")
        await expect(page.get_by_label("Token")).to_have_value(TOKEN)
        assert "token" not in page.url, page.url
        await page.evaluate("sessionStorage.clear()")
        fresh = page
        await fresh.goto("about:blank")
        await fresh.goto(f"{base}/#token={TOKEN}x")
        await expect(fresh.get_by_label("Token")).to_have_value(f"{TOKEN}x")
        assert "token" not in fresh.url, fresh.url
        await fresh.reload()
        await expect(fresh.get_by_label("Token")).to_have_value(f"{TOKEN}x")

    assert on_scene(tmp_path, "mid", check) == []


@requires_browser
def test_held_teardown_panel_says_what_happens_at_the_holds_end(tmp_path: Path) -> None:
    async def check(page: Page, base: str, scene: Scene, server: StatusServer) -> None:
        await expect(page.locator("#phase")).to_have_text("HELD")
        teardown = page.locator("#teardown")
        await expect(teardown).to_contain_text("Held until")
        await expect(teardown).to_contain_text(
            "the teardown goes ahead: destroy: teardown.on_success = destroy"
        )
        await expect(teardown).not_to_contain_text("made when training ends")
        # And first on the page: held until when, then what.
        await expect(page.locator("#end-line")).to_contain_text("Held: the box stays up until")
        await expect(page.locator("#end-detail")).to_contain_text("destroy")
        # In HELD, extend is refused (and says why); stop, hold and release act.
        await expect(page.locator("#btn-extend")).to_be_disabled()
        await expect(page.locator("#why-extend")).to_contain_text("the box is held")
        for name in ("stop", "hold", "release"):
            await expect(page.locator(f"#btn-{name}")).to_be_enabled()

    assert on_scene(tmp_path, "held", check) == []


@requires_browser
def test_chart_hover_shows_the_epochs_values_and_every_metric_is_selectable(
    tmp_path: Path,
) -> None:
    async def check(page: Page, base: str, scene: Scene, server: StatusServer) -> None:
        history = {r["epoch"]: r for r in await get_json(base, "/history")}
        chart = page.locator("#chart")
        await expect(chart).to_have_attribute("data-points", str(len(history)))
        right = page.locator("#chart-right")
        options = await right.locator("option").evaluate_all("os => os.map(o => o.value)")
        for key in ("train/loss", "metrics/mAP50", "metrics/mAP50-95", "metrics/precision"):
            assert key in options
        assert "metrics/recall" in options and "train/cls_loss" in options and "time" in options
        assert "gpu/util_pct" in options and "gpu/power_w" in options
        await right.select_option("metrics/mAP50")
        await expect(page.locator("#metric-name")).to_have_text("metrics/mAP50")
        await page.locator("#chart-left").select_option("time")
        await expect(page.locator("#left-name")).to_have_text("seconds per epoch")

        box = await chart.bounding_box()
        assert box is not None
        await chart.hover(position={"x": box["width"] * 0.55, "y": box["height"] / 2})
        tip = page.locator("#chart-tip")
        await expect(tip).to_be_visible()
        text = await tip.text_content() or ""
        epoch = int(text.split()[1])
        row = history[epoch]
        # The values are the row's, as the page rounds them (4 significant decimals).
        assert f"seconds per epoch {round(row['time'], 4):g}" in text, (text, row)
        want = round(row["metrics/mAP50"], 4) if "metrics/mAP50" in row else "(not validated)"
        assert f"metrics/mAP50 {want}" in text, (text, row)

    assert on_scene(tmp_path, "mid", check) == []


@requires_browser
def test_gpu_memory_is_charted_in_gib_with_its_hover_value(tmp_path: Path) -> None:
    """/history's gpu/memory_used_bytes (NVML, through the agent) is a series of its own, shown
    in GiB of the GPUs' total; the total itself is not a series."""

    async def check(page: Page, base: str, scene: Scene, server: StatusServer) -> None:
        history = {r["epoch"]: r for r in await get_json(base, "/history")}
        right = page.locator("#chart-right")
        await expect(page.locator("#chart")).to_have_attribute("data-points", str(len(history)))
        options = await right.locator("option").evaluate_all("os => os.map(o => o.value)")
        assert "gpu/memory_used_bytes" in options
        assert "gpu/memory_total_bytes" not in options
        await right.select_option("gpu/memory_used_bytes")
        label = "GPU memory GiB of 140 (at the epoch's end)"  # 150,754,820,096 bytes
        await expect(page.locator("#metric-name")).to_have_text(label)
        # Every epoch has a figure (not only the validated ones).
        await expect(page.locator("#chart")).to_have_attribute(
            "data-metric-points", str(len(history))
        )
        chart = page.locator("#chart")
        box = await chart.bounding_box()
        assert box is not None
        await chart.hover(position={"x": box["width"] * 0.4, "y": box["height"] / 2})
        tip = page.locator("#chart-tip")
        await expect(tip).to_be_visible()
        text = await tip.text_content() or ""
        row = history[int(text.split()[1])]
        gib = round(row["gpu/memory_used_bytes"] / (1 << 30), 4)
        assert f"{label} {gib:g}" in text, (text, row)
        assert 48 < gib < 52

    assert on_scene(tmp_path, "mid", check) == []


@requires_browser
def test_event_feed_filters_by_kind(tmp_path: Path) -> None:
    async def check(page: Page, base: str, scene: Scene, server: StatusServer) -> None:
        items = page.locator("#events li")
        await expect(page.locator("#events")).to_contain_text("upload: ")
        await page.locator("#event-filter").select_option("epoch")
        await expect(page.locator("#events")).not_to_contain_text("upload: ")
        texts = await items.all_text_contents()
        assert len(texts) == 5 and all(" epoch: epoch " in t for t in texts), texts
        await page.locator("#event-filter").select_option("upload")
        texts = await items.all_text_contents()
        assert texts and all(" upload: " in t for t in texts), texts

    assert on_scene(tmp_path, "mid", check) == []
