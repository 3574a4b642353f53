"""Expert parallelism against data parallelism: weights per rank and step time of the built-in `moe` on 2 ranks.

    python benchmarks/moe.py [--experts 8] [--dim 128] [--layers 4] [--steps 10] [--rounds 2]

Runs `model=moe` with 8 experts under `strategy=data` (dp 2: every rank holds every expert) and
`strategy=expert` (ep 2: each rank holds half the experts, tokens sent to them with all-to-all), alternating
for `--rounds` rounds in this invocation, and reads each run's last metrics line: the bytes of each rank's
weights, the step time (the median over rounds), the peak live tensor bytes and the routing's load imbalance.
The expected weights per rank under ep 2 are the dense weights plus half the expert weights, counted from the
model itself (target: the measured bytes equal that, i.e. the expert weights per rank are halved).
Prints a table, writes benchmarks/results/moe.json.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parallel.models.moe import build_moe  # noqa: E402

SHAPES = {"dp2": ["strategy=data"], "ep2": ["strategy=expert"]}


def model_args(a) -> dict:
    return {"vocab_size": 256, "seq_len": a.seq_len, "dim": a.dim, "heads": 4, "layers": a.layers,
            "mlp_ratio": 4, "experts": a.experts, "top_k": 2}


def run(a, overrides: list[str], run_dir: Path) -> dict:
    # vocab_size and seq_len come from the data's keys (conf/model/moe.yaml)
    args = [f"model.args.{k}={v}" for k, v in model_args(a).items() if k not in ("vocab_size", "seq_len")]
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "nproc=2", "model=moe", "data.task=lm",
           "data.vocab_size=256", f"data.seq_len={a.seq_len}", *args, *overrides, f"trainer.batch_size={a.batch}",
           f"trainer.steps={a.steps}", f"trainer.log_every={a.steps}", "trainer.progress=false", f"run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe.json"))
    a = ap.parse_args()
    with torch.device("meta"):
        model = build_moe(**model_args(a))
    expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    runs: dict[str, list[dict]] = {name: [] for name in SHAPES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for name, overrides in SHAPES.items():
                runs[name].append(run(a, overrides, Path(tmp) / f"{name}_{i}"))
    expected = {"dp2": dense + expert, "ep2": dense + expert // 2}
    print(f"weights: dense {dense / 1e6:.2f} MB, experts {expert / 1e6:.2f} MB ({a.experts} per layer)")
    print(f"{'shape':<6} {'step ms':>8} {'weights MB/rank':>16} {'expected MB':>12} {'experts MB/rank':>16} "
          f"{'peak MB/rank':>13} {'imbalance':>10}")
    rows = []
    for name, got in runs.items():
        last = got[-1]
        step = statistics.median(r["step_time_s"] for r in got)
        weights = max(last["param_bytes_per_rank"])
        row = {"shape": name, "step_time_s": step, "step_times_s": [r["step_time_s"] for r in got],
               "param_bytes_per_rank": last["param_bytes_per_rank"], "expected_param_bytes": expected[name],
               "expert_bytes_per_rank": weights - dense, "mem_peak_bytes_per_rank": last["mem_peak_bytes_per_rank"],
               "moe_load_imbalance": last.get("moe_load_imbalance")}
        rows.append(row)
        print(f"{name:<6} {step * 1e3:>8.1f} {weights / 1e6:>16.3f} {expected[name] / 1e6:>12.3f} "
              f"{(weights - dense) / 1e6:>16.3f} {max(last['mem_peak_bytes_per_rank']) / 1e6:>13.1f} "
              f"{row['moe_load_imbalance']:>10.3f}", flush=True)
    ratio = rows[1]["expert_bytes_per_rank"] / rows[0]["expert_bytes_per_rank"]
    print(f"expert weights per rank, ep2 / dp2: {ratio:.3f} (target 0.5); step time ep2 / dp2: "
          f"{rows[1]['step_time_s'] / rows[0]['step_time_s']:.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "dense_bytes": dense, "expert_bytes": expert,
                                       "expert_ratio_ep2_over_dp2": ratio, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
