"""The report.html screenshots in docs/img/, from real runs.

    python scripts/report_screenshots.py            # writes docs/img/report-hang.png, report-straggler.png
    python scripts/report_screenshots.py DIR        # and keeps the two run directories in DIR

Runs tests/supervise_script.py on 2 gloo ranks under `sddoctor run` twice (rank 1 skips
all_reduce #5: a hang; rank 1 sleeps 0.25 s before every collective: a straggler), then opens each
run's report.html in headless Chromium (Debian's package, driven by Playwright) and saves the top
of the page. Needs `pip install -e '.[dev]'` and `apt-get install chromium`. About 40 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser_fixtures import browser_page  # noqa: E402

RUNS = {
    "hang": ("skip:rank=1,seq=5", {"STEPS": "50"}, ["--hang-timeout", "4", "--on-hang", "kill"]),
    "straggler": (
        "sleep:rank=1,seconds=0.25,seq=1,every=1",
        {"STEPS": "12", "PAUSE": "0.05"},
        ["--hang-timeout", "30"],
    ),
}


def run(name: str, where: Path) -> Path:
    fault, extra, options = RUNS[name]
    run_dir = where / name
    env = dict(os.environ, SDDOCTOR_FAULT=fault, REPORT_STEPS="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    job = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "tests/supervise_script.py",
    ]
    cmd = [sys.executable, "-m", "sddoctor", "run", "--run-dir", str(run_dir), *options, "--", *job]
    subprocess.run(cmd, cwd=ROOT, env=env, check=False, timeout=180, capture_output=True)
    return run_dir / "report.html"


def main() -> int:
    out = ROOT / "docs" / "img"
    with tempfile.TemporaryDirectory(prefix="sddoctor-shots-") as tmp:
        keep = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)
        for name in RUNS:
            page_path = run(name, keep)
            with browser_page(width=1280, height=860) as (page, messages):
                page.goto(page_path.as_uri(), wait_until="load")
                page.screenshot(path=str(out / f"report-{name}.png"))
                errors = [m for m in messages if m[0] in ("error", "pageerror")]
                if errors:
                    print(f"{name}: console errors: {errors}", file=sys.stderr)
                    return 1
            print(f"wrote {out / f'report-{name}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
