"""The planner's predictions against published runs: tokens/s per GPU, peak memory, and whether the layout fits.

    python benchmarks/scale.py [--only NAME,...] [--timeout 300] [--out PATH]
    python benchmarks/scale.py --smoke [--out PATH]   # every code path with tiny sizes, in seconds

Each row is a run someone measured and published, planned here as this
project would run it (launch/plan.py with trainer.device=cuda and the GPU's
profile, `hardware=NAME`; nothing is allocated, no GPU is needed): the
model's shape written as a Hugging Face config directory
(`LlamaConfig(...).save_pretrained`, nothing downloaded) or, for this
project's own runs, the model benchmarks/gpu.py trained. Per row: the
predicted tokens/s per GPU (plan.json `step_time.tokens_per_s_per_device`)
against the published figure, the predicted peak per rank against the
published memory, and whether the published layout is predicted to fit the
GPU it ran on. Memory is compared like with like: torchtitan reports
`torch.cuda.max_memory_reserved`, compared with the plan's `reserved` where
the plan has one (else its `total`, the allocated peak, labelled so); this
project's own runs report `max_memory_allocated`, compared with `total`.

Published runs:
  torchtitan  benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan, end of 2024; H100 96 GB HBM2e
              at 500 W: hardware=h100_96gb). Seq 8192 and AdamW from the train presets of that time (the
              tables give no sequence length); local batch = per data-parallel rank. Rows that need Float8 or
              torch.compile are not planned (SKIPPED); the 70B and 405B rows ran with both, so only their
              memory is a comparison (their tokens/s are printed, no target).
  this project  the 697M Llama of benchmarks/gpu.py (single, and offload of weights and AdamW state) on the
              H200 (benchmarks/results/gpu.json) and the H100 (gpu_h100.json), read from those files.

Targets, reported and never tuned toward (no profile is fitted to these runs): tokens/s within 15%, memory
within 10%, every published layout predicted to fit. Each plan runs under --timeout (default 300 s); one
that does not finish is a row "not planned" with the reason and the time. Writes
benchmarks/results/scale.json (dated); --smoke a temp file (never the results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import GPU, OFFLOAD, RunFailed, forked_proc  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "scale.json"
GIB = 1 << 30
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_URL = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
TOKENS_TARGET, MEMORY_TARGET = 0.15, 0.10

# Llama 3.1's shapes (Meta's model cards, as torchtitan's model args); vocab 128256, rope theta 500000
LLAMA31 = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
    "405b": {"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128},
}
# --smoke: a 2-block Llama of the same kind, 8 heads so that tp 8 divides them
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8}
TINY_VOCAB, TINY_SEQ = 256, 32

# --smoke's rows: one of each kind (a fallback after a failed plan, hybrid, a refused layout, single, offload)
SMOKE_ROWS = ["titan-8b-8", "titan-70b-256", "titan-405b-512", "697m-single-h200", "697m-offload-h100"]
# torchtitan's op policy (every second product recomputed), and this project's default op (every product saved)
SELECTIVE_TITAN = ["strategy.activations=selective", "strategy.selective=op_alternate"]
SELECTIVE_OP = ["strategy.activations=selective", "strategy.selective=op"]
FULL = ["strategy.activations=checkpoint"]
# torchtitan's Llama tensor-parallel plan: norms on sequence shards, the loss on logits split by the vocabulary
SEQUENCE_LOSS = ["strategy.sequence_parallel=true", "strategy.loss_parallel=true"]
# published rows left out, and why
SKIPPED = [
    "Table 1 and Table 3, FSDP + torch.compile (6,667 and 6,514 tokens/s) and + Float8 (8,532 and 8,380): "
    "compiled and Float8 steps, which the planner does not price",
    "Table 2 (FSDP + CP, seq 32768-262144): every row ran with torch.compile and Float8",
    "Table 4, 2D + AsyncTP (876 tokens/s, 67.6 GiB): async tensor parallelism needs torch.compile",
    "Table 5, 1F1B (100 tokens/s, 82.5 GiB): only the interleaved row is planned (one 405B plan is the slowest here)",
    "Table 6 (FSDP + TP + PP + CP, seq 32768-262144): Float8, compile and async TP; context parallelism over a "
    "pipeline",
]


@dataclass
class Row:
    """One published run: where from, its layout as overrides, what it published, the GPU it ran on."""
    name: str
    source: str
    layout: str
    model: str  # a key of LLAMA31, or "gpu.py" (benchmarks/gpu.py's model)
    hardware: str
    nproc: int
    overrides: list[str]
    published_tokens: float
    published_memory: int
    memory_kind: str  # what the published figure counts: reserved or allocated
    settings: dict
    variants: dict = field(default_factory=lambda: {"as published": []})  # label -> overrides added
    tokens_target: bool = True  # False where the published step used what the plan cannot price
    smoke: dict = field(default_factory=dict)  # --smoke: keys replaced (nproc, overrides)


def titan_rows() -> list[Row]:
    common = {"seq_len": 8192, "bf16": "FSDP2 mixed precision (bf16 parameters, fp32 reduction)"}
    fsdp = ["strategy=data", "strategy.zero=3"]
    variants = {"as published (selective op: every second product recomputed)": SELECTIVE_TITAN,
                "selective op, every product saved": SELECTIVE_OP, "full recomputation": FULL,
                "no recomputation": ["strategy.activations=device"]}
    rows = [
        Row("titan-8b-8", f"{TITAN}, Table 1, row FSDP", "FSDP 8 (zero 3), 8 GPUs", "8b", "h100_96gb", 8,
            fsdp + ["trainer.batch_size=16"], 5762, round(82.4 * GIB), "reserved",
            {**common, "local_batch": 2, "global_batch": 16, "activation_checkpointing": "selective (op)",
             "float8": False, "compile": False, "async_tp": False}, dict(variants)),
        Row("titan-8b-128", f"{TITAN}, Table 3, row FSDP", "FSDP 128 (zero 3), 16 nodes", "8b", "h100_96gb", 128,
            fsdp + ["trainer.batch_size=256"], 5605, round(67.0 * GIB), "reserved",
            {**common, "local_batch": 2, "global_batch": 256, "activation_checkpointing": "selective (op)",
             "float8": False, "compile": False, "async_tp": False}, dict(variants),
            smoke={"nproc": 16, "overrides": fsdp + ["trainer.batch_size=32"]}),
        Row("titan-70b-256", f"{TITAN}, Table 4, row 2D", "FSDP 32 x TP 8 (zero 3), 32 nodes", "70b", "h100_96gb",
            256, ["strategy=hybrid", "strategy.dp=32", "strategy.tp=8", "strategy.zero=3", "trainer.batch_size=512"],
            829, round(71.9 * GIB), "reserved",
            {**common, "local_batch": 16, "global_batch": 512, "activation_checkpointing": "full", "float8": True,
             "compile": True, "async_tp": False, "sequence_parallel": "torchtitan's TP plan: yes; planned: yes",
             "loss_parallel": "torchtitan's default with TP: yes; planned: yes"},
            {"as published (full recomputation, sequence and loss parallelism)": FULL + SEQUENCE_LOSS,
             "full recomputation, no sequence or loss parallelism": FULL}, tokens_target=False,
            smoke={"nproc": 4, "overrides": ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.zero=3",
                                             "trainer.batch_size=4"]}),
        Row("titan-405b-512", f"{TITAN}, Table 5, row Interleaved 1F1B", "FSDP 8 x TP 8 x PP 8, interleaved, 64 nodes",
            "405b", "h100_96gb", 512,
            ["strategy=hybrid", "strategy.dp=8", "strategy.tp=8", "strategy.pp=8", "strategy.zero=3",
             "strategy.schedule=Interleaved1F1B", "strategy.stages_per_rank=2", "strategy.microbatches=32",
             "trainer.batch_size=256"], 128, round(72.7 * GIB), "reserved",
            {**common, "local_batch": 32, "global_batch": 256, "activation_checkpointing": "full", "float8": True,
             "compile": True, "async_tp": True, "microbatches": "32 (torchtitan's default microbatch size 1)",
             "stages_per_rank": "2 (assumed: the file does not say)",
             "sequence_parallel": "torchtitan's TP plan: yes; planned: no (refused over a pipeline's traced blocks)",
             "loss_parallel": "torchtitan's default with TP: yes; planned: no (a stage's loss is the schedule's)"},
            {"as published (full recomputation)": FULL}, tokens_target=False,
            smoke={"nproc": 8, "overrides": ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.pp=2",
                                             "strategy.zero=3", "strategy.microbatches=2", "trainer.batch_size=4"]}),
    ]
    for r in rows:
        r.settings["url"] = TITAN_URL
    return rows


def own_rows() -> list[Row]:
    """benchmarks/gpu.py's single and offload runs of its 697M Llama, as its results files hold them."""
    rows = []
    tokens = GPU["batch"] * GPU["seq"]
    for gpu, path in (("h200", "gpu.json"), ("h100", "gpu_h100.json")):
        res = json.loads((ROOT / "benchmarks" / "results" / path).read_text())["rows"]
        single, offload = res["single_vs_hand"], res["offload"]
        where = f"benchmarks/results/{path}"
        rows += [
            Row(f"697m-single-{gpu}", f"this project, {where} (single_vs_hand: tokens_per_s, mem_peak_bytes)",
                f"single, 1 {gpu.upper()}", "gpu.py", gpu, 1, ["strategy=single"], single["tokens_per_s"],
                single["mem_peak_bytes"], "allocated", {"file": where, "seq_len": GPU["seq"], "batch": GPU["batch"]}),
            Row(f"697m-offload-{gpu}", f"this project, {where} (offload: tokens / offload_step_s, "
                f"mem_peak_bytes.offload)", f"offload (weights, AdamW state on the host), 1 {gpu.upper()}", "gpu.py",
                gpu, 1, OFFLOAD, tokens / offload["offload_step_s"], offload["mem_peak_bytes"]["offload"],
                "allocated", {"file": where, "seq_len": GPU["seq"], "batch": GPU["batch"]}),
        ]
    return rows


