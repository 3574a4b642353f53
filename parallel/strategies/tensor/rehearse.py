"""A tensor-parallel plan rehearsed on fake tensors before the workers start.

# Note [plan rehearsal]
A plan whose styles each fit their module (checks.py) may still not fit the forward between them: a SwiGLU's
gate colwise with its up left whole multiplies a rank's slice of the features by all of them; a fused q, k, v
projection split colwise may no longer split into q, k and v; a last layer colwise hands the loss a slice of
the logits. Workers would start, build, and fail at the first forward with a traceback, or train on a slice.
So validation runs the plan once as rank 0 of a tp group does: the meta model sharded by the plan's own
styles (`shard`: parallelize_module over a tp mesh of PyTorch's fake process group, whose collectives move
nothing), one forward and one backward of the example batch under FakeTensorMode, and the output's shapes
compared with the whole model's. Any failure, or any other shape, is a config error naming the module it
failed in, the plan's entries there, the error, and the plan tried. Every plan is rehearsed (the user's, a
user's model's own, a Hugging Face one, an inferred one) but a built-in model's own: the suite proves each of
those against single (tests/distributed/test_tensor_parallel.py, test_hybrid.py), and most of its tensor-parallel
runs use one, so rehearsing them would cost the suite time and prove nothing new.

Why DTensor on a fake process group, not a simulation of each style's local shapes (weights sliced by hand):
the rehearsal runs the code the workers run, so every style (sequence parallelism's layouts, Conv1D, an
Embedding's rows, LoRA's adapters) is rehearsed as it is and nothing about them is written twice; it costs
about 0.05 s on the test models (meta and fake tensors: no memory, no processes), on its own thread, so that
DTensor's per-thread caches keep none of its meshes (as the planner does, Note [planner]).

It proves shapes, not values: a plan that hands a rank the wrong heads of a fused projection with every shape
right passes here (check_heads refuses what it can see), and a weight left whole on a rank's piece of the
activations passes too (the first step compares those gradients, Note [weights left whole]). A model that
fake tensors cannot run whole (one that reads a value) is not rehearsed: its first step tells. Nor are the ops
fake tensors cannot run sharded (a shape that depends on values).
"""
from __future__ import annotations

import copy
import logging
import re

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from parallel.config import ConfigError, error_text
from parallel.tensors import faking, in_own_thread, meta_forward

_CANNOT_FAKE = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
_LAYER_NUMBER = re.compile(r"(?<![^.])[0-9]+(?![^.])")  # a whole part of a dotted name


def rehearse(model: nn.Module, plan: dict[str, str], tp: int, example: tuple, shard, what: str,
             hint: str = "") -> None:
    """A forward and a backward of `model` (on meta) sharded by `plan` over tp ranks, as rank 0 runs them, on fake
    tensors; their output shapes must be the whole model's (Note [plan rehearsal]).

    Args:
        model: the unpartitioned model on the meta device (left as it is: a copy is sharded).
        plan: module name -> style name, checked (parallel.strategies.tensor._check).
        tp: the tensor-parallel degree.
        example: the forward's positional inputs of one batch (meta tensors).
        shard: `shard(module, mesh, plan)`, the styles applied as the workers apply them.
        what: the start of the error: the key and value, and whose plan it is.
        hint: what replaces a plan the user did not give, after the plan tried.

    Raises:
        ConfigError: `what`, the module the sharded forward or backward failed in and the plan's entries there,
            the error, and the plan tried; or the output shapes that differ from the whole model's.
    """
    if dist.is_initialized():
        return  # a process in a run already (the workers'): its launcher rehearsed the plan
    try:
        whole = _shapes(meta_forward(model, *example))
    except Exception:  # noqa: BLE001 - a model fake tensors cannot run whole: its first step tells
        return
    found = in_own_thread("tp-rehearsal", _sharded_step, copy.deepcopy(model), plan, tp, example, shard)
    if found is None:
        return  # an op fake tensors cannot run sharded (a shape from values): the first step tells
    tried = f"[the plan tried: {_patterns(plan)}{'; ' + hint if hint else ''}]"
    name = type(model).__name__
    if isinstance(found, tuple):
        where, error = found
        raise ConfigError(f"{what}: a rank's {where} under tp {tp} fails ({error}): the layers there do not take "
                          f"the pieces the plan hands them; every layer between a colwise entry and its rowwise "
                          f"one must take a rank's slice of the features, as an activation or a SwiGLU's product "
                          f"of gate and up (both colwise) does (Note [plan rehearsal]) {tried}")
    if found != whole:
        raise ConfigError(f"{what}: a rank's forward of {name} under tp {tp} gives outputs of shapes "
                          f"{_listed(found)} where the whole model's are {_listed(whole)}: a layer's output left "
                          f"split reaches the output (give the last layer colwise_gather, or leave it whole) "
                          f"(Note [plan rehearsal]) {tried}")


