"""What the preemption check costs a step: the all-reduce of one int at every step boundary (Note [preemption]).

    python benchmarks/preemption.py [--blocks 20] [--steps 50] [--hidden 64]

Two gloo ranks on this machine train a DDP MLP (the built-in mlp's default shape: 32 features, 4 layers of 64,
batch 32 split over the ranks) in blocks of `steps` steps, alternately without and with the check
(`parallel.preemption.Watch.agreed`), and also time the check alone. The figures are medians over blocks,
because timings on a shared machine drift. Prints a table and writes benchmarks/results/preemption.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parallel.preemption import Watch  # noqa: E402


def _rank(rank: int, a, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    layers = [nn.Linear(32, a.hidden), nn.ReLU()]
    for _ in range(a.depth - 2):
        layers += [nn.Linear(a.hidden, a.hidden), nn.ReLU()]
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers, nn.Linear(a.hidden, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    watch = Watch(timeout_s=60)  # not started: the check alone, as every step boundary runs it

    def block(check: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if check:
                watch.agreed()
        return (time.perf_counter() - t0) / a.steps

    block(False)  # warm-up
    plain, checked = [], []
    for _ in range(a.blocks):
        plain.append(block(False))
        checked.append(block(True))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps * 4):
        watch.agreed()
    alone = (time.perf_counter() - t0) / (a.steps * 4)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": statistics.median(plain), "step_with_check_s":
                                         statistics.median(checked), "check_alone_s": alone}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    a = ap.parse_args()
    result = ROOT / "benchmarks" / "results" / "preemption.json"
    tmp = result.with_suffix(".tmp")
    mp.start_processes(_rank, args=(a, 29500 + os.getpid() % 1000, str(tmp)), nprocs=2, start_method="spawn")
    r = json.loads(tmp.read_text())
    tmp.unlink()
    r.update(hidden=a.hidden, depth=a.depth, ranks=2, backend="gloo", blocks=a.blocks, steps=a.steps,
             cost_per_step_s=r["step_with_check_s"] - r["step_s"])
    r["cost_fraction"] = r["cost_per_step_s"] / r["step_s"]
    print(f"{'step (no check)':>22} {r['step_s'] * 1e3:8.3f} ms")
    print(f"{'step (with check)':>22} {r['step_with_check_s'] * 1e3:8.3f} ms")
    print(f"{'difference':>22} {r['cost_per_step_s'] * 1e6:8.1f} us  ({100 * r['cost_fraction']:.1f} %)")
    print(f"{'check alone':>22} {r['check_alone_s'] * 1e6:8.1f} us")
    result.write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
