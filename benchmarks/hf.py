"""A Hugging Face Llama (~125M parameters) on 2 CPU ranks: the framework vs hand-written PyTorch, and the planner.

    python benchmarks/hf.py [--pairs 3] [--steps 4] [--layers 12] [--hidden 768] [--batch 4] [--seq 128]
                            [--parts data,pipeline,plan]

The model is `benchmarks.hf_loop.llama` (LlamaConfig: hidden 768, 12 layers,
12 heads, 4 key/value heads, ffn 2048, vocab 32000), trained on the
framework's synthetic lm data (global batch 4 x 128 tokens), AdamW, constant
learning rate, clipping at 1.0, seed 0, in one invocation:

    data      strategy=data strategy.zero=3 vs benchmarks/hf_loop.py --loop fsdp
              (FSDP2 fully_shard per decoder layer, then the root)
    pipeline  strategy=pipeline (1F1B, 4 microbatches, split at model.layers.L/2) vs
              hf_loop.py --loop pipeline (torch.distributed.pipelining, the same split);
              run only when the framework's pipeline takes the model: otherwise the
              row says why, and the script goes on
    plan      launch/plan.py's predicted peak per rank, for each part that ran, vs the
              peak the framework's first run of that part measured

Each run takes one warm-up step, --steps timed steps and one last step (the
framework watches memory in its first and last, and leaves them out of
step_time_s; the hand-written loop reports the same steps). Runs alternate
A B A B ...; the figure is the median of the per-pair ratios, because timings
on a shared machine drift by tens of percent. The final loss of each run is
shown: the two sides train the same model on the same batches.
Targets: framework / hand-written <= 1.02; plan error <= 2%. Prints a table,
writes benchmarks/results/hf.json.
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
P = 2


def _env(a) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if a.malloc_threshold:
        # glibc serves allocations above its mmap threshold with fresh pages (a page fault per 4 KB), and
        # raises the threshold to the size of each mapped block a process frees (up to 32 MB): what a
        # process happened to free before training (the hand-written loop builds the whole model, the
        # framework a meta one) would decide how many of a step's tensors fault. Fixed for both sides, with
        # the heap trimmed above twice that, as glibc sets it when it raises the threshold itself.
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.malloc_threshold)
        env["MALLOC_TRIM_THRESHOLD_"] = str(2 * a.malloc_threshold)
    return env


def model_args(a) -> list[str]:
    """The framework's overrides for the model and data of the hand-written loops."""
    m = {"vocab_size": a.vocab, "seq_len": a.seq, "dim": a.hidden, "layers": a.layers, "heads": a.heads,
         "kv_heads": a.kv_heads, "ffn": a.ffn}
    return (["model=custom", "model._target_=benchmarks.hf_loop.llama"] + [f"+model.args.{k}={v}" for k, v in m.items()]
            + ["data.task=lm", f"data.vocab_size={a.vocab}", f"data.seq_len={a.seq}", f"trainer.batch_size={a.batch}",
               "optim.schedule=constant"])


def strategy_args(a, part: str) -> list[str]:
    if part == "data":
        return ["strategy=data", "strategy.zero=3"]
    return ["strategy=pipeline", "strategy.schedule=1F1B", f"strategy.microbatches={a.microbatches}",
            f"strategy.split_points=[model.layers.{a.layers // 2}]"]


def framework(a, part: str, run_dir: Path) -> dict:
    """The framework's run: its last record (step time of the unwatched steps, peak memory per rank)."""
    steps = a.steps + 2
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), f"nproc={P}", *model_args(a), *strategy_args(a, part),
           f"trainer.steps={steps}", f"trainer.log_every={steps}", "trainer.progress=false",
           "trainer.timeout_s=600", f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(a), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(_reason(proc))
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def handwritten(a, part: str) -> dict:
    loop = "fsdp" if part == "data" else "pipeline"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={P}",
           str(ROOT / "benchmarks" / "hf_loop.py"), f"--loop={loop}", f"--vocab={a.vocab}", f"--seq={a.seq}",
           f"--hidden={a.hidden}", f"--layers={a.layers}", f"--heads={a.heads}", f"--kv-heads={a.kv_heads}",
           f"--ffn={a.ffn}", f"--batch={a.batch}", f"--steps={a.steps + 2}", f"--microbatches={a.microbatches}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(a), cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def _reason(proc: subprocess.CompletedProcess) -> str:
    """The last line of a failed run that says what went wrong."""
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or [f"exit {proc.returncode}"])[-1][:200]


