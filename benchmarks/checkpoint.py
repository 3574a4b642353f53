"""Saving and loading ~1 GB of training state: the project's checkpoints against torch.save of the full state dict.

    python benchmarks/checkpoint.py [--pairs 3] [--hidden 4096] [--depth 5] [--dir /tmp]

The state: an MLP 32 -> 4096 x 5 -> 4 (84M parameters) after one AdamW step,
weights and two moments in fp32: 1.01 GB. Under `single` (one process) and
`data zero=3` (two processes, each holding half), in one invocation, pairs of:
  A. parallel.checkpoint: every rank writes its own pieces with
     torch.distributed.checkpoint (Note [checkpoint layout]), the checkpoint
     sealed (Note [atomic checkpoint]); loaded back into the live run.
  B. plain PyTorch: the full state dict (`model.state_dict()` and
     `optimizer.state_dict()`; under FSDP2, gathered to rank 0 with
     `get_state_dict(full_state_dict=True, cpu_offload=True)`) saved by rank 0
     with torch.save; loaded with torch.load (memory-mapped, on every rank) and
     handed to the run (`load_state_dict`; under FSDP2 `set_state_dict`, each
     rank keeping its shard).
Both write to the same disk and fsync their files (DCP does by default; the
torch.save file is fsynced here), so both times include reaching the disk;
removing the files after each pair is not timed.
Times are the median over the pairs (A B A B ...), every rank waiting for
the slowest; bytes are what lies on disk.

Prints a table and writes benchmarks/results/checkpoint.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [("single", 0, 1), ("data", 3, 2)]  # (strategy, zero, processes)


def worker(rank: int, world: int, name: str, zero: int, args, work: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from parallel import checkpoint
    from parallel.config import Config
    from parallel.dims import ParallelDims
    from parallel.runtime import Runtime
    from parallel.trainer import build_run, train_step
    from parallel.validate import validate

    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = Config()
    cfg.model.args = {"in_features": 32, "out_features": 4, "hidden": args.hidden, "depth": args.depth}
    cfg.strategy.name, cfg.strategy.zero = name, zero
    cfg.trainer.batch_size, cfg.trainer.keep_checkpoints = 8, args.pairs + 1  # removed below, not timed
    validate(cfg, world)
    run = build_run(cfg, ParallelDims.of(cfg.strategy, world), Runtime(device=torch.device("cpu")))
    train_step(run, 1)  # AdamW's state exists
    sharded = name == "data" and zero >= 2
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    rows = []
    saver = checkpoint.Checkpointer(cfg, Path(work))
    plain = Path(work, "full.pt")

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    for i in range(args.pairs):
        box = {}
        save = timed(lambda: box.update(path=saver.save(run, i + 1)))
        load = timed(lambda: checkpoint.load(run, box["path"]))
        size = sum(p.stat().st_size for p in box["path"].rglob("*") if p.is_file())
        rows.append({"method": "parallel.checkpoint (DCP)", "save_s": save, "load_s": load, "bytes": size})
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box["path"])

        def save_full():
            if sharded:
                model, optim = get_state_dict(run.engine.model, run.optimizer, options=options)
            else:
                model, optim = run.engine.model.state_dict(), run.optimizer.state_dict()
            if rank == 0:
                with open(plain, "wb") as f:
                    torch.save({"model": model, "optim": optim}, f)
                    f.flush()
                    os.fsync(f.fileno())

        def load_full():
            full = torch.load(plain, weights_only=True, mmap=True)
            if sharded:
                set_state_dict(run.engine.model, run.optimizer, model_state_dict=full["model"],
                               optim_state_dict=full["optim"], options=options)
            else:
                run.engine.model.load_state_dict(full["model"])
                run.optimizer.load_state_dict(full["optim"])

        save = timed(save_full)
        load = timed(load_full)
        rows.append({"method": "torch.save full state dict", "save_s": save, "load_s": load,
                     "bytes": plain.stat().st_size})
        dist.barrier()
        if rank == 0:
            plain.unlink()
    if rank == 0:
        # numel of a DTensor is that of the whole tensor: the state of the whole model, whatever the sharding
        state = sum(p.numel() * p.element_size() for p in run.engine.model.parameters()) * 3
        Path(work, "rows.json").write_text(json.dumps({"rows": rows, "state_bytes": state}))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary dir)")
    args = p.parse_args()
    results = []
    for name, zero, world in CASES:
        work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
        try:
            mp.start_processes(worker, args=(world, name, zero, args, work, free_port()), nprocs=world,
                               start_method="spawn")
            got = json.loads(Path(work, "rows.json").read_text())
        finally:
            shutil.rmtree(work, ignore_errors=True)
        label = name if name == "single" else f"{name} zero={zero} x{world}"
        for method in dict.fromkeys(r["method"] for r in got["rows"]):
            mine = [r for r in got["rows"] if r["method"] == method]
            results.append({"case": label, "method": method, "state_bytes": got["state_bytes"],
                            "save_s": statistics.median(r["save_s"] for r in mine),
                            "load_s": statistics.median(r["load_s"] for r in mine),
                            "bytes": mine[-1]["bytes"], "pairs": len(mine),
                            "save_s_each": [r["save_s"] for r in mine], "load_s_each": [r["load_s"] for r in mine]})
    print(f"{'case':<18} {'method':<28} {'state GB':>8} {'on disk GB':>10} {'save s':>7} {'load s':>7} "
          f"{'save GB/s':>9}")
    for r in results:
        print(f"{r['case']:<18} {r['method']:<28} {r['state_bytes'] / 1e9:>8.3f} {r['bytes'] / 1e9:>10.3f} "
              f"{r['save_s']:>7.2f} {r['load_s']:>7.2f} {r['state_bytes'] / 1e9 / r['save_s']:>9.2f}")
    for case in dict.fromkeys(r["case"] for r in results):
        a, b = [r for r in results if r["case"] == case]
        a["ratio"] = b["ratio"] = {"save": b["save_s"] / a["save_s"], "load": b["load_s"] / a["load_s"]}
        print(f"{case}: torch.save time / DCP time: save {a['ratio']['save']:.2f}, load {a['ratio']['load']:.2f} "
              "(above 1: the project's checkpoints are faster)")
    out = ROOT / "benchmarks" / "results" / "checkpoint.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "pairs": args.pairs, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
