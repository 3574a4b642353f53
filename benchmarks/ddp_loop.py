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


def hand_step(features: int, targets: int, hidden: int, depth: int, batch: int, steps: int, rank: int,
              world: int):
    """(step, data): the hand-written step (DDP, AdamW, LambdaLR, clip_grad_norm_, its own data) as a function of
    the step number returning its loss, and that data (this rank's inputs and targets of a step number);
    benchmarks/overhead_parts.py times them beside the framework's pieces."""
    torch.manual_seed(0)
    model = DDP(build_mlp(features, targets, hidden, depth))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    teacher = torch.randn(features, targets)
    per = batch // world

    def data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(k)
        x = torch.randn(batch, features, generator=g)
        y = x @ teacher + 0.01 * torch.randn(batch, targets, generator=g)
        return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]

    def step(k: int) -> torch.Tensor:
        x, y = data(k)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return loss

    return step, data


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
    step, _ = hand_step(a.features, a.targets, a.hidden, a.depth, a.batch, a.steps, rank, world)
    times = []
    for k in range(1, a.steps + 1):
        t0 = time.perf_counter()
        loss = step(k)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"step_time_s": sum(times[1:-1]) / len(times[1:-1]), "loss": loss.item()}))
    # Both ranks at the end before the group goes: a rank that destroyed its group while the other still
    # finished its last step's collectives left that one waiting forever (twice in ~40 runs here).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
