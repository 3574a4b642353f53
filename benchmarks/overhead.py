"""Framework overhead: strategy=data on 2 ranks vs a hand-written DDP loop, alternating.

    python benchmarks/overhead.py [--pairs 5] [--steps 60] [--hidden 512]

Both runs train the same MLP on the same batch sizes for the same steps; each
reports the mean step time of its steady-state steps (the framework's first and
logged steps, where it counts memory, are left out, as are the baseline's first
and last). Runs alternate A B A B ... and the figure is the median of the
per-pair ratios, because timings on a shared machine drift by tens of percent.
Prints a table and writes benchmarks/results/overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A run that has not ended by then hung (a 60-step run takes seconds): stop the benchmark rather than wait.
TIMEOUT_S = 300


def framework(a, run_dir: Path) -> float:
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "nproc=2", "strategy=data", "strategy.zero=0",
           f"model.args.hidden={a.hidden}", f"model.args.depth={a.depth}", f"trainer.batch_size={a.batch}",
           f"trainer.steps={a.steps}", f"trainer.log_every={a.steps}", "trainer.progress=false",
           f"run_dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, env=_env(), cwd=ROOT, timeout=TIMEOUT_S)
    last = (run_dir / "metrics.jsonl").read_text().splitlines()[-1]
    return json.loads(last)["step_time_s"]


def handwritten(a) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "benchmarks" / "ddp_loop.py"), f"--hidden={a.hidden}", f"--depth={a.depth}",
           f"--batch={a.batch}", f"--steps={a.steps}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(), cwd=ROOT,
                         timeout=TIMEOUT_S).stdout
    return json.loads(out.strip().splitlines()[-1])["step_time_s"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overhead.json"))
    a = ap.parse_args()
    rows = []
    print(f"{'pair':>4} {'framework ms':>13} {'hand DDP ms':>12} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.pairs):
            f = framework(a, Path(tmp) / f"run{i}")
            h = handwritten(a)
            rows.append({"pair": i, "framework_step_s": f, "handwritten_step_s": h, "ratio": f / h})
            print(f"{i:>4} {f * 1e3:>13.2f} {h * 1e3:>12.2f} {f / h:>7.3f}", flush=True)
    median = statistics.median(r["ratio"] for r in rows)
    print(f"median framework / hand-written step time: {median:.3f} (target <= 1.02)")
    result = {"config": vars(a), "pairs": rows, "median_ratio": median, "target": 1.02}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
