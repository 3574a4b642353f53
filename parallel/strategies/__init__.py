"""Strategies: plain functions that transform a meta-device model for a mesh.

`parallelize` is the single place that applies them; see its comment on order.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.config import Config
from parallel.strategies.data import apply_data
from parallel.strategies.single import apply_single

# An explicit registry (not string _target_s): an unknown name fails listing these.
STRATEGIES = {
    "single": apply_single,
    "data": apply_data,
}


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: Config) -> nn.Module:
    """Apply the configured strategy to `model` (on the meta device) in place and return it.

    Order, for the strategies that compose (later: pipeline split -> tensor plan ->
    activation checkpointing -> FSDP/DDP -> offload): data parallelism wraps last
    because it shards or replicates whatever parameters the earlier steps left.
    Parameter names never change (Note [initialization by name]).
    """
    return STRATEGIES[cfg.strategy.name](model, mesh, cfg)
