"""Mesh shapes side by side: step time and per-rank memory of one model on 4 ranks.

    python benchmarks/hybrid.py [--hidden 1024] [--depth 6] [--steps 8]

Runs the built-in MLP under `strategy=single` (1 rank, the reference) and under
every shape of 4 ranks below, one after another in this invocation, and reads
each run's last metrics line: step time, peak live tensor bytes per rank, and
the bytes of each rank's own pieces of the weights and of the AdamW state. For
the shapes that shard every weight and its state (zero=3 over dp, tensor
parallelism over tp, both), each rank should hold (weights + state) / shards of
the single run's total; the table shows the ratio (target: within 5%).
Prints a table, writes benchmarks/results/hybrid.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (overrides, processes, shards of weights + optimizer state per rank, or None when not all sharded)
SHAPES = {
    "single": (["strategy=single"], 1, 1),
    "dp4 zero0": (["strategy=data", "strategy.zero=0"], 4, None),
    "dp4 zero3": (["strategy=data", "strategy.zero=3"], 4, 4),
    "tp4": (["strategy=model"], 4, 4),
    "pp4": (["strategy=pipeline"], 4, None),
    "dp2 x tp2 zero0": (["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.zero=0"], 4, None),
    "dp2 x tp2 zero3": (["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.zero=3"], 4, 4),
    "dp2 x pp2": (["strategy=hybrid", "strategy.dp=2", "strategy.pp=2"], 4, None),
    "pp2 x tp2": (["strategy=hybrid", "strategy.pp=2", "strategy.tp=2"], 4, None),
}


def run(a, overrides: list[str], nproc: int, run_dir: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), f"nproc={nproc}", *overrides,
           f"model.args.hidden={a.hidden}", f"model.args.depth={a.depth}", f"trainer.batch_size={a.batch}",
           f"trainer.steps={a.steps}", f"trainer.log_every={a.steps}", "trainer.progress=false",
           f"run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid.json"))
    a = ap.parse_args()
    rows, total = [], None
    print(f"{'shape':<18} {'ranks':>5} {'step ms':>8} {'peak MB/rank':>13} {'weights+state MB/rank':>22} "
          f"{'/ (total/shards)':>17}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (overrides, nproc, shards) in SHAPES.items():
            last = run(a, overrides, nproc, Path(tmp) / name.replace(" ", "_"))
            state = [p + o for p, o in zip(last["param_bytes_per_rank"], last["optim_state_bytes_per_rank"])]
            if total is None:
                total = state[0]  # the single run holds everything
            ratio = max(state) / (total / shards) if shards else None
            row = {"shape": name, "ranks": nproc, "step_time_s": last["step_time_s"],
                   "mem_peak_bytes_per_rank": last["mem_peak_bytes_per_rank"],
                   "param_bytes_per_rank": last["param_bytes_per_rank"],
                   "optim_state_bytes_per_rank": last["optim_state_bytes_per_rank"],
                   "state_bytes_per_rank": state, "state_over_total_per_shard": ratio}
            rows.append(row)
            peak = max(last["mem_peak_bytes_per_rank"]) / 1e6
            shown = f"{ratio:.3f}" if ratio is not None else "-"
            print(f"{name:<18} {nproc:>5} {last['step_time_s'] * 1e3:>8.1f} {peak:>13.1f} "
                  f"{max(state) / 1e6:>22.2f} {shown:>17}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "total_state_bytes": total, "rows": rows}, indent=2))
    print("target: weights + optimizer state per rank within 5% of total / shards where every weight is sharded")


if __name__ == "__main__":
    main()
