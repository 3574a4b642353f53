"""Data parallelism, the one piece every strategy that spreads the batch uses (data, context, expert, hybrid):
replicate or shard the dense weights over their data-parallel ranks by `strategy.zero`.

    zero=0  replicated: parameters, gradients and optimizer state on every rank; gradients all-reduced.
    zero=1  as zero=0, with the optimizer state sharded (parallel.optim.ShardedOptimizer, which the
            strategy asks for through `state_sharding`).
    zero=2  FSDP2 fully_shard, parameters kept gathered between forward and backward
            (reshard_after_forward=False): gradients and optimizer state sharded.
    zero=3  FSDP2 fully_shard, parameters resharded after forward (the root's after backward, which
            starts with them): everything sharded.

At zero 2 and 3, strategy.dp_replicate = R shards within R groups of the data-parallel ranks and replicates
across them (PyTorch's HSDP: Note [hybrid sharding] in parallel/dims.py).

Replication is DDP's (composable `replicate`: buckets all-reduced while backward runs) where the weights are
plain tensors and the whole model is on the rank (strategy=data and context); FSDP2's replicate where DDP
cannot go: DTensor weights of tensor parallelism, pipeline stages (their per-microbatch gradient-sync switch),
and models whose experts are their own units (hybrid, expert).

# Note [mixed precision]
Under trainer.precision=bf16 (what `auto` means on CUDA) the run computes in bf16 as the field's leaders run
it, and keeps fp32 weights and optimizer state (the master copy):
- every engine's forward runs under bf16 autocast (parallel.engine.autocast), on CUDA and on the CPU alike;
- FSDP2 units (zero 2/3, and FSDP2's replicate) get a MixedPrecisionPolicy: parameters gathered and computed
  in bf16 (half the all-gather bytes), gradients reduced in `trainer.reduce_precision` (fp32 by default, the
  sum of bf16 gradients being where precision is lost; bf16 halves the reduce traffic) and kept in fp32;
- DDP keeps fp32 gradients and reduces them in fp32, or in bf16 with trainer.reduce_precision=bf16 (a
  communication hook: each bucket cast to bf16, divided by the group's size, all-reduced, cast back; torch's
  own bf16_compress_hook does the same but refuses every backend but NCCL and XCCL, gloo included).
The bf16 values are those autocast takes: an fp32 weight rounded to bf16 once per step, so a bf16 run under
any of these strategies follows `strategy=single` at bf16 to bf16's rounding (the tests' tolerances), not to
1e-4 as fp32 runs do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate as ddp_replicate
from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parallel.batchnorm import sync_batchnorm
from parallel.config import Config, StrategyConfig, bf16_run, fail, positive
from parallel.dims import data_mesh, fsdp_mesh
from parallel.optim import StateSharding
from parallel.runtime import Runtime


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the children of its outermost ModuleLists or ModuleDicts (torchtitan's
    layout; a ModuleList inside a block, such as a mixture-of-experts layer's experts, belongs to that block's
    unit)."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for child in model.modules():  # parents before their children
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and id(child) not in inside:
            items = list(child.children())
            blocks += items
            inside |= {id(m) for b in items for m in b.modules()}
    return blocks


def precision(cfg: Config) -> tuple[torch.dtype | None, torch.dtype]:
    """The run's (param_dtype, reduce_dtype) (Note [mixed precision]): bf16 parameters under bf16 (None: the
    parameters' own fp32), gradients reduced in trainer.reduce_precision. What a strategy's builder reads from
    the config and hands to `data_parallel`, `mixed_precision` and the experts' units."""
    reduce = torch.bfloat16 if cfg.trainer.reduce_precision == "bf16" else torch.float32
    return (torch.bfloat16 if bf16_run(cfg) else None), reduce