def _sharded_step(model: nn.Module, plan: dict[str, str], tp: int, example: tuple, shard):
    """The output shapes of rank 0's forward and backward on the fake process group, or (where, error) where
    one failed."""
    # The fake backend registers itself on import; it lives in torch's testing package (heavy: only here).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    where = _Where(model, plan)  # before the styles' own hooks: a failing input layout is its module's
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it would log the failing op's traceback
    was, quiet.disabled = quiet.disabled, True
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        with faking():
            try:
                where.phase = "sharding"
                shard(model, mesh, plan)
                where.phase = "forward"
                outputs = [t for t in tree_flatten(model(*example))[0] if isinstance(t, torch.Tensor)]
                where.phase = "backward"
                grads = [(t.to_local() if isinstance(t, DTensor) else t).float().sum()
                         for t in outputs if t.requires_grad]
                if grads:
                    torch.stack(grads).sum().backward()
            except _CANNOT_FAKE:
                return None
            except Exception as e:  # noqa: BLE001 - any failure is the plan not fitting the forward
                return where.failed(e)
        return [tuple(t.shape) for t in outputs]
    finally:
        quiet.disabled = was
        where.remove()
        dist.destroy_process_group()


class _Where:
    """The module running when the sharded forward failed (the innermost one entered and not left)."""

    def __init__(self, model: nn.Module, plan: dict[str, str]):
        self.model, self.plan, self.phase, self.running = model, plan, "sharding", []
        self.names = {id(m): n for n, m in model.named_modules()}
        self.handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(self._enter),
                                                              m.register_forward_hook(self._leave))]

    def _enter(self, module, args):
        self.running.append(self.names.get(id(module), ""))

    def _leave(self, module, args, output):
        if self.running:
            self.running.pop()

    def failed(self, e: Exception) -> tuple[str, str]:
        text = error_text(e)
        text = text if len(text) <= 240 else text[:237] + "..."
        if self.phase == "backward" or not self.running or not self.running[-1]:
            return f"{self.phase} of {type(self.model).__name__}", text
        name = self.running[-1]
        module = self.model.get_submodule(name)
        held = [f"{n}:{s}" for n, s in self.plan.items() if n == name or n.startswith(name + ".")]
        there = f", which holds {', '.join(held)}" if held else ", which the plan leaves whole"
        return f"forward in {name} ({type(module).__name__}{there})", text

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _shapes(output) -> list[tuple]:
    return [tuple(t.shape) for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]


def _listed(shapes: list[tuple]) -> str:
    return ", ".join(str(s) for s in shapes) or "none"


def _patterns(plan: dict[str, str]) -> str:
    """The plan as entries with layer numbers as `*`, each once: `layers.*.w1:colwise, ...`."""
    entries = dict.fromkeys(f"{_LAYER_NUMBER.sub('*', n)}:{s}" for n, s in plan.items())
    return ", ".join(entries) or "no entries"
