"""The names of the unpartitioned model, each with the module that initializes it, taken before any strategy
partitions it, and the meta model made real on this rank's device from those names (parallel.init.values says
where the values come from)."""
from __future__ import annotations

from typing import Dict, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily


class InitEntry(NamedTuple):
    """How one name of the unpartitioned model is initialized."""

    module: nn.Module  # the module that holds it
    local_name: str  # its name in that module
    canonical: str  # the name its value is kept under (a tied weight's first name)


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
def materialize_and_init(model: nn.Module, device: torch.device, plan: InitPlan, values) -> nn.Module:
    """Allocate every meta tensor of `model` on `device`, then fill this rank's piece of each from `values`.

    Args:
        model: the model (whole, sharded, or one pipeline stage), still on the meta device.
        device: where this rank's pieces live.
        plan: `init_plan` of the unpartitioned model.
        values: where the values come from (a parallel.init.values.Values).
    """
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
        values.fill(fqn, plan[fqn], tensor)
    return model


def _plain_meta_parameters(model: nn.Module) -> None:
    """Turn fake meta parameters into plain meta ones, keeping ties.

    The planner (parallel.planning.planner) builds strategies under FakeTensorMode; a
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