def mixed_precision(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2's policy (Note [mixed precision]): parameters gathered and computed in `param_dtype` (None: their
    own), gradients reduced in `reduce_dtype`; torch's default (everything in the parameters' fp32) for
    (None, fp32)."""
    if param_dtype is None:
        return MixedPrecisionPolicy(reduce_dtype=reduce_dtype if reduce_dtype is torch.bfloat16 else None)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def data_parallel(module: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, zero: int,
                  param_dtype: torch.dtype | None, reduce_dtype: torch.dtype, ddp: bool, replicate_fn=None) -> None:
    """Replicate or shard `module` over the dense weights' data-parallel ranks (dp x ep x cp, Note [mesh
    dimensions] in parallel/dims.py), in place, by ZeRO level.

    Args:
        blocks: its repeated blocks: FSDP2 units of their own, so that one block's weights are gathered
            (and, replicated, reduced) at a time; then `module` itself.
        dp_mesh: those ranks (`fsdp_mesh`): 1-D, or at zero 2 and 3 the 2-D (dp_replicate, dp_shard) mesh of
            hybrid sharding (Note [hybrid sharding]), which fully_shard takes as HSDP.
        zero: strategy.zero (0-3, the module's docstring).
        param_dtype, reduce_dtype: the run's precision (`precision`, Note [mixed precision]): FSDP2 gathers
            and computes in `param_dtype` (None: the parameters' own) and reduces gradients in `reduce_dtype`;
            DDP reduces in `reduce_dtype` (bf16: a communication hook).
        ddp: replicate with DDP (plain tensors, the whole model on the rank) rather than FSDP2's replicate.
        replicate_fn: the planner's stand-in for DDP's replicate (DDP's reducer cannot run on fake tensors,
            Note [runtime]); None: DDP's own.
    """
    if zero <= 1 and ddp:
        # The composable form of DDP keeps parameter names unchanged (no `module.` prefix) and builds its
        # reducer lazily at the first forward, after the model has been materialized and initialized.
        if replicate_fn is not None:  # the planner's stand-in: told what the hook would send
            replicate_fn(module, device_mesh=dp_mesh, reduce_dtype=reduce_dtype)
            return
        ddp_replicate(module, device_mesh=dp_mesh)
        if reduce_dtype is torch.bfloat16:
            module.register_comm_hook(dp_mesh.get_group(), bf16_reduce)
        return
    policy = mixed_precision(param_dtype, reduce_dtype)

    def wrap(m: nn.Module, root: bool = False) -> None:
        if zero <= 1:
            fsdp_replicate(m, mesh=dp_mesh, mp_policy=policy)
            return
        # The root keeps its parameters from forward to backward, as fully_shard does by default: backward
        # starts with them (the head), so resharding would gather them again at once; a model without
        # blocks is all root, and zero=3 reshards it.
        fully_shard(m, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=zero == 3 and not (root and blocks))

    for block in blocks:
        wrap(block)
    wrap(module, root=True)


def bf16_reduce(group, bucket):  # no annotations: DDP compares them with its own classes, and these are strings
    """DDP's communication hook under trainer.reduce_precision=bf16: the bucket (a dist.GradBucket)'s mean over
    `group` taken in bf16 (half the bytes), written back into the fp32 bucket (Note [mixed precision])."""
    grads = bucket.buffer()
    low = grads.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(low, group=group, async_op=True).get_future()

    def back(done: torch.futures.Future) -> torch.Tensor:
        grads.copy_(done.value()[0])
        return grads

    return future.then(back)


def state_sharding(mesh: DeviceMesh, zero: int, own_groups: dict[int, object] | None = None) \
        -> StateSharding | None:
    """ZeRO 1's layout of the optimizer state: sharded over the dense weights' data-parallel ranks (and a
    parameter in `own_groups`, id -> group, over its own: experts over mesh["dp"]); None below zero 1's
    sharding (`zero` 0, one data-parallel rank) and above it (FSDP2 shards the state with the weights)."""
    group = data_mesh(mesh)
    if zero != 1 or (group.size() == 1 and not own_groups):
        return None
    return StateSharding(group.get_group(), dict(own_groups or {}))


def apply_data(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime) -> nn.Module:
    """strategy=data and context: replicate or shard `model` over the data-parallel ranks, in place."""
    if cfg.strategy.sync_batchnorm:  # Note [batch norm]: before DDP or FSDP2 wrap the layers
        sync_batchnorm(model, data_mesh(mesh).get_group())
    data_parallel(model, blocks_of(model), fsdp_mesh(mesh, cfg.strategy.dp_replicate), cfg.strategy.zero,
                  *precision(cfg), ddp=True, replicate_fn=runtime.replicate)
    return model


def check_replicas(s: StrategyConfig) -> None:
    """strategy.dp_replicate (resolved degrees): an integer >= 1 dividing dp, above 1 only where there is a
    sharded group to replicate, zero 2 and 3 without expert parallelism (Note [hybrid sharding])."""
    r = s.dp_replicate
    if r is None:
        return
    positive("strategy.dp_replicate", r)
    if r == 1:
        return
    if s.zero < 2:
        held = "holds every weight whole on every rank" if s.zero == 0 else "shards the optimizer state alone, " \
            "over every dp rank"
        fail("strategy.dp_replicate", r, f"replicas of a sharded group need strategy.zero 2 or 3 (FSDP2); zero "
             f"{s.zero} {held}", [1, "strategy.zero=2", "strategy.zero=3"])
    if s.ep > 1:
        fail("strategy.dp_replicate", r, f"with strategy.ep={s.ep} the experts are FSDP2 units of their own over "
             f"dp; hybrid sharding covers the dense weights of strategy=data and hybrid without experts", [1])
    if s.dp % r:
        fail("strategy.dp_replicate", r, f"must divide the data-parallel degree strategy.dp={s.dp}: the dp ranks "
             f"split into {r} groups of equal size", [d for d in range(1, s.dp + 1) if s.dp % d == 0])