def compare(a, part: str, tmp: Path) -> dict:
    """--pairs alternating runs of the framework and the hand-written loop; None-filled when the framework fails."""
    pairs, first = [], None
    for i in range(a.pairs):
        try:
            f = framework(a, part, tmp / f"{part}{i}")
        except RuntimeError as e:
            return {"part": part, "error": str(e)}
        h = handwritten(a, part)
        first = first or f
        pairs.append({"framework_step_s": f["step_time_s"], "handwritten_step_s": h["step_time_s"],
                      "ratio": f["step_time_s"] / h["step_time_s"], "framework_loss": f["loss"],
                      "handwritten_loss": h["loss"]})
        print(f"  {part:<9} pair {i}: framework {f['step_time_s']:.3f} s  hand-written {h['step_time_s']:.3f} s  "
              f"ratio {pairs[-1]['ratio']:.3f}  losses {f['loss']:.6f} / {h['loss']:.6f}", flush=True)
    return {"part": part, "pairs": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs),
            "measured_peak_per_rank": first["mem_peak_bytes_per_rank"]}


def predict(a, part: str, tmp: Path) -> list[int]:
    """launch/plan.py's total per rank for the configuration of `part`."""
    cmd = [sys.executable, str(ROOT / "launch" / "plan.py"), *model_args(a), *strategy_args(a, part),
           f"nproc={P}", f"run_dir={tmp / ('plan-' + part)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(a), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(_reason(proc))
    ranks = json.loads((tmp / ("plan-" + part) / "plan.json").read_text())["ranks"]
    by_rank = {r: p["total"] for p in ranks for r in p["same_as"]}
    return [by_rank[r] for r in range(P)]


def table(rows: list[dict]) -> None:
    print(f"\n{'part':<9} {'framework s':>12} {'hand s':>8} {'ratio':>7}  {'rank':>4} {'predicted MB':>13} "
          f"{'measured MB':>12} {'plan err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['part']:<9} not run: the framework's run failed: {r['error']}")
            continue
        fw = statistics.median(p["framework_step_s"] for p in r["pairs"])
        hand = statistics.median(p["handwritten_step_s"] for p in r["pairs"])
        pred = r.get("predicted_peak_per_rank") or [0] * P
        for rank, measured in enumerate(r["measured_peak_per_rank"]):
            head = f"{r['part']:<9} {fw:>12.3f} {hand:>8.3f} {r['median_ratio']:>7.3f}" if rank == 0 else " " * 38
            err = f"{100 * (pred[rank] / measured - 1):>+8.2f}%" if pred[rank] else f"{'-':>9}"
            print(f"{head}  {rank:>4} {pred[rank] / 1e6:>13.2f} {measured / 1e6:>12.2f} {err}")
        if isinstance(r.get("plan_error"), str):
            print(f"{'':<9} {r['plan_error']}")
    print("targets: framework / hand-written <= 1.02 (median of pairs); plan error <= 2%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (plus a first and a last)")
    for name, default in [("vocab", 32000), ("seq", 128), ("hidden", 768), ("layers", 12), ("heads", 12),
                          ("kv-heads", 4), ("ffn", 2048), ("batch", 4), ("microbatches", 4)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--parts", default="data,pipeline,plan")
    ap.add_argument("--malloc-threshold", type=int, default=32 << 20,
                    help="glibc's mmap threshold in bytes for every run (0: glibc's own, which moves)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf.json"))
    a = ap.parse_args()
    parts = a.parts.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for part in [p for p in ("data", "pipeline") if p in parts]:
            row = compare(a, part, Path(tmp))
            if "plan" in parts and "error" not in row:
                try:
                    row["predicted_peak_per_rank"] = predict(a, part, Path(tmp))
                    row["plan_error"] = [p / m - 1 for p, m in zip(row["predicted_peak_per_rank"],
                                                                   row["measured_peak_per_rank"])]
                except RuntimeError as e:
                    row["plan_error"] = f"plan failed: {e}"
            rows.append(row)
    table(rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
