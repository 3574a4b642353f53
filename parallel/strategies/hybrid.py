"""strategy=hybrid: data x expert x pipeline x context x tensor parallelism on one named DeviceMesh.

The mesh is (dp, ep, pp, cp, tp), tp innermost (Note [mesh dimensions] in
parallel/dims.py). `parallelize` applies the pieces in a fixed order, each one
working on what the one before left:

  1. pipeline split (pp > 1): the model is traced and cut into stages; this
     rank keeps its stages. The traced blocks are swapped back for the model's
     own modules (`eager_blocks`, parallel/strategies/pipeline/stages.py), so
     the next steps see real nn.Linear layers and the model's own forward code;
     nested blocks (Hugging Face models) stay traced, which steps 2b, 3 and 4
     take as they are (Note [own or traced blocks]).
  2. tensor plan (tp > 1): each kept module's layers are split over the tp
     ranks by the plan (parallel.strategies.tensor); a stage takes the entries
     for its own layers, its traced ones made the model's own first (Note
     [tensor parallelism over traced blocks]).
  2b. context plan (cp > 1): attention over the cp ranks, and the engine cuts
     each batch to this rank's chunks of every sequence
     (parallel.strategies.context); it changes no weights. With a pipeline,
     each stage's blocks take the cp attention (the model's own, or in the
     traced graphs of a Hugging Face model's) and the first stage is traced on
     the chunks with their positions as an input (Note [context parallelism
     under the pipeline] in parallel/strategies/context).
  3. data parallelism (dp x ep x cp > 1): FSDP2 over the dense weights'
     data-parallel ranks (dp x ep x cp flattened), composed with the
     tensor-parallel DTensors as PyTorch recommends: one unit per block, then
     the root (parallel.strategies.data, the piece strategy=data uses too).
     zero=0 replicates (FSDP2's replicate: gradients all-reduced); zero=1
     replicates and shards the optimizer state (Note [ZeRO 1] in
     parallel/optim.py; experts' state over their own dp ranks); zero=2 shards
     gradients and optimizer state, keeping parameters gathered from forward to
     backward; zero=3 shards parameters too. At zero 2 and 3,
     strategy.dp_replicate = R shards within R groups of those ranks and
     replicates across them (HSDP: Note [hybrid sharding] in parallel/dims.py).
  4. materialization: every piece is allocated and initialized by name
     (Note [initialization by name]), so the run starts from the single-device
     weights whatever the mesh.

Data parallelism replicates whole pipelines: the ranks sharing a (pp, tp)
position hold the same piece and average their gradients.
"""
from __future__ import annotations

import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.batchnorm import sync_batchnorm
from parallel.config import Config, bf16_run
from parallel.data import example_input
from parallel.dims import batch_mesh, data_mesh, fsdp_mesh
from parallel.engine import Engine
from parallel.init import InitPlan, materialize_and_init
from parallel.loss import build_loss
from parallel.runtime import Runtime
from parallel.strategies.compile import compile_model, compiling
from parallel.strategies.context import apply_context, point_stage_attention, sequence_shard
from parallel.strategies.context.traced import traceable_attention
from parallel.strategies.data import blocks_of, data_parallel, mixed_precision, precision, state_sharding
from parallel.strategies.expert import expert_engine, expert_params, shard_experts
from parallel.strategies.expert_hf import shard_hf_experts
from parallel.strategies.pipeline import build_pipeline
from parallel.strategies.recompute import recompute_model, recomputing
from parallel.strategies.tensor import shard, tensor_plan
from parallel.tensors import as_call