def write_config(shape: dict, vocab: int, seq: int, path: Path) -> None:
    """A Llama config directory of `shape` (nothing downloaded): what model=hf model.path=DIR reads."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab, num_key_value_heads=8, max_position_embeddings=seq, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False, architectures=["LlamaForCausalLM"],
                **shape).save_pretrained(path)


def model_overrides(row: Row, smoke: bool, tmp: Path) -> list[str]:
    vocab, seq = (TINY_VOCAB, TINY_SEQ) if smoke else (128256, 8192)
    if row.model == "gpu.py":  # as benchmarks/gpu.py gives it to the framework (its Bench.common)
        if smoke:
            sizes = {"vocab": TINY_VOCAB, "seq": TINY_SEQ, "dim": 64, "layers": 2, "heads": 8, "kv_heads": 8,
                     "ffn": 128, "batch": 4}
        else:
            sizes = {"vocab": GPU["vocab"], "seq": GPU["seq"], "dim": GPU["hidden"], "layers": GPU["layers"],
                     "heads": GPU["heads"], "kv_heads": GPU["kv_heads"], "ffn": GPU["ffn"], "batch": GPU["batch"]}
        args = {"vocab_size": sizes["vocab"], "seq_len": sizes["seq"], "dim": sizes["dim"], "layers": sizes["layers"],
                "heads": sizes["heads"], "kv_heads": sizes["kv_heads"], "ffn": sizes["ffn"]}
        return (["model=custom", "model._target_=benchmarks.hf_loop.llama"]
                + [f"+model.args.{k}={v}" for k, v in args.items()]
                + [f"data.vocab_size={sizes['vocab']}", f"data.seq_len={sizes['seq']}",
                   f"trainer.batch_size={sizes['batch']}", "optim.schedule=constant", "trainer.clip_grad_norm=0"])
    directory = tmp / f"llama-{row.model}{'-tiny' if smoke else ''}"
    if not directory.exists():
        write_config(TINY if smoke else LLAMA31[row.model], vocab, seq, directory)
    return [f"model.path={directory}", "model=hf", "model.pretrained=false", f"data.vocab_size={vocab}",
            f"data.seq_len={seq}"]


def run_plan(cmd: list[str], env: dict, timeout: float, smoke: bool) -> tuple[subprocess.CompletedProcess, float,
                                                                              int | None]:
    """launch/plan.py to its end: the process, its wall seconds and its peak RSS in bytes (None with --smoke, whose
    plans are forked from this process: benchmarks/gpu.py `forked_proc`). RunFailed at the timeout."""
    t0 = time.perf_counter()
    if smoke:
        proc = forked_proc(cmd, env, timeout)
        return proc, time.perf_counter() - t0, None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=ROOT, start_new_session=True)
        while True:  # wait4, not wait: the child's own peak RSS
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                os.killpg(p.pid, signal.SIGKILL)
                os.wait4(p.pid, 0)
                raise RunFailed(f"timed out after {timeout:.0f} s")
            time.sleep(0.2)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read())
    return proc, time.perf_counter() - t0, usage.ru_maxrss * 1024  # Linux: KiB


def last_line(text: str) -> str:
    """The error's own line: the last but Hydra's advice on HYDRA_FULL_ERROR and torch's call lines."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not ln.startswith(("Set the environment", " "))]
    return lines[-1].strip()[:400] if lines else ""


