"""trainer.compile: eager vs compiled step time of `gpt` on strategy=single and strategy=data (2 ranks), alternating.

    python benchmarks/compile.py [--pairs 3] [--steps 40] [--dim 128] [--layers 4] [--seq-len 64] [--batch 16]

Each setup first runs once compiled (warm-up: inductor's cache, a directory of
this invocation, then holds the blocks' code, and its compile time is the cold
one), then eager and compiled runs alternate A B A B; each reports the mean
step time of its steady-state steps (the framework leaves out the first step,
where blocks compile, and the steps it counts memory in), and the figure is
the median of the per-pair ratios compiled / eager, because timings on a
shared machine drift. Prints a table and writes benchmarks/results/compile.json.
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
SETUPS = {"single": ["nproc=1", "strategy=single"], "data x2": ["nproc=2", "strategy=data", "strategy.zero=0"]}


def run(a, setup: list[str], compiled: bool, run_dir: Path, cache: Path) -> dict:
    """(steady step time, compile time) of one run: its last metrics record."""
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *setup, "model=gpt", "data.task=lm",
           f"model.args.dim={a.dim}", f"model.args.layers={a.layers}", f"data.seq_len={a.seq_len}",
           f"trainer.batch_size={a.batch}", f"trainer.steps={a.steps}", f"trainer.log_every={a.steps}",
           "trainer.progress=false", f"trainer.compile={str(compiled).lower()}", f"run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=str(cache))
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return {"step_s": last["step_time_s"], "compile_s": last.get("compile_time_s", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile.json"))
    a = ap.parse_args()
    result = {"config": vars(a), "setups": {}}
    print(f"{'setup':>9} {'pair':>4} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} {'compile s':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "inductor"
        for name, setup in SETUPS.items():
            cold = run(a, setup, True, Path(tmp) / f"{name}-warmup", cache)["compile_s"]
            rows = []
            for i in range(a.pairs):
                e = run(a, setup, False, Path(tmp) / f"{name}-eager{i}", cache)
                c = run(a, setup, True, Path(tmp) / f"{name}-compiled{i}", cache)
                rows.append({"pair": i, "eager_step_s": e["step_s"], "compiled_step_s": c["step_s"],
                             "ratio": c["step_s"] / e["step_s"], "compile_s": c["compile_s"]})
                print(f"{name:>9} {i:>4} {e['step_s'] * 1e3:>9.2f} {c['step_s'] * 1e3:>12.2f} "
                      f"{rows[-1]['ratio']:>6.3f} {c['compile_s']:>10.1f}", flush=True)
            median = statistics.median(r["ratio"] for r in rows)
            print(f"{name}: median compiled / eager step time {median:.3f}; compile time cold {cold:.1f} s, "
                  f"cached {statistics.median(r['compile_s'] for r in rows):.1f} s")
            result["setups"][name] = {"pairs": rows, "median_ratio": median, "cold_compile_s": cold}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
