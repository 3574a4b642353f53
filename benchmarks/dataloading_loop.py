"""A hand-written PyTorch loop over a DataLoader with a DistributedSampler: the baseline for
benchmarks/dataloading.py.

Run under torchrun. The same model, optimizer, schedule and clipping as the framework's `strategy=data
strategy.zero=0`, and the same dataset (benchmarks/costly_data.py) loaded by `--workers` loader processes a
rank, `--prefetch` batches ahead each; prints, on rank 0, the mean step time and the mean time spent waiting
for a batch, over steps 2..N-1 (as the framework's metrics count them), as JSON.
"""
import argparse
import json
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.costly_data import costly
from parallel.models.mlp import build_mlp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = costly(rounds=a.rounds)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=a.batch // world, sampler=sampler, num_workers=a.workers,
                        prefetch_factor=a.prefetch if a.workers else None, persistent_workers=a.workers > 0,
                        drop_last=True)
    torch.manual_seed(0)
    model = DDP(build_mlp(ds.features, ds.targets, a.hidden, a.depth))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps))))
    times, waits, step, epoch = [], [], 0, 0
    while step < a.steps:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < a.steps:
            t0 = time.perf_counter()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            t1 = time.perf_counter()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            times.append(time.perf_counter() - t0)
            waits.append(t1 - t0)
        epoch += 1
    if rank == 0:
        print(json.dumps({"step_time_s": sum(times[1:-1]) / len(times[1:-1]),
                          "data_time_s": sum(waits[1:-1]) / len(waits[1:-1]), "loss": loss.item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