def plan_variant(row: Row, label: str, extra: list[str], a, tmp: Path) -> dict:
    """One plan of `row` with `extra` overrides: predicted against published, or why it was not planned."""
    nproc = row.smoke.get("nproc", row.nproc) if a.smoke else row.nproc
    layout = row.smoke.get("overrides", row.overrides) if a.smoke else row.overrides
    run_dir = tmp / f"{row.name}-{len(os.listdir(tmp))}"
    cmd = [sys.executable, str(ROOT / "launch" / "plan.py"), *model_overrides(row, a.smoke, tmp), "data.task=lm",
           *layout, *extra, "trainer.device=cuda", "trainer.precision=bf16", f"hardware={row.hardware}",
           f"nproc={nproc}", f"run_dir={run_dir}"]
    out = {"row": row.name, "variant": label, "source": row.source, "layout": row.layout, "hardware": row.hardware,
           "nproc": nproc, "overrides": cmd[2:-1], "settings": row.settings, "published_tokens_per_s": row.published_tokens,
           "published_memory_bytes": row.published_memory, "published_memory_kind": row.memory_kind,
           "tokens_target_applies": row.tokens_target}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    try:
        proc, wall, rss = run_plan(cmd, env, a.timeout, a.smoke)
    except RunFailed as e:
        return {**out, "planned": False, "reason": str(e), "plan_s": a.timeout}
    out.update(plan_s=round(wall, 1), plan_peak_rss_bytes=rss)
    if proc.returncode != 0:
        return {**out, "planned": False, "reason": last_line(proc.stderr) or last_line(proc.stdout)}
    plan = json.loads((run_dir / "plan.json").read_text())
    gpu_memory = hardware_memory(row.hardware)
    field_used = "reserved" if row.memory_kind == "reserved" and plan["ranks"][0].get("reserved") is not None \
        else "total"
    memory = max(r.get(field_used) or r["total"] for r in plan["ranks"])
    step = plan["step_time"]
    tokens = step.get("tokens_per_s_per_device")
    out.update(planned=True, predicted_tokens_per_s=tokens, predicted_step_s=step["predicted_s"]["step"],
               predicted_terms_s={k: v for k, v in step["predicted_s"].items() if isinstance(v, float)},
               mfu=step.get("mfu"), predicted_memory_bytes=memory, predicted_memory_field=field_used,
               gpu_memory_bytes=gpu_memory, fits=memory <= gpu_memory, left_out=step.get("left_out"))
    if not a.smoke:  # the smoke's tiny sizes are no figures: nothing to compare with
        out["tokens_ratio"] = tokens / row.published_tokens if tokens else None
        out["memory_ratio"] = memory / row.published_memory
        out["tokens_within_target"] = abs(out["tokens_ratio"] - 1) <= TOKENS_TARGET if tokens and row.tokens_target \
            else None
        out["memory_within_target"] = abs(out["memory_ratio"] - 1) <= MEMORY_TARGET
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def hardware_memory(name: str) -> int:
    from omegaconf import OmegaConf

    return int(float(OmegaConf.load(ROOT / "conf" / "hardware" / f"{name}.yaml").memory_bytes))


