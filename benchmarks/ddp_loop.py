"""A hand-written PyTorch DDP training loop: the baseline for benchmarks/overhead.py.

Run under torchrun. Same model, data, optimizer, schedule and clipping as the
framework's `strategy=data strategy.zero=0`; prints the mean step time of steps
2..N-1 as JSON on rank 0.
"""
import argparse
import json
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.models.mlp import build_mlp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--targets", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(build_mlp(a.features, a.targets, a.hidden, a.depth))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps))))
    teacher = torch.randn(a.features, a.targets)
    per = a.batch // world
    times = []
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step)
        x = torch.randn(a.batch, a.features, generator=g)
        y = x @ teacher + 0.01 * torch.randn(a.batch, a.targets, generator=g)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"step_time_s": sum(times[1:-1]) / len(times[1:-1]), "loss": loss.item()}))
    # Both ranks at the end before the group goes: a rank that destroyed its group while the other still
    # finished its last step's collectives left that one waiting forever (twice in ~40 runs here).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
