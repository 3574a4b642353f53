"""strategy=data: data parallelism, with ZeRO-style sharding by `strategy.zero`.

    zero=0  DDP: parameters, gradients and optimizer state replicated; gradients all-reduced.
    zero=1  DDP + the optimizer state sharded (ZeroRedundancyOptimizer, see parallel.optim).
    zero=2  FSDP2 fully_shard, parameters kept gathered between forward and backward
            (reshard_after_forward=False): gradients and optimizer state sharded.
    zero=3  FSDP2 fully_shard, parameters resharded after forward (the root's after backward, which
            starts with them): everything sharded.
"""
from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from parallel.batchnorm import sync_batchnorm
from parallel.config import Config
from parallel.dims import data_mesh
from parallel.runtime import Runtime


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the children of its outermost ModuleLists (a ModuleList inside a block,
    such as a mixture-of-experts layer's experts, belongs to that block's unit)."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for child in model.modules():  # parents before their children
        if isinstance(child, nn.ModuleList) and id(child) not in inside:
            blocks += list(child)
            inside |= {id(m) for b in child for m in b.modules()}
    return blocks


def apply_data(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime) -> nn.Module:
    """Replicate or shard `model` over the dense weights' data-parallel ranks, in place (the mesh's dp
    dimension; dp x ep x cp where those are used, Note [mesh dimensions] in parallel/dims.py)."""
    dp_mesh = data_mesh(mesh)
    if cfg.strategy.sync_batchnorm:  # Note [batch norm]: before DDP or FSDP2 wrap the layers
        sync_batchnorm(model, dp_mesh.get_group())
    if cfg.strategy.zero <= 1:
        # The composable form of DDP keeps parameter names unchanged (no `module.`
        # prefix) and builds its reducer lazily at the first forward, after the
        # model has been materialized and initialized. (The planner passes a
        # stand-in: DDP's reducer cannot run on fake tensors, Note [runtime].)
        (runtime.replicate or replicate)(model, device_mesh=dp_mesh)
        return model
    reshard = cfg.strategy.zero == 3
    # One FSDP unit per block so that only one block's parameters are gathered at
    # a time, then the root for what is left (embeddings, head, norms). The root
    # keeps its parameters from forward to backward, as fully_shard does by default:
    # backward starts with them (the head), so resharding would gather them again
    # at once; a model without blocks is all root, and zero=3 reshards it.
    blocks = blocks_of(model)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard and not blocks)
    return model