def mark(ok) -> str:
    return "-" if ok is None else "pass" if ok else "FAIL"


def table(rows: list[dict]) -> None:
    print(f"\n{'row':<16} {'variant':<29} {'plan s':>6} {'RSS MB':>6} {'pred tok/s':>10} {'pub tok/s':>9} "
          f"{'ratio':>6} {'±15%':>4} {'pred GiB':>8} {'field':>8} {'pub GiB':>7} {'kind':>9} {'ratio':>6} "
          f"{'±10%':>4} fits")
    for r in rows:
        head = f"{r['row']:<16} {r['variant']:<29} {r.get('plan_s', 0):>6.1f} " + \
            (f"{r['plan_peak_rss_bytes'] / 1e6:>6.0f}" if r.get("plan_peak_rss_bytes") else f"{'-':>6}")
        if not r["planned"]:
            print(f"{head} not planned: {r['reason']}")
            continue
        tok = r["predicted_tokens_per_s"]
        ratio = f"{r['tokens_ratio']:>6.2f}" if r.get("tokens_ratio") else f"{'-':>6}"
        mratio = f"{r['memory_ratio']:>6.2f}" if "memory_ratio" in r else f"{'-':>6}"
        print(f"{head} {tok or 0:>10,.0f} {r['published_tokens_per_s']:>9,.0f} {ratio} "
              f"{mark(r.get('tokens_within_target')):>4} {r['predicted_memory_bytes'] / GIB:>8.1f} "
              f"{r['predicted_memory_field']:>8} {r['published_memory_bytes'] / GIB:>7.1f} "
              f"{r['published_memory_kind']:>9} {mratio} {mark(r.get('memory_within_target')):>4} "
              f"{'yes' if r['fits'] else 'NO'}")


