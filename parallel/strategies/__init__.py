"""Strategies: each turns the meta-device model into an engine for this rank.

A strategy is a function `(model, mesh, cfg, device, plan) -> engine`; the
registry below is explicit, and an unknown name fails listing its keys.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.config import Config
from parallel.data.synthetic import loss_fn
from parallel.engine import LocalEngine
from parallel.init import InitPlan, materialize_and_init
from parallel.strategies.data import apply_data
from parallel.strategies.recompute import recompute_model, recomputing
from parallel.strategies.single import apply_single
from parallel.strategies.tensor import apply_tensor


def _local(apply):
    """A strategy that keeps the whole model on each rank: transform it on meta, then
    materialize (Note [initialization by name]) and wrap it in a LocalEngine."""

    def build(model: nn.Module, mesh: DeviceMesh, cfg: Config, device: torch.device, plan: InitPlan):
        if recomputing(cfg):  # before DDP or FSDP wrap the blocks (parallel.strategies.recompute)
            recompute_model(model, cfg)
        model = apply(model, mesh, cfg)
        materialize_and_init(model, device, cfg.trainer.seed, plan)
        return LocalEngine(model, cfg, loss_fn(cfg.data.task), mesh["dp"].get_group(), device)

    return build


def _pipeline(model: nn.Module, mesh: DeviceMesh, cfg: Config, device: torch.device, plan: InitPlan):
    from parallel.strategies.pipeline import build_pipeline

    return build_pipeline(model, mesh, cfg, device, plan)


def _hybrid(model: nn.Module, mesh: DeviceMesh, cfg: Config, device: torch.device, plan: InitPlan):
    from parallel.strategies.hybrid import parallelize as parallelize_hybrid

    return parallelize_hybrid(model, mesh, cfg, device, plan)


def _offload(model: nn.Module, mesh: DeviceMesh, cfg: Config, device: torch.device, plan: InitPlan):
    from parallel.metrics import log
    from parallel.offload.engine import OffloadEngine
    from parallel.strategies.partition import candidates
    from parallel.strategies.tensor import example_input

    names, _ = candidates(model, example_input(cfg))
    engine = OffloadEngine(model, cfg, device, plan, names, cfg.run_dir, loss_fn(cfg.data.task))
    t = engine.tier_names
    if not engine.blocks:
        log.warning("offload: no blocks found (the model's children called by its forward, or a ModuleList's "
                    "children): every weight stays on the device")
    if engine.n_ahead:
        log.info("offload: the first %d blocks are frozen and run one batch ahead of the rest", engine.n_ahead)
    log.info("offload: %d blocks (largest %.1f MB), params on %s, optimizer state on %s, activations on %s%s",
             len(engine.blocks), engine.pool.nbytes / 1e6, t["params"], t["optimizer"], t["activations"],
             f" ({engine.path})" if "disk" in t.values() else "")
    return engine


STRATEGIES = {
    "single": _local(apply_single),
    "data": _local(apply_data),
    "pipeline": _pipeline,
    "model": _local(apply_tensor),
    "hybrid": _hybrid,  # the order it applies the pieces in: parallel.strategies.hybrid
    "offload": _offload,
}


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: Config, device: torch.device, plan: InitPlan):
    """Apply the configured strategy to `model` (on the meta device) and return this rank's engine.

    Parameter names never change (Note [initialization by name]).
    """
    return STRATEGIES[cfg.strategy.name](model, mesh, cfg, device, plan)
