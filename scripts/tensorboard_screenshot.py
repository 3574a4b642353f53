"""Take a screenshot of TensorBoard's scalars page over a run directory, with headless Chromium.

    python scripts/tensorboard_screenshot.py [RUN_DIR] [--out docs/tensorboard_scalars.png] [--filter REGEX]

Without RUN_DIR it first trains a short 2-rank pipeline run (the picture in docs/observability.md) into a temporary
directory. Needs the `tensorboard` command (a dependency) and Chromium (`apt-get install chromium` on
Debian); not part of the test suite, which reads TensorBoard's HTTP data API instead
(tests/e2e/test_observe.py).
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["nproc=2", "strategy=pipeline", "model=gpt", "data.task=lm", "model.args.layers=4", "model.args.dim=128",
       "data.seq_len=64", "trainer.steps=60", "trainer.log_every=5", "trainer.progress=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_scalars(url: str, timeout: float = 60) -> None:
    """Until the server has read the event files (its tag list is not empty)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"{url}/data/plugin/scalars/tags", timeout=5) as r:
                if len(r.read()) > 10:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"tensorboard at {url} served no scalars within {timeout:.0f} s")


def screenshot(url: str, out: Path, width: int = 1600, height: int = 1100) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("no Chromium found: apt-get install chromium (Debian), or put one on PATH")
    with tempfile.TemporaryDirectory() as profile:
        # The background-networking flags keep Chromium from reaching out to its own services; the virtual
        # time budget lets the page's scripts fetch and draw the charts before the picture is taken.
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", f"--window-size={width},{height}", "--hide-scrollbars",
                        "--virtual-time-budget=20000", f"--screenshot={out.resolve()}", url],
                       check=True, capture_output=True, timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", type=Path)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "tensorboard_scalars.png")
    p.add_argument("--filter", default="loss|mfu|bubble_measured$|mem_peak_bytes$|tokens_per_s",
                   help="TensorBoard's tag filter (a regular expression)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir
        if run_dir is None:
            run_dir = Path(tmp, "run")
            subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *RUN, f"run_dir={run_dir}"],
                           check=True, cwd=tmp)
        port = free_port()
        server = subprocess.Popen(["tensorboard", "--logdir", str(run_dir / "tensorboard"), "--host", "127.0.0.1",
                                   "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_scalars(url)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            screenshot(f"{url}/?darkMode=false#scalars&tagFilter={args.filter}", args.out)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
