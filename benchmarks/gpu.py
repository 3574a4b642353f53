"""The GPU table: single vs a hand-written loop, offload, a memory cap, the planner vs the allocator, compile.

    python benchmarks/gpu.py [--pairs 2] [--steps 10] [--rows single_vs_hand,offload,capped,planner,compile]
                             [--prefetch 1,2,4]
    python benchmarks/gpu.py --smoke [--out PATH]   # the same rows on the CPU with tiny sizes (the test suite's)

The model is `benchmarks.hf_loop.llama` (LlamaConfig: hidden 2048, 12 layers,
16 heads, 8 key/value heads, intermediate 5632, vocab 32000: 697M parameters),
given to the framework as `model=custom model._target_=benchmarks.hf_loop.llama`
(nothing downloaded), on the framework's synthetic lm data (global batch 8 x
2048 tokens), AdamW (lr 5e-3, weight decay 0.01, constant), seed 0,
trainer.precision=bf16, trainer.clip_grad_norm=0 everywhere (offload's step
overlaps backward only without clipping, and one resident run then serves as
the reference of every row; the framework still computes the gradient norm it
logs, the hand-written loop does not), one device.

    single_vs_hand  strategy=single vs benchmarks/gpu_loop.py (the same model, seed, batches and AdamW in
                    plain PyTorch under bf16 autocast): framework / hand-written step time, the framework's
                    MFU and tokens/s from metrics.jsonl (the hand-written loop's MFU: the same FLOPs at the
                    same peak), the final losses
    offload         strategy=offload strategy.params=cpu strategy.optimizer=cpu vs single: the step-time
                    ratio (target <= 1.3), the bytes it moved per step (metrics' offload_*_bytes), the
                    pinned host<->device copy bandwidth measured here with CUDA events, and the transfer
                    bound: those bytes at that bandwidth (the harmonic mean of the two directions: exact when
                    half goes each way), the step if transfers overlapped neither compute nor each other;
                    and the duplex bound: both directions at once (those bytes over the sum of the two
                    rates), the step if they overlapped each other and compute perfectly. --prefetch
                    1,2,4: offload at each strategy.prefetch, every one in the same rounds against the same
                    single run (the row's figure is the first value's; the others' ratios and peaks
                    beside it): what each block read further ahead buys, and its device memory
    capped          memory.fraction midway between single's measured peak and the lower of offload's and
                    single with recomputation's (of the GPU's total): single must fail with the one-line
                    `error: out of GPU memory ...` (exit 1, no traceback), and offload with
                    strategy.activations=checkpoint must train (its peak)
    planner         launch/plan.py (the same overrides; trainer.device=cuda) predicted peak vs the measured
                    mem_peak_bytes (torch.cuda.max_memory_allocated) for single, offload and single with
                    strategy.activations=checkpoint (target: within 5%)
    compile         trainer.compile=true vs eager single: the ratio, compile_time_s cold (a first compiled
                    run fills this invocation's inductor cache) and cached (the paired runs)

Each run takes a warm-up step, --steps timed steps and a last step (the
framework counts memory in its first and last and leaves them out of
step_time_s; the hand-written loop times the same steps). The timed runs go in
rounds, single, hand-written, offload, compiled, in reverse order every other
round so that drift does not favour one side; each row's figure is the median
over rounds of its per-round step-time ratio (framework / hand-written,
offload / single, compiled / single: A B A B pairs sharing the single run). The
plans (on the CPU) run beside the untimed runs after the rounds. All rows with
--pairs 2: 12 runs of the model (one at a time) and 3 plans; --rows splits the
work over several sessions. Every subprocess has a timeout (--timeout, default
1200 s); a failed run makes its row say so and the script goes on, except with
--smoke, which stops with the failure. The GPU's name and torch's version head
the table and the JSON, benchmarks/results/gpu.json, rewritten after each row
(--smoke: --out, default gpu_smoke.json in the temp directory; never the GPU
results).

--smoke: a Llama of hidden 64, 2 layers, seq 32, batch 4, vocab 256, 2 timed
steps, one round, on the CPU in fp32 (trainer.precision=auto), the copy
bandwidth a plain memcpy. There the cpu tier is the device itself, so offload
moves nothing and has no bound; the out-of-memory half of `capped` says "needs
CUDA" (its offload run trains uncapped); `compile` is skipped (a cold compile
costs 25-33 s on 2 CPU cores) unless --rows names it; the plans run first (the
smoke's timings are no figures). Its runs and plans are forked from this
process once it has imported what they import, where that gives the process a
new interpreter would (`forked_proc`): a run of the tiny model is then ~1 s,
not ~5 s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu.json"
ROWS = ("single_vs_hand", "offload", "capped", "planner", "compile")
GPU = {"vocab": 32000, "seq": 2048, "hidden": 2048, "layers": 12, "heads": 16, "kv_heads": 8, "ffn": 5632, "batch": 8}
SMOKE = {"vocab": 256, "seq": 32, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "batch": 4}
OFFLOAD = ["strategy=offload", "strategy.params=cpu", "strategy.optimizer=cpu"]
# Framework configurations by name: the strategy overrides beside the common ones (`Bench.common`).
VARIANTS = {
    "single": ["strategy=single"],
    "offload": OFFLOAD,
    "compiled": ["strategy=single", "trainer.compile=true"],
    "single_checkpoint": ["strategy=single", "strategy.activations=checkpoint"],
    "offload_checkpoint": OFFLOAD + ["strategy.activations=checkpoint"],
}
OOM_LINE = "error: out of GPU memory"


class RunFailed(RuntimeError):
    """A subprocess failed or timed out; the message says why in one line."""


def log(msg: str) -> None:
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_proc(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`cmd` to its end or `timeout` seconds; on a timeout its whole process group is killed (a launcher's
    workers too) and RunFailed says so."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RunFailed(f"timed out after {timeout:.0f} s: {' '.join(cmd[1:3])}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def forked_proc(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """--smoke: `cmd` (`python <script> *args`) as run_proc runs it, but forked from this process once it has
    imported what the runs import (tests/zygote.py, the test suite's zygote): a run of the tiny model then skips
    the ~4 s of imports of a new interpreter, and is otherwise the process the command starts (tests/zygote.py
    `_child`: its own pid and process group, arguments, directory, environment, output, exit status). A new
    interpreter where a fork would not give that process (tests/zygote.py `forkable`)."""
    if str(ROOT) not in sys.path:  # this script's directory is benchmarks/; the runs' PYTHONPATH holds ROOT
        sys.path.append(str(ROOT))
    from tests import zygote

    if cmd[0] != sys.executable or not zygote.forkable(env):
        return run_proc(cmd, env, timeout)
    try:
        return zygote.run_forked(cmd, ROOT, env, timeout)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"timed out after {timeout:.0f} s: {' '.join(cmd[1:3])}") from None


class Inline:
    """--smoke's executor: each call runs at once, in this thread. Its runs are forked from this process
    (`forked_proc`), which no thread of a pool may share."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args) -> Future:
        done = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - handed to whoever asks the future, as a pool's would be
            done.set_exception(e)
        return done


def reason(proc: subprocess.CompletedProcess) -> str:
    """The last line of a failed run that says what went wrong."""
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return f"exit {proc.returncode}: " + (errors or lines or [""])[-1][:300]


def probe(cuda: bool, nbytes: int = 256 << 20, reps: int = 10) -> dict:
    """torch's version, the device, and the copy bandwidth between host and device: pinned copies timed with
    CUDA events each way, or on the CPU a plain memcpy of a tensor. Run in a subprocess under CUDA, so that
    this script's process holds no GPU memory while the runs measure theirs."""
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version()}
    if not cuda:
        src, dst = torch.empty(nbytes // 4, dtype=torch.uint8), torch.empty(nbytes // 4, dtype=torch.uint8)
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        bw = reps * src.numel() / (time.perf_counter() - t0)
        return out | {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                      "total_memory": None, "h2d_bytes_per_s": bw, "d2h_bytes_per_s": bw, "copy": "memcpy"}
    props = torch.cuda.get_device_properties(0)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates[f"{name}_bytes_per_s"] = reps * nbytes / (start.elapsed_time(end) / 1e3)
    return out | {"device": props.name, "total_memory": props.total_memory, "copy": "pinned, CUDA events",
                  "cuda": torch.version.cuda} | rates


class Bench:
    """One invocation: its sizes, overrides, temp directory, and every run's record by configuration."""

    def __init__(self, a, tmp: Path, info: dict):
        self.a, self.tmp, self.info = a, tmp, info
        self.sizes = SMOKE if a.smoke else GPU
        s = self.sizes
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"))
        if a.smoke:
            self.env["OMP_NUM_THREADS"] = "1"
        model = {"vocab_size": s["vocab"], "seq_len": s["seq"], "dim": s["hidden"], "layers": s["layers"],
                 "heads": s["heads"], "kv_heads": s["kv_heads"], "ffn": s["ffn"]}
        self.common = (["model=custom", "model._target_=benchmarks.hf_loop.llama"]
                       + [f"+model.args.{k}={v}" for k, v in model.items()]
                       + ["data.task=lm", f"data.vocab_size={s['vocab']}", f"data.seq_len={s['seq']}",
                          f"trainer.batch_size={s['batch']}", "optim.schedule=constant", "trainer.clip_grad_norm=0"]
                       + (["trainer.device=cpu"] if a.smoke else ["trainer.device=cuda", "trainer.precision=bf16"]))
        self.records: dict[str, list[dict]] = {}  # configuration -> each run's record (or {"error": ...})
        self.count = 0
        self.start = forked_proc if a.smoke else run_proc  # how a subprocess runs: (cmd, env, timeout) -> its end

    def overrides(self, name: str) -> list[str]:
        if name.startswith("offload_p"):  # --prefetch beyond its first value
            return self.common + VARIANTS["offload"] + [f"strategy.prefetch={name.removeprefix('offload_p')}"]
        return self.common + VARIANTS[name] + ([f"strategy.prefetch={self.a.prefetch[0]}"] if name == "offload" else [])

    def train(self, args: list[str]) -> tuple[subprocess.CompletedProcess, dict | None]:
        """One launch/train.py run of --steps + 2 steps: the process and its last metrics record (None if none)."""
        self.count += 1
        run_dir = self.tmp / f"run{self.count}"
        steps = self.a.steps + 2
        cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *args, f"trainer.steps={steps}",
               f"trainer.log_every={steps}", "trainer.progress=false", f"trainer.timeout_s={int(self.a.timeout)}",
               f"run_dir={run_dir}"]
        try:
            proc = self.start(cmd, self.env, self.a.timeout)
            metrics = run_dir / "metrics.jsonl"
            lines = metrics.read_text().splitlines() if proc.returncode == 0 and metrics.exists() else []
            return proc, (json.loads(lines[-1]) if lines else None)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)  # a 697M model's run may leave its initial weights

    def framework(self, name: str, extra: list[str] = ()) -> dict:
        """The last record of a run of configuration `name`; RunFailed when it fails."""
        proc, record = self.train(self.overrides(name) + list(extra))
        if proc.returncode != 0 or record is None:
            raise RunFailed(f"train.py {name}: {reason(proc)}")
        return record

    def hand(self) -> dict:
        s = self.sizes
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_loop.py"), f"--device={'cpu' if self.a.smoke else 'cuda'}",
               *([] if self.a.smoke else ["--bf16"]), f"--steps={self.a.steps + 2}"]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in s.items()]
        proc = self.start(cmd, self.env, self.a.timeout)
        if proc.returncode != 0:
            raise RunFailed(f"gpu_loop.py: {reason(proc)}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def attempt(self, name: str, key: str | None = None) -> dict:
        """A run of `name` ("hand": the hand-written loop), kept in `records` under `key` (default `name`): its
        record, or {"error": why} (with --smoke the failure stops the script)."""
        log(f"run {name}")
        t0 = time.perf_counter()
        try:
            record = self.hand() if name == "hand" else self.framework(name)
        except RunFailed as e:
            if self.a.smoke:
                raise
            log(f"  {name} failed: {e}")
            record = {"error": str(e)}
        else:
            log(f"  {name}: step {record['step_time_s']:.4f} s, loss {record['loss']:.6f} "
                f"({time.perf_counter() - t0:.0f} s in all)")
        self.records.setdefault(key or name, []).append(record)
        return record

    def first(self, name: str) -> dict:
        """The first good record of `name` (its last error when every run failed), running it when none has."""
        runs = self.records.get(name, [])
        return next((r for r in runs if "error" not in r), runs[-1]) if runs else self.attempt(name)

    def rounds(self, names: list[str]) -> None:
        """--pairs rounds of the timed runs, in reverse order every other round."""
        for i in range(self.a.pairs):
            log(f"round {i + 1}/{self.a.pairs}")
            for name in names if i % 2 == 0 else names[::-1]:
                self.attempt(name)

    def plan(self, name: str) -> int:
        """launch/plan.py's predicted peak (rank 0's total) for configuration `name`."""
        run_dir = self.tmp / f"plan-{name}"
        cmd = [sys.executable, str(ROOT / "launch" / "plan.py"), *self.overrides(name), "nproc=1",
               f"run_dir={run_dir}"]
        proc = self.start(cmd, self.env, self.a.timeout)
        if proc.returncode != 0 or not (run_dir / "plan.json").exists():
            raise RunFailed(f"plan.py {name}: {reason(proc)}")
        return json.loads((run_dir / "plan.json").read_text())["ranks"][0]["total"]


def paired(b: Bench, name: str, ref: str) -> list[dict]:
    """Per round: `name`'s record against `ref`'s (single or hand) and the step-time ratio name / ref."""
    out = []
    for x, r in zip(b.records.get(name, []), b.records.get(ref, [])):
        if "error" in x or "error" in r:
            out.append({"error": x.get("error") or r.get("error")})
            continue
        out.append({name: x, ref: r, "ratio": x["step_time_s"] / r["step_time_s"]})
    return out


def ratio_row(pairs: list[dict], name: str, ref: str) -> dict:
    """The median ratio of the good pairs, the medians of both step times, the losses; or the error."""
    good = [p for p in pairs if "error" not in p]
    if not good:
        return {"error": next((p["error"] for p in pairs), "not run")}
    med = statistics.median
    return {"median_ratio": med(p["ratio"] for p in good), "ratios": [p["ratio"] for p in good],
            f"{name}_step_s": med(p[name]["step_time_s"] for p in good),
            f"{ref}_step_s": med(p[ref]["step_time_s"] for p in good),
            f"{name}_loss": good[-1][name]["loss"], f"{ref}_loss": good[-1][ref]["loss"],
            "loss_rel_diff": max(abs(p[name]["loss"] / p[ref]["loss"] - 1) for p in good),
            "failed_pairs": [p["error"] for p in pairs if "error" in p]}


def single_vs_hand_row(b: Bench) -> dict:
    pairs = paired(b, "single", "hand")
    row = ratio_row(pairs, "single", "hand")  # single / hand: framework / hand-written
    good = [p for p in pairs if "error" not in p]
    if "error" in row:
        return row
    mfu = [p["single"].get("mfu") for p in good]
    known = all(m is not None for m in mfu)  # an unknown GPU logs no mfu (docs/observability.md)
    return row | {
        "mfu": statistics.median(mfu) if known else None,
        # The same model FLOPs per step at the same peak, in the hand-written loop's time.
        "hand_mfu": statistics.median(m * p["ratio"] for m, p in zip(mfu, good)) if known else None,
        "tokens_per_s": statistics.median(p["single"]["tokens_per_s"] for p in good),
        "hand_tokens_per_s": statistics.median(p["hand"]["tokens_per_s"] for p in good),
        "mem_peak_bytes": good[0]["single"]["mem_peak_bytes"],
        "hand_mem_peak_bytes": good[0]["hand"].get("mem_peak_bytes")}


def offload_row(b: Bench) -> dict:
    pairs = paired(b, "offload", "single")
    row = ratio_row(pairs, "offload", "single")
    if "error" in row:
        return row
    good = [p["offload"] for p in pairs if "error" not in p]
    kinds = ("params", "optimizer", "activations")
    moved = statistics.median(sum(r.get(f"offload_{k}_bytes", 0.0) for k in kinds) for r in good)
    h2d, d2h = b.info["h2d_bytes_per_s"], b.info["d2h_bytes_per_s"]
    bandwidth = 2 / (1 / h2d + 1 / d2h)  # half the bytes each way, one direction at a time
    bound = moved / bandwidth
    row |= {"bytes_moved_per_step": moved, "moved_by_kind": {k: good[-1].get(f"offload_{k}_bytes") for k in kinds},
            "wait_s_per_step": statistics.median(r.get("offload_wait_s", 0.0) for r in good),
            "copy_bytes_per_s": bandwidth, "transfer_bound_s": bound, "duplex_bound_s": moved / (h2d + d2h),
            "step_over_bound": row["offload_step_s"] / bound if bound else None,
            "mem_peak_bytes": {"single": pairs[0]["single"]["mem_peak_bytes"] if "error" not in pairs[0] else None,
                               "offload": good[0]["mem_peak_bytes"]},
            "target": "offload / single <= 1.3", "meets_target": row["median_ratio"] <= 1.3,
            "prefetch": b.a.prefetch[0], "other_prefetch": {}}
    for p in b.a.prefetch[1:]:
        name = f"offload_p{p}"
        other = ratio_row(paired(b, name, "single"), name, "single")
        if "error" not in other:
            other["mem_peak_bytes"] = next(r["mem_peak_bytes"] for r in b.records[name] if "error" not in r)
        row["other_prefetch"][p] = other
    if not moved:
        row["note"] = "nothing moved: on the CPU the cpu tier is the device itself, so there is no transfer bound"
    return row


def capped_row(b: Bench) -> dict:
    """The memory cap: single's one-line out-of-memory error, offload with recomputation training under it."""
    if b.a.smoke:  # memory.fraction has no effect on the CPU: the offload run trains uncapped
        r = b.first("offload_checkpoint")
        return {"fraction": "needs CUDA", "single": "needs CUDA",
                "offload_checkpoint": {"trained": True, "capped": False, "mem_peak_bytes": r["mem_peak_bytes"],
                                       "loss": r["loss"], "step_time_s": r["step_time_s"]}}
    # The low end: offload's peak, or recomputation's where offload keeps its activations and peaks near
    # single (the 697M Llama: 33.4 of 38.1 GB); offload with recomputation holds less than either.
    single, low = b.first("single"), b.first("offload")
    if "error" not in single and "error" not in low and single["mem_peak_bytes"] < 1.2 * low["mem_peak_bytes"]:
        low = b.first("single_checkpoint")
    if "error" in single or "error" in low:
        return {"error": f"no peaks to place the cap between: {single.get('error') or low.get('error')}"}
    hi, lo, total = single["mem_peak_bytes"], low["mem_peak_bytes"], b.info["total_memory"]
    if hi < 1.2 * lo:
        return {"error": f"single's peak ({hi} bytes) is not well above offload's or recomputation's ({lo}): no "
                         "cap between them"}
    fraction = int((hi + lo) / 2 / total * 1e4) / 1e4
    row = {"fraction": fraction, "cap_bytes": fraction * total, "total_memory": total, "single_peak_bytes": hi,
           "low_peak_bytes": lo}
    log(f"run single under memory.fraction={fraction} (expected: out of memory)")
    try:
        proc, record = b.train(b.overrides("single") + [f"memory.fraction={fraction}"])
    except RunFailed as e:
        row["single"] = {"error": str(e)}
    else:
        text = proc.stdout + proc.stderr
        line = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith(OOM_LINE)), None)
        traceback = "Traceback (most recent call last)" in text
        row["single"] = {"exit": proc.returncode, "line": line, "traceback": traceback,
                         "one_line_oom": line is not None and proc.returncode == 1 and not traceback}
        if proc.returncode == 0:
            row["single"]["trained_peak_bytes"] = record and record["mem_peak_bytes"]
        elif line is None:
            row["single"]["reason"] = reason(proc)
    log(f"run offload_checkpoint under memory.fraction={fraction}")
    try:
        r = b.framework("offload_checkpoint", [f"memory.fraction={fraction}"])
        row["offload_checkpoint"] = {"trained": True, "capped": True, "mem_peak_bytes": r["mem_peak_bytes"],
                                     "loss": r["loss"], "step_time_s": r["step_time_s"]}
    except RunFailed as e:
        row["offload_checkpoint"] = {"trained": False, "error": str(e)}
    row["ok"] = bool(row["single"].get("one_line_oom") and row["offload_checkpoint"]["trained"])
    return row


