"""The style names a tensor-parallel plan uses, and the PyTorch ParallelStyle each one makes for a module.

Most styles are PyTorch's own (ColwiseParallel, RowwiseParallel, SequenceParallel,
and FirstInput below, PrepareModuleInput's move of one input). Two module kinds take a style of their own:
- nn.Embedding under `rowwise`: its rows (the vocabulary) are split and the token
  ids come in whole (RowwiseParallel with a replicated input: an id is never split
  by features). Each rank looks up the ids in its rows; the lookups are summed.
- Hugging Face's `Conv1D` (GPT-2's layers), Note [Conv1D] below.
"""
from __future__ import annotations

import inspect
from functools import partial

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from parallel.models.layers import LocallyConnected1d, LocallyConnected2d, PositionwiseParallel

SEQ = Shard(1)  # activations are (batch, sequence, features)
STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence": lambda: SequenceParallel(),
    "replicate": None,
    "replicate_grads": lambda: SumGradients(),
    "positions": lambda: PositionwiseParallel(),
    "seq_split": lambda: FirstInput(Replicate(), SEQ),
    "seq_gather": lambda: FirstInput(SEQ, Replicate()),
    "rowwise_seq": lambda: RowwiseParallel(output_layouts=SEQ),
    "colwise_seq_gather": lambda: ColwiseParallel(input_layouts=SEQ, output_layouts=Replicate()),
    # loss parallelism (strategy.loss_parallel): the head's logits left split by the vocabulary, as a DTensor
    "colwise_loss": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    "colwise_seq_loss": lambda: ColwiseParallel(input_layouts=SEQ, output_layouts=Shard(-1), use_local_output=False),
}
SHARDS_OUTPUT = ("colwise", "colwise_gather", "colwise_seq_gather", "colwise_loss", "colwise_seq_loss")
SHARDS_INPUT = ("rowwise", "rowwise_split", "rowwise_seq")
KEEPS_OUTPUT_SHARDED = ("colwise",)  # the next layer sees this rank's slice of the features (of the heads)


class FirstInput(ParallelStyle):
    """The module's first input moved from `source` to `target` placements over the tp ranks, a local tensor
    in and out, whether it comes positionally or by its parameter's name (Hugging Face's decoder layers call
    their attention `self_attn(hidden_states=...)`); PyTorch's PrepareModuleInput takes positional inputs
    only, as many as its layouts."""

    def __init__(self, source, target):
        super().__init__()
        self.source, self.target = source, target

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        name = next(iter(inspect.signature(module.forward).parameters), None)

        def moved(x):
            d = x if isinstance(x, DTensor) else DTensor.from_local(x, device_mesh, (self.source,), run_check=False)
            return d.redistribute(placements=(self.target,)).to_local()

        def before_forward(mod, args, kwargs):
            if args:
                return (moved(args[0]), *args[1:]), kwargs
            if name in kwargs:
                return args, {**kwargs, name: moved(kwargs[name])}
            raise TypeError(f"{type(mod).__name__} was called without its first input ({name!r})")

        module.register_forward_pre_hook(before_forward, with_kwargs=True)
        return module


class SumGradients(ParallelStyle):
    """The module's weights whole on every tp rank, their gradients summed over the tp group: for a weight applied
    to each rank's own piece of the activations (a per-head norm after a colwise projection, Qwen3's q_norm and
    k_norm), whose rank sees part of its gradient (Note [weights left whole] in
    parallel/strategies/tensor/whole.py). Hugging Face's `replicated_with_grad_allreduce`."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = device_mesh.get_group()

        def summed(grad):
            grad = grad.clone()  # autograd's own buffer may be shared with another gradient
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
            return grad

        # The parameters a forward meets: those made when the model was materialized after this style ran (on
        # meta), or loaded since; each takes the hook once, on the gradient of every micro-step before it
        # accumulates (a hook after accumulation would sum an accumulated gradient again).
        hooked: set[int] = set()

        def before_forward(mod, args):
            for p in mod.parameters():
                if p.requires_grad and id(p) not in hooked:
                    hooked.add(id(p))
                    p.register_hook(summed)

        module.register_forward_pre_hook(before_forward)
        return module


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's `Conv1D` (transformers.pytorch_utils), told by its shape, without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_linear(module: nn.Module) -> bool:
    """A layer a colwise or rowwise style splits by features: nn.Linear or Hugging Face's Conv1D."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def make_style(style: str, module: nn.Module):
    """The ParallelStyle of `style` for `module`, or None for `replicate`."""
    if is_conv1d(module) and style in SHARDS_OUTPUT + SHARDS_INPUT:
        return _conv1d_style(style)
    if style == "rowwise" and isinstance(module, nn.Embedding):
        return RowwiseParallel(input_layouts=Replicate())  # token ids come in whole (module docstring)
    factory = STYLES[style]
    return factory() if factory is not None else None


def weight_placement(style: str | None, module: nn.Module):
    """How `style` places `module.weight` (Shard(dim) or None for whole): tied weights must agree."""
    if style == "positions":
        return Shard(0)
    if style not in SHARDS_OUTPUT + SHARDS_INPUT:
        return None
    output = style in SHARDS_OUTPUT
    if is_conv1d(module):  # (in, out)
        return Shard(1 if output else 0)
    if isinstance(module, nn.Embedding):  # (rows, features)
        return Shard(1 if output else 0)
    return Shard(0 if output else 1)  # nn.Linear: (out, in)


def can_take(style: str, module: nn.Module) -> bool:
    """Whether `style` can shard `module`'s kind of layer."""
    if style == "positions":
        return isinstance(module, (LocallyConnected1d, LocallyConnected2d))
    if style in SHARDS_OUTPUT + SHARDS_INPUT:
        if is_conv1d(module):
            return style in ("colwise", "colwise_gather", "rowwise", "rowwise_split")
        return isinstance(module, (nn.Linear, nn.Embedding))
    return True


# Note [Conv1D]
# Hugging Face's Conv1D (GPT-2's c_attn, c_proj, c_fc) computes x @ weight + bias with its weight stored
# (in_features, out_features): nn.Linear's transposed. PyTorch's Colwise/RowwiseParallel take nn.Linear and
# nn.Embedding only, so these two styles do the same for Conv1D with the dimensions swapped: colwise splits
# the weight's dimension 1 and the bias (output features), rowwise the weight's dimension 0 (input features)
# with the bias whole. The forward then runs Conv1D's own code on DTensors (addmm and views of global
# shapes), and the parameters keep Conv1D's layout and names, so initial values and saved weights are the
# unsharded model's. A Conv1D that packs several projections (GPT-2's c_attn: q, k and v side by side) must
# not be split colwise with its output kept split (a rank would get all of q and half of k): the plan check
# refuses it (parallel.strategies.tensor.checks.check_heads).

def _distribute(placements: dict, name, module, mesh) -> None:
    for pname, placement in placements.items():
        param = getattr(module, pname, None)
        if param is not None:
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                          requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for Hugging Face's Conv1D: output features split (Note [Conv1D])."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, partial(_distribute, {"weight": Shard(1), "bias": Shard(0)}),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for Hugging Face's Conv1D: input features split, bias whole (Note [Conv1D])."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh,
                                 partial(_distribute, {"weight": Shard(0), "bias": Replicate()}),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _conv1d_style(style: str):
    return {"colwise": lambda: Conv1DColwise(), "colwise_gather": lambda: Conv1DColwise(output_layouts=Replicate()),
            "rowwise": lambda: Conv1DRowwise(),
            "rowwise_split": lambda: Conv1DRowwise(input_layouts=Replicate())}[style]()