# A tensor-parallel layer hands its output on as a view of a DTensor's local
# piece, which FSDP2 warns about in case the caller changes it in place; the
# engines never do (the loss reads it out of place).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def build_hybrid(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime, plan: InitPlan) -> Engine:
    """Apply steps 1-4 to `model` (on the meta device) and return this rank's engine."""
    s = cfg.strategy
    tp_plan = {}
    if s.tp > 1:  # the plan checked against the model, inferred from one batch's input on meta if need be
        example = as_call(example_input(cfg.data, spec=runtime.data))[0]
        tp_plan = tensor_plan(model, s.tp, s.tp_plan, s.sequence_parallel, example, s.loss_parallel)
    param_dtype, reduce_dtype = precision(cfg)  # Note [mixed precision]
    policy = mixed_precision(param_dtype, reduce_dtype)  # the experts' own units'
    # Once for every stage of the rank: a 2-D mesh of hybrid sharding has process groups of its own.
    dp_mesh = fsdp_mesh(mesh, s.dp_replicate) if data_mesh(mesh).size() > 1 else None

    def pieces(module: nn.Module, blocks: list[nn.Module]) -> None:  # steps 2 and 3, on one module
        if s.pp > 1 and sequence is not None:  # a stage's blocks: their attention over the cp ranks
            point_stage_attention(module, sequence, model)
        if s.tp > 1:  # a stage's traced layers made ready first (Note [tensor parallelism over traced blocks])
            shard(module, mesh, tp_plan, model if s.pp > 1 else None)
        if s.ep > 1:  # before the blocks' data-parallel units, which leave the experts' own units out
            # Experts may be a model's only ModuleList: neither this rank's (their own units) nor the others'
            # (no longer in the model) are blocks.
            held = {id(e) for shard in shard_experts(module, mesh, s.zero, policy) for e in shard.values()}
            held |= {id(e) for e in shard_hf_experts(module, mesh, s.zero, policy)}
            present = {id(m) for m in module.modules()}
            blocks = [b for b in blocks if id(b) in present and id(b) not in held]
        if dp_mesh is not None:
            if s.sync_batchnorm:  # Note [batch norm]: BatchNorm statistics over the dp ranks
                sync_batchnorm(module, batch_mesh(mesh).get_group())
            # FSDP2's replicate, not DDP, for zero 0 and 1: DDP does not take the DTensor parameters tensor
            # parallelism leaves, nor the per-microbatch gradient-sync switch PipelineStage drives.
            data_parallel(module, blocks, dp_mesh, s.zero, param_dtype, reduce_dtype, ddp=False)

    if s.pp > 1:
        sequence = sequence_shard(mesh)  # Note [context parallelism under the pipeline]
        if sequence is not None:
            traceable_attention(model)  # before the trace (Note [traced attention over the cp ranks])
        tp_shapes = (lambda module: shard(module, mesh, tp_plan, model)) if s.tp > 1 else None  # noqa: E731
        engine = build_pipeline(model, mesh, cfg, runtime, plan, transform=pieces, shape_transform=tp_shapes,
                                sequence=sequence)
        engine.state_sharding = zero1(list(engine.model), mesh, s.zero)
        return engine
    sequence = apply_context(model, mesh)  # cp > 1: attention over the cp ranks
    how = recomputing(cfg)
    if how is not None:  # after the tensor plan would do as well; before FSDP wraps the blocks
        recompute_model(model, example_input(cfg.data, spec=runtime.data), how)
    pieces(model, blocks_of(model))
    if compiling(cfg, runtime):  # after the tensor plan and FSDP2 (Note [regional compilation])
        compile_model(model)
    materialize_and_init(model, runtime.device, plan, runtime.values)
    loss = build_loss(cfg.loss, cfg.data.task, s.loss_parallel)
    return expert_engine(mesh, model, loss, data_mesh(mesh).get_group(), runtime.device, cfg.trainer.grad_accum,
                         bf16_run(cfg), sequence, zero1([model], mesh, s.zero))


def zero1(modules: list[nn.Module], mesh: DeviceMesh, zero: int):
    """ZeRO 1's layout of the optimizer state of `modules` (materialized) at ZeRO level `zero` (None but at 1):
    the dense weights' over their data-parallel ranks, the experts' over mesh["dp"], the ranks that hold the same
    experts."""
    dp_group = mesh["dp"].get_group()
    return state_sharding(mesh, zero, {i: dp_group for i in expert_params(modules)})
