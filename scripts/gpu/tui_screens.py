"""Screenshots (SVG) of the real app on this machine's GPUs, reading a run directory.

usage: python scripts/gpu/tui_screens.py RUN_DIR OUT_DIR
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from sddoctor.gpu.collector import Collector
from sddoctor.gpu.source import NvmlSource
from sddoctor.ranks.feeds import RunDirFeed
from sddoctor.tui.app import MonitorApp


async def shoot(run_dir: str, out: Path, size: tuple[int, int] = (160, 45), suffix: str = "") -> None:
    app = MonitorApp(Collector(NvmlSource(pcie_interval=1.0)), RunDirFeed(run_dir), interval=0.5)
    async with app.run_test(size=size) as pilot:
        while not app.ready:
            await pilot.pause(0.05)
        await pilot.pause(4.0)  # some history for the sparklines, a PCIe reading, a few steps
        app.save_screenshot(str(out / f"tui-main{suffix}.svg"))
        await pilot.press("question_mark")
        await pilot.pause(0.2)
        app.save_screenshot(str(out / f"tui-help{suffix}.svg"))
        await pilot.press("escape")
        app.query_one("#ranks").focus()
        await pilot.press("enter")
        await pilot.pause(0.5)
        app.save_screenshot(str(out / f"tui-rank{suffix}.svg"))


if __name__ == "__main__":
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    asyncio.run(shoot(sys.argv[1], out))
    asyncio.run(shoot(sys.argv[1], out, (80, 24), "-80x24"))  # a fresh terminal, an SSH session
    print("screenshots in", out)