def summary(rows: list[dict]) -> dict:
    planned = [r for r in rows if r["planned"]]
    tok = [r for r in planned if r.get("tokens_within_target") is not None]
    mem = [r for r in planned if r.get("memory_within_target") is not None]
    return {"tokens_within_15pct": f"{sum(r['tokens_within_target'] for r in tok)} of {len(tok)}",
            "memory_within_10pct": f"{sum(r['memory_within_target'] for r in mem)} of {len(mem)}",
            "predicted_to_fit": f"{sum(r['fits'] for r in planned)} of {len(planned)}",
            "not_planned": [f"{r['row']} ({r['variant']}): {r['reason']}" for r in rows if not r["planned"]]}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a 2-block Llama, seq 32: every code path in seconds")
    ap.add_argument("--only", default=None, help="comma list of row names (default: all)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per plan (default 300; --smoke 60)")
    ap.add_argument("--out", default=None, help=f"the JSON (default {RESULTS.relative_to(ROOT)}; --smoke: "
                                                "scale_smoke.json in the temp directory)")
    a = ap.parse_args()
    a.timeout = a.timeout or (60.0 if a.smoke else 300.0)
    a.out = Path(a.out) if a.out else Path(tempfile.gettempdir()) / "scale_smoke.json" if a.smoke else RESULTS
    if a.smoke and a.out.resolve().parent == RESULTS.parent.resolve():
        ap.error(f"--smoke never writes into {RESULTS.parent.relative_to(ROOT)}: give another --out")
    names = [r.name for r in titan_rows() + own_rows()]
    a.only = [n.strip() for n in a.only.split(",")] if a.only else SMOKE_ROWS if a.smoke else names
    if unknown := sorted(set(a.only) - set(names)):
        ap.error(f"--only: unknown {unknown}; valid: {', '.join(names)}")
    return a


def main() -> None:
    a = parse()
    t0 = time.perf_counter()
    rows = [r for r in titan_rows() + own_rows() if r.name in a.only]
    if a.smoke:  # one variant each, but the row whose first fails: the fallback path is exercised there
        for r in rows:
            r.variants = dict(list(r.variants.items())[:2 if r.name == "titan-8b-8" else 1])
    result = {"date": datetime.date.today().isoformat(), "smoke": a.smoke, "host": platform.node(),
              "cpus": os.cpu_count(), "python": platform.python_version(),
              "targets": {"tokens_per_s": f"within {TOKENS_TARGET:.0%}", "memory": f"within {MEMORY_TARGET:.0%}",
                          "fits": "every published layout predicted to fit"},
              "skipped": SKIPPED, "rows": []}
    # Removed here, not by a TemporaryDirectory: its clean-up would run at the exit of every forked plan.
    tmp = Path(tempfile.mkdtemp(prefix="scale_bench_"))
    try:
        for row in rows:
            for label, extra in row.variants.items():
                out = plan_variant(row, label, extra, a, tmp)
                result["rows"].append(out)
                state = f"{out['plan_s']:.1f} s" + ("" if out["planned"] else f", not planned: {out['reason']}")
                print(f"[scale.py {time.strftime('%H:%M:%S')}] {row.name} ({label}): {state}", flush=True)
                result.update(summary=summary(result["rows"]), wall_s=round(time.perf_counter() - t0, 1))
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table(result["rows"])
    print(f"targets: tokens/s within 15% ({result['summary']['tokens_within_15pct']}, rows with a comparable "
          f"step), memory within 10% ({result['summary']['memory_within_10pct']}), predicted to fit "
          f"({result['summary']['predicted_to_fit']})" + (" | smoke: tiny sizes, no figures" if a.smoke else ""))
    print("skipped: " + "; ".join(SKIPPED))
    print(f"wrote {a.out} ({result['wall_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
