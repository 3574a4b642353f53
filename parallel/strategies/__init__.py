"""Strategies: each turns the meta-device model into this rank's engine.

A strategy is a function `(model, mesh, cfg, runtime, plan) -> Engine`
(Note [engine contract] in parallel/engine.py, Note [runtime] in
parallel/runtime.py) and, where it has them, its own checks; the registry below
is explicit and keyed by the names of the strategy table, whose rows say what
each strategy spreads and takes (Note [strategy table] in
parallel/strategy_specs.py). An unknown name fails listing the table's names.

A builder is where the config is read: the pieces it applies and the engine it returns take what they use
(the mesh, a ZeRO level, dtypes, an example input: `data_parallel`, `state_sharding`, `tensor_plan`,
`recompute_model`, ...; LocalEngine its micro-steps and autocast, PipelineEngine its schedule, OffloadEngine
its `OffloadSettings`), as torchtitan's parallelize_llama hands `apply_fsdp` its dtypes, so each piece reads
and tests on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.batchnorm import batchnorm_warning
from parallel.config import BALANCES, SPECS, ZERO_LEVELS, Config, bf16_run, fail, strategy_spec
from parallel.data import example_input
from parallel.dims import data_mesh
from parallel.engine import Engine, LocalEngine
from parallel.init import InitPlan, materialize_and_init
from parallel.loss import build_loss
from parallel.metrics import log
from parallel.runtime import Runtime
from parallel.strategies.compile import compile_model, compiling
from parallel.strategies.context import apply_context
from parallel.strategies.data import apply_data, state_sharding
from parallel.strategies.hybrid import build_hybrid
from parallel.strategies.offload.check import check_offload
from parallel.strategies.offload.engine import build_offload
from parallel.strategies.pipeline import build_pipeline
from parallel.strategies.recompute import check_recompute, recompute_model, recomputing
from parallel.strategies.single import apply_single
from parallel.strategies.tensor import apply_tensor, check_tensor_keys


def _local(apply):
    """A strategy that keeps the whole model on each rank: transform it on meta, then
    materialize (Note [initialization by name]) and wrap it in a LocalEngine."""

    def build(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime, plan: InitPlan) -> Engine:
        sequence = apply_context(model, mesh)  # cp > 1 (strategy=context): attention over the cp ranks
        how = recomputing(cfg)
        if how is not None:  # before DDP or FSDP wrap the blocks (parallel.strategies.recompute)
            recompute_model(model, example_input(cfg.data, spec=runtime.data), how)
        model = apply(model, mesh, cfg, runtime)
        if compiling(cfg, runtime):  # after DDP or FSDP2 (Note [regional compilation])
            compile_model(model)
        materialize_and_init(model, runtime.device, plan, runtime.values)
        loss = build_loss(cfg.loss, cfg.data.task, cfg.strategy.loss_parallel)
        return LocalEngine(model, loss, data_mesh(mesh).get_group(), runtime.device, cfg.trainer.grad_accum,
                           bf16_run(cfg), sequence, state_sharding(mesh, cfg.strategy.zero))

    return build


@dataclass(frozen=True)
class Strategy:
    """A strategy's code: its builder, and its own checks of its keys (before the degrees are derived) beyond
    what its row of the table answers (Note [strategy table])."""

    build: Callable[[nn.Module, DeviceMesh, Config, Runtime, InitPlan], Engine]
    check: Callable[[Config, int], None] | None = None


# Every row of the table but those that choose another strategy (auto, before the workers start).
STRATEGIES = {
    "single": Strategy(_local(apply_single)),
    "data": Strategy(_local(apply_data)),
    "pipeline": Strategy(build_pipeline),  # its checks need the degrees: check_pipeline, by `pipelined`
    "model": Strategy(_local(apply_tensor)),
    # Each sequence split over the cp ranks; the weights data-parallel over them (zero as strategy=data).
    "context": Strategy(_local(apply_data)),
    "expert": Strategy(build_hybrid),  # hybrid over the ep dimension alone (parallel.strategies.expert)
    "hybrid": Strategy(build_hybrid),  # the order it applies the pieces in: parallel.strategies.hybrid
    "offload": Strategy(build_offload, check_offload),
}


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime, plan: InitPlan) -> Engine:
    """Apply the configured strategy to `model` (on the meta device) and return this rank's engine.

    Parameter names never change (Note [initialization by name]).
    """
    warning = batchnorm_warning(model, cfg)
    if warning:
        log.warning("%s (Note [batch norm] in parallel/batchnorm.py)", warning)
    return STRATEGIES[cfg.strategy.name].build(model, mesh, cfg, runtime, plan)


def check_strategy(cfg: Config, world_size: int) -> None:
    """The strategy's name, its own checks, and the keys its row of the table answers that do not depend on
    derived degrees."""
    s = cfg.strategy
    spec = strategy_spec(s.name)
    if s.zero not in ZERO_LEVELS:
        fail("strategy.zero", s.zero, "unknown ZeRO level", list(ZERO_LEVELS))
    check_recompute(s, spec.offloads)  # before offload's own check of its tiers, which names no selective
    own = STRATEGIES[s.name].check
    if own is not None:
        own(cfg, world_size)
    if spec.one_device and world_size != 1:
        fail("strategy", s.name, f"runs on one process, but the world size is {world_size}",
             "strategy=data or strategy=pipeline for several processes")
    if s.zero not in spec.zero:
        sharding = [n for n, other in SPECS.items() if len(other.zero) > 1]
        fail("strategy.zero", s.zero, f"ZeRO sharding needs strategy={', '.join(sharding[:-1])} or {sharding[-1]}")
    if s.balance not in BALANCES:
        fail("strategy.balance", s.balance, "unknown cost", list(BALANCES))
    check_tensor_keys(s, spec.splits_tensors)
