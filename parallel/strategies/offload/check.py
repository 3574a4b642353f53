"""strategy=offload's settings, checked before any worker starts: tiers, prefetch, one process, and room on
the disk tier for the weights, gradients and optimizer state, and an optimizer the engine implements."""
from __future__ import annotations

import torch
from torch import nn

from parallel.config import Config, cuda_run, fail
from parallel.optim import optimizer_class
from parallel.strategies.offload.adamw import SUPPORTED, state_keys
from parallel.strategies.offload.tiers import TIERS, check_disk, effective


def check_offload(cfg: Config, world_size: int) -> None:
    s = cfg.strategy
    if world_size != 1:
        fail("strategy", "offload", f"streams one device's model from the tiers below it and runs on one process, "
             f"but the world size is {world_size}",
             "strategy=data strategy.zero=3 to shard weights and optimizer state over processes, "
             "or strategy=pipeline to split the model by layers")
    for kind in ("params", "optimizer"):
        if getattr(s, kind) not in TIERS:
            fail(f"strategy.{kind}", getattr(s, kind), "unknown tier", list(TIERS))
    if s.activations not in TIERS + ("checkpoint",):
        fail("strategy.activations", s.activations, "unknown tier", list(TIERS) + ["checkpoint"])
    if isinstance(s.prefetch, bool) or not isinstance(s.prefetch, int) or s.prefetch < 0:
        fail("strategy.prefetch", s.prefetch, "must be an integer >= 0 (blocks read ahead)")
    if cfg.trainer.grad_accum != 1:
        fail("trainer.grad_accum", cfg.trainer.grad_accum, "must be 1 under strategy=offload: each block's "
             "gradients leave the device as soon as they are complete",
             "a smaller trainer.batch_size, or strategy.activations=disk or checkpoint to fit a larger one")
    check_offload_optimizer(cfg)
    cuda = cuda_run(cfg.trainer.device)
    device = torch.device("cuda" if cuda else "cpu")
    for kind in ("params", "optimizer"):
        if cuda and effective(getattr(s, kind), device) == "disk":
            fail(f"strategy.{kind}", "disk", "the disk tier sits below the CPU; under a GPU the tier below is "
                 "pinned CPU memory", ["cpu", "auto", "device"])


def check_offload_optimizer(cfg: Config) -> None:
    """The offload engine steps its own optimizer (parallel.strategies.offload.adamw): AdamW or SGD, and of their
    arguments those it implements."""
    o = cfg.optim
    cls = optimizer_class(o)
    if cls not in SUPPORTED:
        fail("optim._target_", o._target_, f"strategy=offload steps the optimizer itself, block by block, and "
             f"implements AdamW and SGD, not {o._target_}",
             [f"torch.optim.{c.__name__}" for c in SUPPORTED])
    unknown = sorted(set(o.args) - set(SUPPORTED[cls]))
    if unknown:
        fail("optim.args", dict(o.args), f"strategy=offload implements {cls.__name__} with {unknown} at their "
             "defaults only", list(SUPPORTED[cls]))


def check_offload_disk(cfg: Config, model: nn.Module) -> None:
    """strategy.path is writable and has room for the weights, gradients and optimizer state of `model` (on meta).

    (Checked again, for the run directory, when the engine is built.)"""
    s = cfg.strategy
    device = torch.device("cuda" if cuda_run(cfg.trainer.device) else "cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    needed = (weights if effective(s.params, device) == "disk" else 0) + \
        ((len(state_keys(cfg.optim)) + 1) * weights if effective(s.optimizer, device) == "disk" else 0)
    why = check_disk(s.path, max(needed, 1))
    if why:
        fail("strategy.path", s.path, why)
