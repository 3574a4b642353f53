"""Strategies: each turns the meta-device model into this rank's engine.

A strategy is a function `(model, mesh, cfg, runtime, plan) -> Engine`
(Note [engine contract] in parallel/engine.py, Note [runtime] in
parallel/runtime.py); the registry below is explicit, and an unknown name fails
listing its keys.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.batchnorm import batchnorm_warning
from parallel.config import BALANCES, ZERO_LEVELS, Config, fail
from parallel.dims import data_mesh
from parallel.engine import Engine, LocalEngine
from parallel.init import InitPlan, materialize_and_init
from parallel.loss import build_loss
from parallel.metrics import log
from parallel.offload.check import check_offload
from parallel.offload.engine import build_offload
from parallel.runtime import Runtime
from parallel.strategies.compile import compile_model
from parallel.strategies.context import apply_context
from parallel.strategies.data import apply_data, state_sharding
from parallel.strategies.hybrid import build_hybrid
from parallel.strategies.pipeline import build_pipeline
from parallel.strategies.recompute import recompute_model, recomputing
from parallel.strategies.single import apply_single
from parallel.strategies.tensor import apply_tensor, check_tensor_keys


def _local(apply):
    """A strategy that keeps the whole model on each rank: transform it on meta, then
    materialize (Note [initialization by name]) and wrap it in a LocalEngine."""

    def build(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime, plan: InitPlan) -> Engine:
        sequence = apply_context(model, mesh)  # cp > 1 (strategy=context): attention over the cp ranks
        if recomputing(cfg):  # before DDP or FSDP wrap the blocks (parallel.strategies.recompute)
            recompute_model(model, cfg)
        model = apply(model, mesh, cfg, runtime)
        compile_model(model, cfg, runtime)  # after DDP or FSDP2 (Note [regional compilation])
        materialize_and_init(model, runtime.device, plan, runtime.values)
        loss = build_loss(cfg.loss, cfg.data.task)
        return LocalEngine(model, cfg, loss, data_mesh(mesh).get_group(), runtime.device, sequence,
                           state_sharding(mesh, cfg))

    return build


STRATEGIES = {
    "single": _local(apply_single),
    "data": _local(apply_data),
    "pipeline": build_pipeline,
    "model": _local(apply_tensor),
    # Each sequence split over the cp ranks; the weights data-parallel over them (zero as strategy=data).
    "context": _local(apply_data),
    "hybrid": build_hybrid,  # the order it applies the pieces in: parallel.strategies.hybrid
    "expert": build_hybrid,  # hybrid over the ep dimension alone (parallel.strategies.expert)
    "offload": build_offload,
}


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime, plan: InitPlan) -> Engine:
    """Apply the configured strategy to `model` (on the meta device) and return this rank's engine.

    Parameter names never change (Note [initialization by name]).
    """
    warning = batchnorm_warning(model, cfg)
    if warning:
        log.warning("%s (Note [batch norm] in parallel/batchnorm.py)", warning)
    return STRATEGIES[cfg.strategy.name](model, mesh, cfg, runtime, plan)


def check_strategy(cfg: Config, world_size: int) -> None:
    """The strategy's name and the keys that do not depend on derived degrees."""
    s = cfg.strategy
    if s.name not in STRATEGIES:
        fail("strategy.name", s.name, "unknown strategy", sorted([*STRATEGIES, "auto"]))
    if s.zero not in ZERO_LEVELS:
        fail("strategy.zero", s.zero, "unknown ZeRO level", list(ZERO_LEVELS))
    if s.name == "offload":
        check_offload(cfg, world_size)
    elif s.activations not in ("device", "checkpoint"):
        fail("strategy.activations", s.activations, f"strategy={s.name} keeps activations on the device or "
             "recomputes them per block; the tiers below the device are strategy=offload's",
             ["device", "checkpoint"])
    if s.name == "single" and world_size != 1:
        fail("strategy", "single", f"runs on one process, but the world size is {world_size}",
             "strategy=data or strategy=pipeline for several processes")
    if s.name not in ("data", "context", "hybrid", "expert") and s.zero != 0:
        fail("strategy.zero", s.zero, "ZeRO sharding needs strategy=data, context, hybrid or expert")
    if s.balance not in BALANCES:
        fail("strategy.balance", s.balance, "unknown cost", list(BALANCES))
    check_tensor_keys(s, s.name in ("model", "hybrid"))
