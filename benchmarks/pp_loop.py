"""A hand-written torch.distributed.pipelining training loop: the baseline for benchmarks/pipeline.py.

Run under torchrun. The built-in MLP is cut by hand into nn.Sequential stages
at the given block indices and driven by PyTorch's schedule, AdamW and global
gradient-norm clipping, as a user would write it without the framework. Prints
the mean time of steps 2..N-1 as JSON on rank 0.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from parallel.models.mlp import build_mlp


def pieces(model) -> list[nn.Module]:
    """The MLP as a flat list of blocks, in the order its forward runs them."""
    return [nn.Sequential(model.inp, nn.ReLU()), *model.blocks, model.head]


def stage_times(hidden: int, depth: int, starts: list[int], rows: int, reps: int = 7) -> list[float]:
    """Forward+backward seconds of each stage on one microbatch of `rows`, alone in
    this process (median of `reps`): the per-microbatch stage time of the analytic bound."""
    torch.manual_seed(0)
    blocks = pieces(build_mlp(32, 4, hidden, depth))
    bounds = starts + [len(blocks)]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        stage = nn.Sequential(*blocks[a:b])
        x = torch.randn(rows, 32 if a == 0 else hidden, requires_grad=a > 0)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            y = stage(x)
            (F.mse_loss(y, torch.zeros_like(y)) if b == len(blocks) else y).backward(
                None if b == len(blocks) else torch.ones_like(y))
            times.append(time.perf_counter() - t0)
            stage.zero_grad(set_to_none=True)
        out.append(sorted(times)[reps // 2])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--starts", default="0,4", help="block index where each stage begins")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    blocks = pieces(build_mlp(32, 4, a.hidden, a.depth))
    starts = [int(s) for s in a.starts.split(",")] + [len(blocks)]
    n = len(starts) - 1
    cls = get_schedule_class(a.schedule)
    v_shape = a.schedule.lower() in ("zbvzerobubble", "dualpipev")
    owner = [s if s < world else n - 1 - s for s in range(n)] if v_shape else [s % world for s in range(n)]
    mods = [nn.Sequential(*blocks[starts[i]:starts[i + 1]]) for i in range(n) if owner[i] == rank]
    ids = [i for i in range(n) if owner[i] == rank]
    stages = [PipelineStage(m, i, n, torch.device("cpu")) for m, i in zip(mods, ids)]
    single = issubclass(cls, PipelineScheduleSingle)
    sched = cls(stages[0] if single else stages, n_microbatches=a.microbatches, loss_fn=F.mse_loss)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=5e-3, weight_decay=0.01)
    times = []
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(a.batch, 32, generator=g), torch.randn(a.batch, 4, generator=g)
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        sched.step(*((x,) if first else ()), target=y if last else None, losses=[] if last else None,
                   return_outputs=False)
        sq = sum(p.grad.pow(2).sum() for p in params if p.grad is not None)
        dist.all_reduce(sq)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, sq.sqrt())
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"step_time_s": sum(times[1:-1]) / len(times[1:-1])}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
