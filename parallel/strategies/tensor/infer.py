"""A tensor-parallel plan inferred from the forward: Linears (and Hugging Face Conv1Ds) that feed the next one
through elementwise ops only become colwise -> rowwise pairs."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parallel.config import ConfigError
from parallel.strategies.tensor.styles import STYLES, is_linear
from parallel.tensors import meta_forward


class _Ops(TorchDispatchMode):
    """Records the aten ops run, between markers the Linear hooks drop in."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.events.append(("op", (func, inputs, outputs)))  # meta tensors: keeping them costs nothing
        return out


# Elementwise in effect although not tagged pointwise.
_ALSO_ELEMENTWISE = {"aten::native_dropout", "aten::dropout", "aten::clone", "aten::detach", "aten::_to_copy"}


def _elementwise(func) -> bool:
    return torch.Tag.pointwise in func.tags or func._schema.name in _ALSO_ELEMENTWISE


def infer_plan(model: nn.Module, example: tuple) -> dict[str, str]:
    """Pair Linears for tensor parallelism by running the forward once on meta tensors.

    A pair is a Linear (or Hugging Face Conv1D) A whose output goes, through elementwise ops only (an
    activation, dropout), straight into the next Linear called, B, with B's
    input width equal to A's output width; A becomes colwise and B rowwise, so
    each rank keeps its slice of A's features all the way to B. Linears called
    more than once per forward are left whole, as is every unpaired one.

    Raises:
        ConfigError: no pair was found (the model needs an explicit plan).
    """
    linears = {m: n for n, m in model.named_modules() if is_linear(m)}
    events: list = []
    shapes: dict[str, tuple] = {}

    def pre(mod, args):
        events.append(("start", (linears[mod], args[0])))
        shapes.setdefault(linears[mod] + ":in", tuple(args[0].shape))

    def post(mod, args, out):
        events.append(("end", (linears[mod], out)))
        shapes.setdefault(linears[mod] + ":out", tuple(out.shape))

    handles = [m.register_forward_pre_hook(pre) for m in linears] + [m.register_forward_hook(post) for m in linears]
    try:
        # As fake tensors (meta_forward): Hugging Face models read values of their inputs (masks).
        meta_forward(lambda: _recorded(model, example, events))
    except Exception as e:  # the model's own error, on meta tensors
        raise ConfigError(f"strategy.tp_plan=[]: could not run {type(model).__name__} to infer a plan "
                          f"({type(e).__name__}: {e}); give strategy.tp_plan") from None
    finally:
        for h in handles:
            h.remove()
    plan = _pairs(events, shapes)
    if not plan:
        raise ConfigError(
            f"strategy.tp_plan=[]: {type(model).__name__} has no tensor-parallel plan and none could be inferred "
            f"(no Linear feeds the next through elementwise ops only); give one, e.g. "
            f"strategy.tp_plan=[layers.*.up:colwise,layers.*.down:rowwise] (styles: {sorted(STYLES)})")
    return plan


def _recorded(model: nn.Module, example: tuple, events: list):
    with _Ops(events):
        return model(*example)


def _pairs(events: list, shapes: dict[str, tuple]) -> dict[str, str]:
    """colwise -> rowwise pairs from the recorded forward (see `infer_plan`)."""
    calls: dict[str, int] = {}
    for kind, what in events:
        if kind == "start":
            calls[what[0]] = calls.get(what[0], 0) + 1
    plan: dict[str, str] = {}
    # The Linear that ended last, and the tensors made from its output by
    # elementwise ops alone since then (None once anything else ran).
    last_end, derived = None, None
    for kind, what in events:
        if kind == "end":
            last_end, derived = what[0], {id(what[1])}
        elif kind == "op" and derived is not None:
            func, inputs, outputs = what
            if not outputs:
                continue  # a query that makes no tensor (prim.device on fake tensors) moves no data
            if _elementwise(func) and any(id(t) in derived for t in inputs):
                derived.update(id(t) for t in outputs)
            elif not _elementwise(func):
                derived = None
        elif kind == "start":
            a, (b, x) = last_end, what
            if (a is not None and derived is not None and id(x) in derived and a not in plan
                    and calls.get(a) == 1 and calls.get(b) == 1 and shapes[a + ":out"] == shapes[b + ":in"]):
                plan[a], plan[b] = "colwise", "rowwise"
            last_end, derived = None, None
    return plan
