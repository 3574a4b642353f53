"""Optimizer, learning-rate schedule and gradient clipping across every mesh dimension."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from parallel.config import Config


def build_optimizer(model: nn.Module, cfg: Config, dp_group=None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; with strategy.zero=1 its state is sharded over dp.

    Args:
        model: the parallelized model.
        cfg: the run config (optim.*, strategy.zero).
        dp_group: the data-parallel process group (for zero=1).
    """
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    if cfg.strategy.name == "data" and cfg.strategy.zero == 1:
        # ZeRO stage 1: each rank keeps AdamW state for its share of the
        # parameters, steps them, and broadcasts the updated values.
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                       process_group=dp_group, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def adamw_state(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> dict:
    """AdamW's state of `p`, made now (zeros) when the first step has not made it yet, as AdamW makes it
    (not fused, not capturable): a checkpoint load fills it in place, and AdamW then takes it as its own."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over optim.warmup_steps, then cosine decay to lr * min_lr_ratio (or constant)."""
    o, steps = cfg.optim, cfg.trainer.steps

    def factor(step: int) -> float:  # `step` counts optimizer steps taken so far
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        progress = (step - o.warmup_steps) / max(1, steps - o.warmup_steps)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm of `model` (clipped to `max_norm` when > 0); see `clip_grads`."""
    return clip_grads([p.grad for p in model.parameters() if p.grad is not None], max_norm)


@torch.no_grad()
def clip_grads(grads: list[torch.Tensor], max_norm: float, counted: list[torch.Tensor] | None = None,
               sum_group=None) -> torch.Tensor:
    """The global gradient norm, right across every mesh dimension; grads clipped by it when max_norm > 0.

    Gradients are normed in groups: whole tensors together, DTensors by their
    mesh (FSDP shards over dp, tensor-parallel pieces over tp or over both).
    torch's norm of a DTensor group is a partial DTensor, made whole over its
    mesh here, so every rank clips by the same factor and the norm equals the
    single-device one.

    Args:
        grads: this rank's gradients.
        counted: the gradients that count toward the norm (default: `grads`);
            a pipeline leaves out the extra copies of a weight tied across stages.
        sum_group: a process group whose ranks hold different gradients (the
            pipeline stages); their squared norms are summed over it.
    """
    counted = grads if counted is None else counted
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), device=device)
    for group in _by_mesh(counted):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        square = square + (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
    if sum_group is not None and dist.get_world_size(sum_group) > 1:
        dist.all_reduce(square, group=sum_group)
    norm = square.sqrt()
    if max_norm > 0:
        # torch's clip_grads_with_norm_ takes parameters (it scales their .grad), and these are the gradients
        # themselves: scale them here by the same factor, min(max_norm / (norm + 1e-6), 1).
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
    return norm


def _by_mesh(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Whole tensors in one group, DTensors in one group per mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    return list(groups.values())


def all_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of a scalar over a process group."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value
