"""Materialize a meta-device model and initialize it independently of partitioning.

# Note [initialization by name]
Every parameter and buffer is filled from its own generator, seeded by
(seed, fully qualified name in the unpartitioned model). The full tensor is
computed on the CPU and each rank keeps only the piece it owns (a DTensor shard,
or the whole tensor), so the initial weights are the same whatever the strategy,
world size or stage split. Strategies therefore keep the original names.
The values follow PyTorch's own defaults for each layer type; a module with
parameters of its own kind provides `init_parameter(name, tensor, generator)`.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Dict, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor import DTensor, distribute_tensor


def name_seed(seed: int, fqn: str) -> int:
    """A stable 63-bit seed from (seed, name); Python's hash() is salted per process."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _uniform_fan_in(fan_in: int) -> Callable:
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return lambda t, g: t.uniform_(-bound, bound, generator=g)


def _rule(module: nn.Module, local_name: str, full: torch.Tensor) -> Callable | None:
    """PyTorch's default initialization of `module.<local_name>`, as (tensor, generator) -> None."""
    if hasattr(module, "init_parameter"):
        return lambda t, g: module.init_parameter(local_name, t, g)
    if isinstance(module, (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)):
        # kaiming_uniform(a=sqrt(5)) on the weight and the bias bound both reduce to 1/sqrt(fan_in).
        weight = module.weight
        fan_in = weight.shape[1] * math.prod(weight.shape[2:]) if weight.dim() > 1 else weight.shape[0]
        if isinstance(module, nn.modules.conv._ConvTransposeNd):
            fan_in = weight.shape[0] * math.prod(weight.shape[2:])
        return _uniform_fan_in(fan_in)
    if isinstance(module, nn.Embedding):
        return lambda t, g: t.normal_(0.0, 1.0, generator=g)
    norms = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
    if isinstance(module, norms):
        if local_name in ("weight", "running_var"):
            return lambda t, g: t.fill_(1)
        if local_name in ("bias", "running_mean", "num_batches_tracked"):
            return lambda t, g: t.zero_()
    return None


def full_init_value(module: nn.Module, local_name: str, fqn: str, shape, dtype, seed: int) -> torch.Tensor:
    """The initial value of one parameter or buffer, computed whole on the CPU."""
    full = torch.empty(shape, dtype=dtype, device="cpu")
    rule = _rule(module, local_name, full)
    if rule is None:
        raise ValueError(
            f"cannot initialize '{fqn}' of {type(module).__name__}: no default rule for it. "
            f"Give {type(module).__name__} a method init_parameter(self, name, tensor, generator) "
            "that fills `tensor` in place using `generator`.")
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, fqn))
    with torch.no_grad():
        rule(full, gen)
    return full


def _global_shape(t: torch.Tensor):
    return t.shape  # a DTensor reports its global shape


class InitEntry(NamedTuple):
    """How one name of the unpartitioned model is initialized."""

    module: nn.Module  # the module whose rule initializes it
    local_name: str  # its name in that module
    canonical: str  # the name its seed comes from (a tied weight's first name)


InitPlan = Dict[str, InitEntry]  # every parameter and buffer name of the unpartitioned model -> its entry


def init_plan(model: nn.Module) -> InitPlan:
    """For every name of every parameter and buffer of the *unpartitioned* model:
    the module whose rule initializes it, and the name its seed comes from.

    A tensor reachable under several names (tied weights, e.g. an embedding
    shared with the output head) is initialized once, by its first owner in
    module order and seeded by that owner's name, so every copy of it, in any
    stage, starts equal.
    """
    first: dict[int, tuple] = {}
    plan: InitPlan = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        tensors = list(module.named_parameters(recurse=False, remove_duplicate=False))
        tensors += list(module.named_buffers(recurse=False, remove_duplicate=False))
        for local_name, tensor in tensors:
            fqn = f"{mod_name}.{local_name}" if mod_name else local_name
            owner = first.setdefault(id(tensor), InitEntry(module, local_name, fqn))
            plan.setdefault(fqn, owner)
    return plan


@torch.no_grad()
def materialize_and_init(model: nn.Module, device: torch.device, seed: int, plan: InitPlan | None = None) -> nn.Module:
    """Allocate every meta tensor of `model` on `device`, then fill it per Note [initialization by name].

    Args:
        model: the model (whole, sharded, or one pipeline stage), still on the meta device.
        device: where this rank's pieces live.
        seed: the run's seed (trainer.seed).
        plan: `init_plan` of the unpartitioned model; by default, of `model` itself.
    """
    plan = plan if plan is not None else init_plan(model)
    _plain_meta_parameters(model)
    slots = [(m, name, p) for m in model.modules() for name, p in m._parameters.items() if p is not None]
    model.to_empty(device=device)
    _retie(slots)
    for p in model.parameters():
        p.grad = None  # to_empty would have turned a stray meta .grad into uninitialized memory
    done: set[int] = set()
    for fqn, tensor in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if id(tensor) in done:
            continue
        done.add(id(tensor))
        if fqn not in plan:
            raise KeyError(f"'{fqn}' is not a name of the unpartitioned model; strategies must keep names")
        module, local_name, canonical = plan[fqn]
        full = full_init_value(module, local_name, canonical, _global_shape(tensor), tensor.dtype, seed)
        if isinstance(tensor, DTensor):
            # Every rank computed the same full value, so each keeps its own piece
            # without communication (src_data_rank=None).
            piece = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.to_local().copy_(piece.to_local())
        else:
            tensor.copy_(full)
    return model


def _plain_meta_parameters(model: nn.Module) -> None:
    """Turn fake meta parameters into plain meta ones, keeping ties.

    The planner (parallel.planner) builds strategies under FakeTensorMode; a
    module made there (a traced pipeline stage) holds fake parameters, which
    `to_empty` can only move by swapping tensors, and FakeTensorMode's own weak
    references forbid that swap. Plain meta parameters move without one.
    """
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if isinstance(p, FakeTensor) and p.device.type == "meta":
                if id(p) not in made:
                    with unset_fake_temporarily():
                        made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                   requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]


def _retie(slots) -> None:
    """Share again the parameters that were shared before `to_empty`.

    Moving off the meta device builds a new Parameter for every module slot, so
    a weight tied between two modules (an embedding and the output head) would
    silently become two weights. `slots` lists (module, name, old parameter).
    """
    first: dict[int, nn.Parameter] = {}
    for module, name, old in slots:
        new = module._parameters[name]
        if id(old) in first:
            module._parameters[name] = first[id(old)]
        else:
            first[id(old)] = new


def check_initializable(model: nn.Module) -> None:
    """Raise ValueError naming the first parameter or buffer with no initialization rule."""
    for mod_name, module in model.named_modules():
        for local_name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if _rule(module, local_name, tensor) is None:
                fqn = f"{mod_name}.{local_name}" if mod_name else local_name
                full_init_value(module, local_name, fqn, (0,), tensor.dtype, 0)  # raises with the message
