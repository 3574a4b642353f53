"""This rank's pipeline stages: built from the traced split, materialized, tied, and timed.

Each stage module is one piece of the chain (Note [stage chain] in chain.py),
so it keeps the original parameter names. With a `transform` (strategy=hybrid)
the model's own block modules are swapped back in first where they can be
(Note [own or traced blocks]), so tensor and data parallelism see real layers
(traced blocks: the layers tensor parallelism splits).
Weights tied across stages live as one copy per stage (`TiedCopy`); the engine
sums their gradients.

# Note [own or traced blocks]
A traced stage calls each block as a submodule, passing the values the trace
found the block reads, flattened, in the trace's order. For a top-level block
(the built-in models: `blocks.N`) those are the arguments the model's forward
gave it, so the model's own module is a drop-in replacement, and it is swapped
in (`eager_blocks`): tensor parallel styles shard its nn.Linear layers, context
parallelism points its attention at the cp ranks, torch.compile compiles its
code. A nested block (a Hugging Face `model.layers.N`, Note [nested blocks] in
parallel/blocks.py) is called by its parent with keyword arguments, caches and
rotary embeddings the trace has flattened away: its own forward would not take
the traced call. Such stages keep their traced blocks (`traced_blocks`), which
compute exactly what the model's would: data parallelism (FSDP2 units per
block, then the stage) and recomputation need only module boundaries and
parameters, which the traced blocks keep under the original names; context
parallelism replaces the attention ops in their graphs (Note [traced attention
over the cp ranks] in parallel/strategies/context/traced.py); tensor
parallelism puts the model's own layers (nn.Linear, nn.Embedding) in place of
the traced ones it splits and has the graphs around them read their shapes at
run time, as the model's code does (Note [tensor parallelism over traced
blocks] in parallel/strategies/tensor/traced.py). What needs the model's own
block code (ep, trainer.compile, sync_batchnorm's BatchNorm layers), and
sequence parallelism, are refused for nested blocks with pp > 1 (check.py).
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from parallel.blocks import nested, repeated_blocks
from parallel.config import ConfigError
from parallel.init import InitPlan, materialize_and_init
from parallel.profiling import phase
from parallel.runtime import Runtime
from parallel.strategies.compile import compile_blocks
from parallel.strategies.pipeline.chain import chain, compiled, on_the_wire, received, stage_shapes, used_names
from parallel.strategies.pipeline.split import Split
from parallel.strategies.pipeline.trace import retarget
from parallel.strategies.recompute import Recompute, recompute_blocks


@dataclass
class TiedCopy:
    """This rank's copies of one weight tied across stages, and who else holds it."""

    params: list[nn.Parameter]
    group: object  # process group of the ranks holding a copy; None when only this rank does
    owner: bool  # this rank's first copy is the one counted in the gradient norm


@dataclass
class ComputeTime:
    """Seconds this rank's stages spent computing since the last reset: the engine's busy counters, and each
    chunk's interval for the timeline (Note [pipeline timeline] in timeline.py)."""

    total: float = 0.0
    per_stage: dict[int, float] = field(default_factory=dict)  # stage index -> seconds
    chunks: list[tuple[str, int, int, float, float]] = field(default_factory=list)  # (kind, stage, mb, start, end)

    def reset(self) -> None:
        self.total, self.per_stage, self.chunks = 0.0, dict.fromkeys(self.per_stage, 0.0), []

    def add(self, kind: str, stage_index: int, microbatch: int, start: float, end: float) -> None:
        self.total += end - start
        self.per_stage[stage_index] += end - start
        self.chunks.append((kind, stage_index, microbatch, start, end))