PLANNED = ("single", "offload", "single_checkpoint")


def planner_row(b: Bench, plans: dict) -> dict:
    """Each planned configuration's predicted peak (`plans`: name -> a future of plan.py's) vs its measured one."""
    out = {}
    for name in PLANNED:
        record = b.first(name)
        try:
            predicted = plans[name].result()
        except RunFailed as e:
            if b.a.smoke:
                raise
            out[name] = {"error": f"plan.py failed: {e}"}
            continue
        if "error" in record:
            out[name] = {"predicted_bytes": predicted, "error": f"the run failed: {record['error']}"}
            continue
        measured = record["mem_peak_bytes"]
        out[name] = {"predicted_bytes": predicted, "measured_bytes": measured,
                     "error_pct": 100 * (predicted / measured - 1)}
    errors = [abs(c["error_pct"]) for c in out.values() if "error_pct" in c]
    return {"configs": out, "max_abs_error_pct": max(errors) if errors else None, "target": "within 5%",
            "meets_target": bool(errors) and len(errors) == len(out) and max(errors) <= 5}


def compile_row(b: Bench, warmup: dict | None) -> dict:
    if warmup is None:
        return {"skipped": "a cold compile of this model took 25-33 s on 2 CPU cores here, more than the rest of "
                           "the smoke run: --smoke --rows compile runs it"}
    row = ratio_row(paired(b, "compiled", "single"), "compiled", "single")
    if "error" in row:
        return row
    good = [p for p in paired(b, "compiled", "single") if "error" not in p]
    return row | {"compile_time_s_cold": warmup.get("compile_time_s"),
                  "compile_time_s_cached": statistics.median(p["compiled"].get("compile_time_s", 0) for p in good),
                  "compiles": good[-1]["compiled"].get("compiles")}


def gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def describe(name: str, r: dict) -> tuple[str, list[str]]:
    """(the row's figure, lines of detail) for the table."""
    if "error" in r or "skipped" in r:
        return ("failed" if "error" in r else "skipped"), [r.get("error") or r["skipped"]]
    ratios = " ".join(f"{x:.3f}" for x in r.get("ratios", []))
    ratios += f"; {len(r['failed_pairs'])} pair(s) failed: {r['failed_pairs'][0]}" if r.get("failed_pairs") else ""
    if name == "single_vs_hand":
        return (f"framework / hand-written {r['median_ratio']:.3f} ({ratios})",
                [f"step {r['single_step_s']:.4f} s vs {r['hand_step_s']:.4f} s; MFU {pct(r['mfu'])} (hand-written "
                 f"{pct(r['hand_mfu'])}); {r['tokens_per_s']:.0f} vs {r['hand_tokens_per_s']:.0f} tokens/s; "
                 f"final loss {r['single_loss']:.6f} / {r['hand_loss']:.6f}"])
    if name == "offload":
        over = "-" if r["step_over_bound"] is None else f"{r['step_over_bound']:.2f}"
        return (f"offload / single {r['median_ratio']:.3f} ({ratios}; target <= 1.3)",
                [f"step {r['offload_step_s']:.4f} s vs {r['single_step_s']:.4f} s; moved {gb(r['bytes_moved_per_step'])}"
                 f"/step at {gb(r['copy_bytes_per_s'])}/s: bound {r['transfer_bound_s']:.4f} s (both ways at once "
                 f"{r['duplex_bound_s']:.4f} s), step / bound {over}; "
                 f"waited {r['wait_s_per_step']:.4f} s/step; peaks {gb(r['mem_peak_bytes']['single'])} / "
                 f"{gb(r['mem_peak_bytes']['offload'])}; final loss {r['offload_loss']:.6f} / {r['single_loss']:.6f}; "
                 f"strategy.prefetch={r['prefetch']}"]
                + [f"strategy.prefetch={p}: " + (o["error"] if "error" in o else
                   f"{o['median_ratio']:.3f} ({' '.join(f'{x:.3f}' for x in o['ratios'])}), step "
                   f"{o[f'offload_p{p}_step_s']:.4f} s, peak {gb(o['mem_peak_bytes'])}")
                   for p, o in r["other_prefetch"].items()]
                + ([r["note"]] if "note" in r else []))
    if name == "capped":
        o = r["offload_checkpoint"]
        trained = (f"trained, peak {gb(o['mem_peak_bytes'])}" + ("" if o.get("capped") else " (uncapped)")
                   if o["trained"] else f"failed: {o['error']}")
        if r["fraction"] == "needs CUDA":
            return "needs CUDA", ["single under the cap: needs CUDA", f"offload + checkpoint: {trained}"]
        s = r["single"]
        said = s.get("error") or (f"{s['line'] or s.get('reason') or 'trained'} (exit {s['exit']}, "
                                  f"{'a' if s['traceback'] else 'no'} traceback)")
        return (f"memory.fraction {r['fraction']} ({gb(r['cap_bytes'])} of {gb(r['total_memory'])}): "
                f"{'ok' if r['ok'] else 'NOT as expected'}",
                [f"between the lower peak of offload and recomputation {gb(r['low_peak_bytes'])} and single's "
                 f"{gb(r['single_peak_bytes'])}",
                 f"single: {said}", f"offload + checkpoint: {trained}"])
    if name == "planner":
        lines = [f"{k}: predicted {gb(c['predicted_bytes'])}, measured {gb(c['measured_bytes'])} "
                 f"({c['error_pct']:+.2f}%)" if "error_pct" in c else f"{k}: {c['error']}"
                 for k, c in r["configs"].items()]
        top = "-" if r["max_abs_error_pct"] is None else f"{r['max_abs_error_pct']:.2f}%"
        return f"largest |error| {top} (target: within 5%)", lines
    cold = "-" if r["compile_time_s_cold"] is None else f"{r['compile_time_s_cold']:.1f} s"
    return (f"compiled / eager {r['median_ratio']:.3f} ({ratios})",
            [f"step {r['compiled_step_s']:.4f} s vs {r['single_step_s']:.4f} s; compile {cold} cold, "
             f"{r['compile_time_s_cached']:.1f} s cached; final loss {r['compiled_loss']:.6f} / {r['single_loss']:.6f}"])


