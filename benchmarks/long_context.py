"""Long sequences: context parallelism on 2 ranks against one process, per sequence length.

    python benchmarks/long_context.py [--lengths 1024,4096,16384] [--dim 64] [--layers 2] [--steps 2]

Trains the built-in gpt (batch of one sequence) under `strategy=single` and `strategy=context` (cp 2: each
sequence split over the 2 ranks, Note [context parallelism] in parallel/strategies/context), one after the
other in this invocation, at each length, and reads each run's last metrics line (the watched steps): step
time, and the peak live tensor bytes per rank. The activation peak is that peak less what the step holds
anyway: weights, gradients, AdamW state and, on 2 ranks, DDP's gradient buckets (one more copy of the
gradients). Target: activation peak per rank <= 0.55 x single's at the longest length (cp 2 halves the
tokens each rank holds; attention's gathered keys and values are transient).
Prints a table, writes benchmarks/results/long_context.json.
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
RUNS = {"single": (["strategy=single"], 1), "cp2": (["strategy=context"], 2)}


def run(a, length: int, overrides: list[str], nproc: int, run_dir: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), f"nproc={nproc}", *overrides, "model=gpt",
           "data.task=lm", f"data.seq_len={length}", f"model.args.dim={a.dim}", f"model.args.layers={a.layers}",
           f"model.args.heads={a.heads}", f"trainer.batch_size={a.batch}", f"trainer.steps={a.steps}",
           "trainer.log_every=1", "trainer.progress=false", "trainer.timeout_s=600", f"run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def activation_peak(last: dict, nproc: int) -> int:
    """The peak live bytes of the busiest rank less weights, gradients (and DDP's buckets) and AdamW state."""
    copies = 2 if nproc == 1 else 3  # weights, gradients, + DDP buckets on several ranks
    held = [copies * p + o for p, o in zip(last["param_bytes_per_rank"], last["optim_state_bytes_per_rank"])]
    return max(m - h for m, h in zip(last["mem_peak_bytes_per_rank"], held))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_context.json"))
    a = ap.parse_args()
    rows = []
    print(f"{'seq':>6} {'run':<7} {'step s':>8} {'peak MB/rank':>13} {'act MB/rank':>12} {'act / single':>13} "
          f"{'time / single':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for length in map(int, a.lengths.split(",")):
            single = None
            for name, (overrides, nproc) in RUNS.items():
                last = run(a, length, overrides, nproc, Path(tmp) / f"{name}_{length}")
                act = activation_peak(last, nproc)
                single = single or (act, last["step_time_s"])
                row = {"seq_len": length, "run": name, "ranks": nproc, "step_time_s": last["step_time_s"],
                       "mem_peak_bytes_per_rank": last["mem_peak_bytes_per_rank"], "activation_peak_bytes": act,
                       "activation_over_single": act / single[0], "time_over_single": last["step_time_s"] / single[1]}
                rows.append(row)
                print(f"{length:>6} {name:<7} {last['step_time_s']:>8.2f} "
                      f"{max(last['mem_peak_bytes_per_rank']) / 1e6:>13.1f} {act / 1e6:>12.1f} "
                      f"{row['activation_over_single']:>13.3f} {row['time_over_single']:>14.3f}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=2))
    print("target: activation peak per rank of cp2 <= 0.55 x single's at the longest length")


if __name__ == "__main__":
    main()
