"""launch/plan.py's predicted peak against the measured one, for every strategy at three model sizes.

    python benchmarks/planner.py [--sizes 256,512,1024] [--batch 256]

For each MLP size (`model.args.hidden`, depth 4) and each strategy below, in
one invocation: one training step measured (`mem_peak_bytes_per_rank`: the
peak of live tensor bytes on the CPU) and the plan of the same configuration
(`launch/plan.py`), rank by rank, with the error. Beside them, what peers'
estimators say for the same model where they are installed: DeepSpeed's ZeRO
model-state estimators (`estimate_zero2/3_model_states_mem_needs`, GPU bytes,
no offload; they count model states only, assuming 16-bit weights) and
Accelerate's `estimate-memory` training figure (4 x the fp32 weights: weights,
gradients, two Adam moments). Neither counts activations or temporaries.
Prints a table and writes benchmarks/results/planner.json. Target: every
error <= 5%.
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

# name -> (world size, overrides, DeepSpeed stage to compare with or None)
STRATEGIES = {
    "single": (1, [], None),
    "data zero0": (2, ["strategy=data"], 2),
    "data zero3": (2, ["strategy=data", "strategy.zero=3"], 3),
    "model tp2": (2, ["strategy=model"], None),
    "pipeline 1F1B": (2, ["strategy=pipeline", "strategy.balance=params"], None),
    "pipeline interleaved": (2, ["strategy=pipeline", "strategy.schedule=Interleaved1F1B"], None),
    "hybrid dp2 x pp2": (4, ["strategy=hybrid", "strategy.dp=2", "strategy.pp=2", "strategy.balance=params"], None),
    "hybrid dp2 x tp2 z3": (4, ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.zero=3"], None),
    "hybrid pp2 x tp2": (4, ["strategy=hybrid", "strategy.pp=2", "strategy.tp=2", "strategy.balance=params"], None),
    "data zero3 recompute": (2, ["strategy=data", "strategy.zero=3", "strategy.activations=checkpoint"], 3),
    "offload": (1, ["strategy=offload", "strategy.activations=disk"], None),
}


def run(script: str, args: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / script), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{script} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def peers(hidden: int, features: int, outputs: int, depth: int, world: int, stage: int | None) -> dict:
    params = features * hidden + hidden + depth * (hidden * hidden + hidden) + hidden * outputs + outputs
    largest = hidden * hidden + hidden
    out = {}
    try:
        import accelerate  # noqa: F401

        out["accelerate"] = 4 * params * 4  # float32 training: weights, gradients, 2 Adam moments
    except ImportError:
        pass
    if stage is not None:
        try:
            if stage == 3:
                from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

                out["deepspeed"] = estimate_zero3_model_states_mem_needs(params, largest, world, 1, cpu_offload=False,
                                                                         cpu_offload_params=False)[1]
            else:
                from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

                out["deepspeed"] = estimate_zero2_model_states_mem_needs(params, world, 1, cpu_offload=False)[1]
        except Exception:  # noqa: BLE001 - not installed, or it cannot start here
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256,512,1024")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner.json"))
    a = ap.parse_args()
    rows = []
    print(f"{'hidden':>6} {'strategy':<22} {'rank':>4} {'predicted MB':>12} {'measured MB':>11} {'error':>7} "
          f"{'DeepSpeed MB':>12} {'Accelerate MB':>13}")
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        for hidden in map(int, a.sizes.split(",")):
            common = [f"model.args.hidden={hidden}", "model.args.depth=4", f"trainer.batch_size={a.batch}"]
            for name, (world, args, stage) in STRATEGIES.items():
                d = Path(tmp) / f"{hidden}-{name.replace(' ', '_')}"
                run("train.py", common + args + [f"nproc={world}", "trainer.steps=2", "trainer.log_every=1",
                                                 "trainer.progress=false", f"run_dir={d / 'run'}"])
                run("plan.py", common + args + [f"nproc={world}", f"run_dir={d / 'plan'}"])
                measured = json.loads((d / "run" / "metrics.jsonl").read_text().splitlines()[-1])
                measured = measured["mem_peak_bytes_per_rank"]
                plans = json.loads((d / "plan" / "plan.json").read_text())["ranks"]
                other = peers(hidden, 32, 4, 4, world, stage)
                for p in plans:
                    m = max(measured[r] for r in p["same_as"])
                    row = {"hidden": hidden, "strategy": name, "rank": p["rank"], "predicted": p["total"],
                           "measured": m, "error": p["total"] / m - 1, "peak_phase": p["peak_phase"], **other}
                    rows.append(row)
                    ds = f"{other['deepspeed'] / 1e6:.2f}" if "deepspeed" in other else "-"
                    acc = f"{other['accelerate'] / 1e6:.2f}" if "accelerate" in other else "-"
                    print(f"{hidden:>6} {name:<22} {p['rank']:>4} {p['total'] / 1e6:>12.2f} {m / 1e6:>11.2f} "
                          f"{row['error']:>+7.1%} {ds:>12} {acc:>13}", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"largest |error|: {worst:.1%} over {len(rows)} ranks (target <= 5%)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "rows": rows, "largest_abs_error": worst}, indent=2))


if __name__ == "__main__":
    main()