def table(result: dict) -> None:
    info = result["probe"]
    print(f"\ndevice: {info['device']} | torch {info['torch']} | copy host->device {gb(info['h2d_bytes_per_s'])}/s, "
          f"device->host {gb(info['d2h_bytes_per_s'])}/s ({info['copy']})"
          + (" | SMOKE: tiny sizes on the CPU" if result["smoke"] else ""))
    for name, r in result["rows"].items():
        figure, lines = describe(name, r)
        print(f"{name:<15} {figure}")
        for line in lines:
            print(f"{'':<15}   {line}")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=None, help="rounds of timed runs (default 2; --smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run, plus a first and a last "
                                                             "(default 10; --smoke 2)")
    ap.add_argument("--rows", default=None, help=f"comma list of {', '.join(ROWS)} (default: all)")
    ap.add_argument("--smoke", action="store_true", help="the same rows on the CPU with tiny sizes")
    ap.add_argument("--out", default=None, help=f"the JSON (default {RESULTS.relative_to(ROOT)}; --smoke: "
                                                "gpu_smoke.json in the temp directory)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per subprocess (default 1200; --smoke 120)")
    ap.add_argument("--prefetch", default="1", help="comma list of strategy.prefetch values for the offload row "
                                                    "(default 1; the row's figure is the first's)")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the device probe's subprocess
    a = ap.parse_args()
    a.pairs = a.pairs or (1 if a.smoke else 2)
    a.steps = a.steps or (2 if a.smoke else 10)
    a.timeout = a.timeout or (120.0 if a.smoke else 1200.0)
    a.explicit_rows = a.rows is not None  # --smoke runs compile only when asked by name
    a.rows = [r.strip() for r in (a.rows or ",".join(ROWS)).split(",") if r.strip()]
    try:
        a.prefetch = [int(x) for x in a.prefetch.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--prefetch: integers >= 0, comma-separated; got {a.prefetch!r}")
    if not a.prefetch or min(a.prefetch) < 0 or len(set(a.prefetch)) != len(a.prefetch):
        ap.error(f"--prefetch: distinct integers >= 0, comma-separated; got {a.prefetch}")
    unknown = sorted(set(a.rows) - set(ROWS))
    if unknown:
        ap.error(f"--rows: unknown {unknown}; valid: {', '.join(ROWS)}")
    a.out = Path(a.out) if a.out else Path(tempfile.gettempdir()) / "gpu_smoke.json" if a.smoke else RESULTS
    if a.smoke and a.out.resolve() == RESULTS.resolve():
        ap.error(f"--smoke never writes the GPU results ({RESULTS.relative_to(ROOT)}): give another --out")
    return a


def measure(b: Bench, save) -> dict:
    """Every asked row: the compile warm-up, the timed rounds, then the untimed runs with the plans beside them;
    `save(rows)` after each row (a run cut short keeps what it measured)."""
    want = set(b.a.rows)
    compiling = "compile" in want and (not b.a.smoke or b.a.explicit_rows)
    timed = [name for name, on in (("single", bool(want & {"single_vs_hand", "offload"}) or compiling),
                                   ("hand", "single_vs_hand" in want), ("offload", "offload" in want),
                                   *((f"offload_p{p}", "offload" in want) for p in b.a.prefetch[1:]),
                                   ("compiled", compiling)) if on]
    rows, plans, warmup = {}, {}, None
    with Inline() if b.a.smoke else ThreadPoolExecutor(max_workers=2) as pool:
        def start_plans():
            plans.update({name: pool.submit(b.plan, name) for name in PLANNED} if "planner" in want else {})
            if plans:
                log(f"plan.py for {', '.join(PLANNED)} "
                    + ("run" if b.a.smoke else "started, beside the runs that follow"))
        # plan.py runs on the CPU: beside the untimed runs (the cap, recomputation's measured peak), not the
        # timed ones; with --smoke (whose timings are no figures) at once, one plan after the other (its runs
        # are forked from this process: `Inline`).
        if b.a.smoke:
            start_plans()
        if compiling:
            log("compile warm-up: a compiled run fills this invocation's inductor cache (the cold compile time)")
            warmup = b.attempt("compiled", key="compiled_warmup")
        b.rounds(timed)
        if not b.a.smoke:
            start_plans()
        builders = {"single_vs_hand": single_vs_hand_row, "offload": offload_row, "capped": capped_row,
                    "planner": lambda b: planner_row(b, plans), "compile": lambda b: compile_row(b, warmup)}
        for name in [r for r in ROWS if r in want]:
            try:
                rows[name] = builders[name](b)
            except Exception as e:  # noqa: BLE001 - on a GPU, the other rows' hour is worth more than this row
                if b.a.smoke:
                    raise
                rows[name] = {"error": f"the row's own code failed: {type(e).__name__}: {e}"}
            save(rows)
    return rows


def main() -> None:
    a = parse()
    if a.probe:
        print(json.dumps(probe(cuda=True)), flush=True)
        return
    import torch

    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU (torch sees none); --smoke runs the same rows on the "
                         "CPU with tiny sizes")
    t0 = time.perf_counter()
    if a.smoke:
        info = probe(cuda=False)
    else:  # in a process of its own: this one holds no GPU memory while the runs measure theirs
        proc = run_proc([sys.executable, str(Path(__file__).resolve()), "--probe"], dict(os.environ), 300)
        if proc.returncode != 0:
            raise SystemExit(f"benchmarks/gpu.py: the device probe failed: {reason(proc)}")
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    log(f"device {info['device']} | torch {info['torch']} | rows {', '.join(a.rows)} | {a.pairs} round(s), "
        f"{a.steps} timed steps a run" + (" | smoke: tiny sizes on the CPU" if a.smoke else ""))
    result = {"device": info["device"], "torch": info["torch"], "smoke": a.smoke, "probe": info,
              "config": {"pairs": a.pairs, "steps": a.steps, "rows": a.rows, "timeout_s": a.timeout,
                         "prefetch": a.prefetch}, "rows": {}}

    def save(rows: dict) -> None:
        result.update(rows=rows, wall_s=time.perf_counter() - t0)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))

    # Removed here, not by a TemporaryDirectory: its clean-up runs at the exit of every process forked from this
    # one (`forked_proc`), before this one has done with it.
    tmp = Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    try:
        b = Bench(a, tmp, info)
        result["config"] |= {"sizes": b.sizes, "overrides": b.common}
        measure(b, save)
    except RunFailed as e:  # with --smoke only: the test suite should see it
        raise SystemExit(f"benchmarks/gpu.py --smoke: a run failed: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table(result)
    log(f"wrote {a.out} ({result['wall_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
