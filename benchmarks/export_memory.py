"""The export's memory: peak RSS while exporting a ~150 MB model, against the model's size and plain PyTorch.

    python benchmarks/export_memory.py [--hidden 1024] [--depth 36] [--dir /tmp] [--out FILE] [--smoke]

Trains an MLP 32 -> hidden x depth -> 4 (1024 x 36: 38M parameters, 151 MB in
fp32, the largest tensor 4.2 MB, as a large language model's are small parts
of it) for one step with final_model.pt and a checkpoint, then exports it, each
export in a fresh process, from each source:
  A. parallel.export (launch/export.py): a tensor at a time (Note [reading a
     tensor at a time]);
  B. plain PyTorch: the whole state dict in memory, then
     `safetensors.torch.save_file` (final_model.pt: `torch.load`; the
     checkpoint: every `model.*` tensor allocated and `dcp.load`ed at once).
The figure is the process's peak RSS above its RSS once everything is
imported (Linux: VmHWM, reset through /proc/self/clear_refs before the export),
and its ratio to the model's bytes. Both write the same safetensors bytes.

--smoke (the test suite's): the same sizes, the run and each export forked from
this process once it has imported the framework (tests/zygote.py
`run_forked`), not new interpreters: ~3 s less each. A forked export counts
what it allocates, as in a new interpreter, and also the pages of the libraries'
code it runs that this process had read: a fork does not copy the mappings of
files, so the child maps them into its own RSS again (here ~8 MB more per
export, the same for both methods: 0.31 / 1.07 of the model from final_model.pt,
against 0.27 / 1.01 in new interpreters).

Prints a table and writes benchmarks/results/export_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def measure(method: str, source: str, out: str) -> dict:
    """Export `source` into `out` by `method` in this process; its peak RSS above the RSS before it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from parallel.export import ExportOptions, export
    from parallel.models import build  # noqa: F401 - imported before the measure, as the export imports it

    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS now (Linux 4.0+)
        f.write("5")
    base = _status("VmRSS")
    t0 = time.perf_counter()
    if method == "parallel.export":
        export(ExportOptions(source, out))
    elif source.endswith(".pt"):
        os.makedirs(out)
        state = torch.load(source, map_location="cpu", weights_only=True)
        save_file(state, os.path.join(out, "model.safetensors"))
    else:
        os.makedirs(out)
        meta = dcp.FileSystemReader(source).read_metadata().state_dict_metadata
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("model.")}
        dcp.load(state, checkpoint_id=source, no_dist=True)
        save_file({k.removeprefix("model."): v for k, v in state.items()}, os.path.join(out, "model.safetensors"))
    seconds = time.perf_counter() - t0
    return {"peak_rss_increase": _status("VmHWM") - base, "seconds": seconds}


def call(cmd: list[str], env: dict, cwd, smoke: bool) -> subprocess.CompletedProcess:
    """`cmd` to its end (an error if it fails), its output captured: a new interpreter, or with --smoke a child
    forked from this process where that gives the same process (tests/zygote.py `forkable`)."""
    if smoke:
        from tests import zygote

        if zygote.forkable(env):
            proc = zygote.run_forked(cmd, cwd, env, timeout=600)
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
            return proc
    return subprocess.run(cmd, check=True, env=env, cwd=cwd, capture_output=True, text=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=36)
    p.add_argument("--dir", default=None, help="where the run and the exports go (a temporary directory)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "export_memory.json"))
    p.add_argument("--smoke", action="store_true", help="the test suite's: the same sizes, each process forked "
                                                         "from this one with the framework imported")
    p.add_argument("--measure", nargs=3, metavar=("METHOD", "SOURCE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    work = Path(tempfile.mkdtemp(prefix="export-memory-", dir=args.dir))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        run = work / "run"
        call([sys.executable, str(ROOT / "launch" / "train.py"), f"model.args.hidden={args.hidden}",
              f"model.args.depth={args.depth}", "trainer.steps=1", "trainer.batch_size=8", "trainer.save_final=true",
              "trainer.checkpoint_every=1", "trainer.progress=false", f"run_dir={run}"], env, work, args.smoke)
        model_bytes = (run / "final_model.pt").stat().st_size
        sources = {"final_model.pt": str(run / "final_model.pt"),
                   "checkpoint (DCP)": str(run / "checkpoints" / "step-000001")}
        rows = []
        for label, source in sources.items():
            for method in ("parallel.export", "plain: whole state dict + save_file"):
                out = work / f"out{len(rows)}"
                proc = call([sys.executable, str(Path(__file__).resolve()), "--measure", method.split(":")[0],
                             source, str(out)], env, ROOT, args.smoke)
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append({"source": label, "method": method, "model_bytes": model_bytes, **got,
                             "ratio_to_model": got["peak_rss_increase"] / model_bytes})
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"model: MLP 32 -> {args.hidden} x {args.depth} -> 4, {model_bytes / 1e6:.1f} MB (final_model.pt)")
    print(f"{'source':<18} {'method':<38} {'peak RSS +MB':>12} {'x model':>8} {'s':>6}")
    for r in rows:
        print(f"{r['source']:<18} {r['method']:<38} {r['peak_rss_increase'] / 1e6:>12.1f} "
              f"{r['ratio_to_model']:>8.2f} {r['seconds']:>6.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