class TimedStage(PipelineStage):
    """A PipelineStage that adds the compute time of each chunk it runs to a shared `ComputeTime`.

    The schedule sends and receives outside these three calls, so what is left
    of a step beyond their time is waiting: the measured bubble. Signatures as
    in torch/distributed/pipelining/stage.py (the same in torch 2.11-2.15).
    """

    def __init__(self, *args, compute_time: ComputeTime, **kwargs):
        super().__init__(*args, **kwargs)
        self.compute_time = compute_time
        compute_time.per_stage.setdefault(self.stage_index, 0.0)

    @contextlib.contextmanager
    def _timed(self, kind: str, microbatch: int):
        """Time one chunk, named in a profile as e.g. "stage1 backward mb3" (Note [profiles])."""
        with phase(f"stage{self.stage_index} {kind} mb{microbatch}"):
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.compute_time.add(kind, self.stage_index, microbatch, t0, time.perf_counter())

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True):
        with self._timed("forward", fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        # Zero-bubble schedules split backward: full_backward=False computes the input's gradient only, and
        # backward_weight_one_chunk the weights' later.
        with self._timed("backward", bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with self._timed("backward_weight", bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)


def build_stages(split: Split, mesh: DeviceMesh, runtime: Runtime, plan: InitPlan, compute_time: ComputeTime,
                 ranks: list[int], example: tuple, *, bf16: bool, recompute: Recompute | None, compiles: bool,
                 model: nn.Module | None = None, transform=None, shape_transform=None):
    """Materialize this rank's stages; returns (stage objects, their modules, tied copies).

    With `model` (strategy=hybrid, or trainer.compile), each stage gets the model's
    own block modules in place of the traced ones (Note [own or traced blocks]),
    then `transform(stage, blocks)`; without it, `transform` is given the traced
    blocks. Every stage times its compute into `compute_time`.

    Args:
        ranks: the pp rank of every stage (schedules.stage_ranks of the schedule).
        example: one microbatch's positional inputs on meta (split.example_microbatch), to shape the stages
            up front under `runtime.static_shapes`.
        bf16: stages compute under bf16 autocast (Note [bf16 stages]).
        recompute: what each stage's blocks recompute in backward (strategy.activations=checkpoint or selective:
            Note [selective recomputation] in parallel/strategies/recompute.py); None: nothing.
        compiles: compile each stage's blocks (trainer.compile, with `model`: Note [regional compilation]).
    """
    device = runtime.device
    pp_mesh = mesh["pp"]
    pp_rank, pp_group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    mine = [i for i, r in enumerate(ranks) if r == pp_rank]
    try:
        chained = chain(split.pipe)  # Note [stage chain]
    except ValueError as e:
        raise ConfigError(f"strategy=pipeline: {e}") from None
    wire = torch.bfloat16 if bf16 else None  # what crosses a boundary (Note [bf16 stages])
    shapes = _static_shapes(split, chained, example, model, shape_transform, wire) if runtime.static_shapes else None
    stages, modules = [], []
    for i in mine:
        mod = chained[i]
        _prepare(mod, split, device, model, transform, recompute, compiles)
        if bf16:
            in_bf16(mod, device, first=i == 0, last=i == len(chained) - 1)
        materialize_and_init(mod, device, plan, runtime.values)
        # Shapes are found at the first step (PyTorch's runtime inference); only
        # floating-point and boolean tensors cross stages (split._boundaries), which that allows.
        given = {}
        if shapes:  # floating-point values carry gradients between stages; the shapes come without them
            marked = [tuple(t.detach().requires_grad_(t.is_floating_point()) for t in ts) for ts in shapes[i]]
            given = dict(input_args=marked[0], output_args=marked[1])
        stages.append(TimedStage(mod, i, len(chained), device, group=pp_group, compute_time=compute_time, **given))
        modules.append(mod)
    return stages, modules, _tie(split, mesh, modules, ranks, plan)


def _prepare(mod: fx.GraphModule, split: Split, device: torch.device, model: nn.Module | None, transform,
             recompute: Recompute | None, compiles: bool) -> None:
    """One stage of the chain made ready to materialize: unused blocks dropped, run as generated code, on this
    rank's device; with `model`, the model's own blocks swapped in (else the traced ones kept, Note [own or
    traced blocks]); recomputation, `transform` and compilation applied in that order (Note [regional
    compilation] in parallel/strategies/compile.py), as `build_stages` asks; bf16 autocast goes around it all
    (`in_bf16`)."""
    _drop_unused(mod, split.blocks)
    _mark_transient(mod, split.transient)
    compiled(mod)
    retarget(mod, device)
    blocks = eager_blocks(mod, model, split.blocks) if model is not None else traced_blocks(mod, split.blocks)
    called = used_names(mod, ("call_module",))
    if recompute is not None:  # before the transform's FSDP units wrap the blocks
        recompute_blocks(mod, split.blocks, recompute, called)
    if transform is not None:
        transform(mod, blocks)
    if model is not None and compiles:
        compile_blocks(mod, [n for n in repeated_blocks(model) if n in called])


# Note [bf16 stages]
# Under bf16 (Note [mixed precision] in parallel/strategies/data.py) each stage computes under autocast, as the
# whole model does under strategy=single, and hands its floating-point outputs to the next stage in bf16, as
# Megatron-LM and torchtitan send bf16 activations: half the bytes of each send and receive buffer, forward and
# backward (the gradient of a bf16 output is bf16). Autocast alone would not make them bf16: it casts the
# inputs of matrix products, and a value that crosses a cut is often the sum of a product's bf16 output and an
# fp32 value (the residual stream of gpt, Llama, GPT-2: their embeddings are fp32 and fp32 + bf16 is fp32), so
# the boundary tensor leaves the stage's code in fp32. The cast is therefore at the stage's edge, in the forward
# `in_bf16` wraps around the split stage module, and the stages are told the same dtypes: PyTorch's inference of
# the send and receive buffers runs that forward (on meta tensors in some torch versions, where autocast casts
# nothing, so only an explicit cast makes the dtype right in all of them), and the shapes given up front
# (chain.stage_shapes with `wire`, the planner's) apply the same casts. A receiving stage computes on fp32 copies
# of what it receives (chain.received), the dtype it computed on when boundaries were fp32, so what changes from
# single is one rounding to bf16 of each fp32 value at each boundary: a residual stream single keeps in fp32
# between blocks is rounded once per cut (8 bits of mantissa), where single rounds it nowhere. A value that is
# bf16 in single anyway (a product's output, the built-in MLP's activations) crosses exactly. The losses follow
# single's at bf16 to bf16's rounding (tests/distributed/test_precision.py). The last stage's output goes to the
# loss, not to a send, and is handed over in fp32 as before. fp32 runs send fp32, unchanged.
def in_bf16(mod: nn.Module, device: torch.device, *, first: bool, last: bool) -> None:
    """Run stage `mod` under bf16 autocast on `device` (parallel.engine.autocast's, for a bf16 run): its inputs
    received in bf16 computed on in fp32 (unless `first`: the batch), its floating-point outputs handed on in
    bf16 (in fp32 when `last`: the loss's), Note [bf16 stages]."""
    inner = mod.forward

    def forward(*args, **kwargs):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = inner(*(args if first else received(args)), **kwargs)
        if last:
            return received(out)
        return on_the_wire(out, torch.bfloat16)

    mod.forward = forward  # an instance attribute: FSDP2's hooks, registered on the module, still run around it


def _static_shapes(split: Split, chained: list[fx.GraphModule], example: tuple, model: nn.Module | None,
                   shape_transform, wire: torch.dtype | None) -> list[tuple[tuple, tuple]]:
    """Every stage's boundary shapes up front (`runtime.static_shapes`: the planner, where no values cross), the
    floating-point ones in `wire` where it is given (Note [bf16 stages]).

    With a `shape_transform` (tensor parallelism) each stage is shaped as its
    ranks will hold it, on a copy (still on meta), so the chain itself stays untouched.
    """
    shaped = chained
    if shape_transform is not None:
        with unset_fake_temporarily():  # the traced graphs' own fake values copy as they are, not into the planner's
            shaped = [copy.deepcopy(gm) for gm in chained]
        for gm in shaped:
            _drop_unused(gm, split.blocks)
            if model is not None:  # else the traced blocks stay (Note [own or traced blocks])
                eager_blocks(gm, model, split.blocks)
            shape_transform(gm)
    return stage_shapes(shaped, example, wire)


def own_blocks(model: nn.Module, names: list[str]) -> bool:
    """Whether the model's own modules can stand in for the traced blocks `names`: none is nested (Note [own or
    traced blocks])."""
    return not any(nested(model, n) for n in names)


def traced_blocks(stage: fx.GraphModule, names: list[str]) -> list[nn.Module]:
    """The traced blocks among `names` that `stage` calls, in order (Note [own or traced blocks])."""
    called = used_names(stage, ("call_module",))
    return [stage.get_submodule(n) for n in names if n in called]


def eager_blocks(stage: fx.GraphModule, model: nn.Module, names: list[str]) -> list[nn.Module]:
    """Put the model's own modules in place of the traced copies of the blocks `stage` calls.

    The traced stage calls each block as a submodule with the arguments the
    forward gave it, so the model's module is a drop-in replacement; tensor
    parallel styles need it (they shard nn.Linear and nn.Embedding, and the
    model's code reads shapes at run time where the trace fixed them). The
    blocks are copied together, so weights shared between them stay shared.
    Returns the swapped-in blocks.
    """
    called = used_names(stage, ("call_module",))
    held = [n for n in names if n in called]
    originals = copy.deepcopy(nn.ModuleList(model.get_submodule(n) for n in held))
    for name, original in zip(held, originals):
        parent, _, leaf = name.rpartition(".")
        setattr(stage.get_submodule(parent) if parent else stage, leaf, original)
    return list(originals)


def _drop_unused(stage: fx.GraphModule, names: list[str]) -> None:
    """Remove blocks that a traced stage holds but never uses.

    The trace leaves a copy of a weight tied across stages (an output head tied
    to the embedding) in the first stage as well, under the head's name; that
    copy would be materialized, counted and saved without ever being trained.
    """
    used = used_names(stage)
    for name in names:
        if any(u == name or u.startswith(name + ".") for u in used):
            continue
        parent, _, leaf = name.rpartition(".")
        try:
            holder = stage.get_submodule(parent) if parent else stage
        except AttributeError:
            continue
        if leaf in holder._modules:
            delattr(holder, leaf)


def _mark_transient(stage: nn.Module, names: set[str]) -> None:
    """Keep the model's non-persistent buffers out of the stage's state dict (saved weights, checkpoints)."""
    for name, buffer in list(stage.named_buffers(remove_duplicate=False)):
        if name in names:
            parent, _, leaf = name.rpartition(".")
            (stage.get_submodule(parent) if parent else stage).register_buffer(leaf, buffer, persistent=False)


def _tie(split: Split, mesh: DeviceMesh, modules: list[nn.Module], ranks: list[int], plan: InitPlan):
    """Find weights that more than one stage holds and the groups that sum their gradients."""
    groups: dict[str, list[int]] = {}  # canonical name -> stages holding a copy
    for i in range(split.pipe.num_stages):
        for name, _ in split.pipe.get_stage_module(i).named_parameters():
            canonical = plan[name].canonical
            groups.setdefault(canonical, []).append(i)
    tied = []
    # Every pipeline in the mesh (one per dp x tp position), as rows of global ranks by stage rank.
    pp_rows = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), -1).reshape(-1, mesh["pp"].size())
    me = dist.get_rank()
    for canonical, stages in sorted(groups.items()):
        if len(stages) < 2:
            continue
        holders = sorted({ranks[i] for i in stages})
        group = None
        for row in pp_rows.tolist():  # every rank creates every group, in the same order
            g = dist.new_group([row[r] for r in holders]) if len(holders) > 1 else None
            if me in row:
                group = g
        params = [p for m in modules for n, p in m.named_parameters() if plan[n].canonical == canonical]
        if params:
            pp_rank = mesh["pp"].get_local_rank()
            tied.append(TiedCopy(params, group, owner=ranks[stages[0]] == pp_rank))
    return tied
