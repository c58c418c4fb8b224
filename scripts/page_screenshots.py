"""Screenshots of the dashboard (``GET /``) at four moments of a run, light and dark, on a
laptop (1280 px) and a phone (390 px): ``docs/page/<moment>-<light|dark>-<width>.jpg``.

Each moment is a served run (tests/fakes/page_agent.py: the real /status document over a real
ledger and run directory, the real HTTP server), opened in Debian's ``chromium`` through
Playwright (``playwright install`` is never run). ``done`` is taken after the server has
stopped, as a person sees the page once the agent has exited. JPEG of the viewport only, so the
set stays a few hundred KB::

    .venv/bin/python scripts/page_screenshots.py [OUT_DIR]
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright.async_api import Page, async_playwright

from agent.config.model import DEFAULT_STATE_DIR
from tests.fakes.page_agent import MOMENTS, TOKEN, Moment, make_scene

WIDTHS = {1280: 800, 390: 780}
SCHEMES = ("light", "dark")
QUALITY = 40
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


async def settle(page: Page, moment: Moment) -> None:
    """Wait until the page shows what ``moment`` is about (never a fixed sleep)."""
    phase = {"start": "TRAINING", "mid": "TRAINING", "held": "HELD", "done": "DONE"}[moment]
    await page.wait_for_function(
        f"document.getElementById('phase').textContent === {phase!r}", timeout=30_000
    )
    if moment != "start":
        await page.wait_for_function(
            "Number(document.getElementById('chart').dataset.points) > 0", timeout=30_000
        )


async def gpu_memory(page: Page, out: Path) -> Path:
    """The chart with GPU memory (NVML, per epoch) on its right axis, hovered:
    ``mid-gpu-memory-light-1280.jpg``."""
    await page.select_option("#chart-right", "gpu/memory_used_bytes")
    chart = page.locator("#chart")
    await chart.scroll_into_view_if_needed()
    box = await chart.bounding_box()
    assert box is not None
    await chart.hover(position={"x": box["width"] * 0.68, "y": box["height"] / 2})
    path = out / "mid-gpu-memory-light-1280.jpg"
    await page.screenshot(path=str(path), type="jpeg", quality=QUALITY)
    return path


async def shoot(out: Path, chromium: str) -> list[Path]:
    written: list[Path] = []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium, args=["--disable-dev-shm-usage", "--disable-gpu"]
        )
        try:
            for moment in MOMENTS:
                with tempfile.TemporaryDirectory() as tmp:
                    scene = make_scene(Path(tmp), moment)
                    scene.shown_state_dir = DEFAULT_STATE_DIR
                    server = scene.server()
                    port = await server.start()
                    base = f"http://127.0.0.1:{port}"
                    pages = []
                    for scheme in SCHEMES:
                        for width, height in WIDTHS.items():
                            page = await browser.new_page(
                                viewport={"width": width, "height": height},
                                color_scheme=scheme,  # type: ignore[arg-type]
                                # wait_for_function evaluates its text: the page's CSP forbids it.
                                bypass_csp=True,
                            )
                            await page.goto(base + "/")
                            await settle(page, moment)
                            if moment == "held":  # the token is kept: the buttons are usable
                                await page.fill("#token", TOKEN)
                                await page.evaluate("window.scrollTo(0, 0)")
                            pages.append((scheme, width, page))
                    if moment == "done":  # the agent exits; the open pages notice
                        await server.stop()
                        for _, _, page in pages:
                            await page.wait_for_function(
                                "document.getElementById('conn').textContent"
                                ".includes('not answering')",
                                timeout=30_000,
                            )
                    for scheme, width, page in pages:
                        if moment == "mid":  # a hover value on the chart
                            chart = page.locator("#chart")
                            box = await chart.bounding_box()
                            assert box is not None
                            await chart.hover(
                                position={"x": box["width"] * 0.68, "y": box["height"] / 2}
                            )
                        path = out / f"{moment}-{scheme}-{width}.jpg"
                        await page.screenshot(path=str(path), type="jpeg", quality=QUALITY)
                        written.append(path)
                        if moment == "mid" and scheme == "light" and width == 1280:
                            written.append(await gpu_memory(page, out))
                        await page.close()
                    if moment != "done":
                        await server.stop()
        finally:
            await browser.close()
    return written


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/page")
    chromium = next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)
    if chromium is None:
        print("needs Debian's chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    written = asyncio.run(shoot(out, chromium))
    total = sum(p.stat().st_size for p in written)
    for p in written:
        print(f"{p} {p.stat().st_size // 1024} KB")
    print(f"{len(written)} screenshots, {total // 1024} KB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
