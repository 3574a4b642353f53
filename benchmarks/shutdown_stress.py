"""Stress the end of torchrun workers: many short runs, optionally beside busy processes, counting any that fail.

    python benchmarks/shutdown_stress.py [--runs 20] [--load 2] [--root CHECKOUT]

Each run is tests/e2e/test_cli.py's torchrun launch (2 gloo workers, strategy=data zero 3, 6 steps); a run
fails when its exit status is not 0 or its output holds "Fatal Python error" or "terminate called" (a worker
aborting at interpreter exit, after its run: Note [ending a worker] in parallel/entry.py). `--load N` runs N
busy processes meanwhile, so that the workers' threads are scheduled late; `--root` runs another checkout (the
one before a change, to compare). Not part of the test suite: the failure it looks for was seen about once in a
CI run of the suite. Prints a table and writes benchmarks/results/shutdown_stress.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["trainer.steps=6", "trainer.log_every=1", "trainer.progress=false", "trainer.save_final=true",
        "trainer.timeout_s=60", "strategy=data", "strategy.zero=3", "model.args.depth=2"]
SIGNS = ("Fatal Python error", "terminate called")


def one_run(root: Path, run_dir: Path) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(root / "launch" / "train.py"), *ARGS, f"run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the runs")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to run")
    a = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.load)]
    failures, seconds = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(a.runs):
                t0 = time.perf_counter()
                code, out = one_run(a.root.resolve(), Path(tmp) / f"run{i}")
                seconds.append(time.perf_counter() - t0)
                if code != 0 or any(s in out for s in SIGNS):
                    # The worker's own lines about it (torchrun's summary, at the end, only names the signal).
                    lines = [line for line in out.splitlines() if any(s in line for s in SIGNS + ("done:", "Thread"))]
                    failures.append({"run": i, "exit": code, "lines": lines, "tail": out[-1500:]})
                    print(f"run {i}: exit {code}\n" + "\n".join(lines) + f"\n{out[-1500:]}", file=sys.stderr)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"{'checkout':>10} {a.root}\n{'runs':>10} {a.runs}\n{'load':>10} {a.load}\n"
          f"{'failed':>10} {len(failures)}\n{'s / run':>10} {sum(seconds) / len(seconds):.1f}")
    result = {"root": str(a.root), "runs": a.runs, "load": a.load, "failed": len(failures), "failures": failures,
              "seconds_per_run": sum(seconds) / len(seconds)}
    (ROOT / "benchmarks" / "results" / "shutdown_stress.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
