"""A tensor-parallel plan inferred from the forward: Linears (and Hugging Face Conv1Ds) that feed the next one
through elementwise ops only become colwise, that one rowwise (a SwiGLU's gate and up, then its down)."""
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

    A pair is a set of Linears (or Hugging Face Conv1Ds) A whose outputs go, through elementwise ops only
    (an activation, dropout, a SwiGLU's product), into a Linear B, with B's input width equal to each A's
    output width; every A becomes colwise and B rowwise, so each rank keeps its slice of the features all
    the way to B (`_pairs`). Linears called more than once per forward are left whole, as is every
    unpaired one.

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
    """colwise -> rowwise pairs from the recorded forward (see `infer_plan`).

    Each tensor made by elementwise ops from Linears' outputs remembers those Linears (its origin): a SwiGLU's
    `silu(gate(x)) * up(x)` comes from gate and up, and feeding down makes gate and up colwise and down rowwise.
    A Linear whose output (or anything made from it) also reaches another kind of op, another Linear, or an
    elementwise op beside a tensor of its own (a residual, a mask) would hand that op a rank's slice of it:
    it stays whole, and so does its partner.
    """
    calls: dict[str, int] = {}
    for kind, what in events:
        if kind == "start":
            calls[what[0]] = calls.get(what[0], 0) + 1
    origin: dict[int, frozenset] = {}  # id of a tensor -> the Linears it was made from, elementwise
    escaped: set[str] = set()
    candidates: list[tuple[frozenset, str]] = []
    inside = False  # between a Linear's start and end: its own ops, which take its input as they must
    for kind, what in events:
        if kind == "end":
            origin[id(what[1])], inside = frozenset([what[0]]), False
        elif kind == "op" and not inside:
            _follow(what, origin, escaped)
        elif kind == "start":
            inside = True
            if id(what[1]) in origin:
                candidates.append((origin[id(what[1])], what[0]))
    feeds: dict[str, int] = {}
    for sources, _ in candidates:
        for a in sources:
            feeds[a] = feeds.get(a, 0) + 1
    plan: dict[str, str] = {}
    for sources, b in candidates:
        if (sources & escaped or b in plan or any(a in plan for a in sources) or calls.get(b) != 1
                or any(calls.get(a) != 1 or feeds[a] != 1 or shapes[a + ":out"] != shapes[b + ":in"]
                       for a in sources)):
            continue
        plan.update({a: "colwise" for a in sorted(sources)})
        plan[b] = "rowwise"
    return plan


def _follow(op: tuple, origin: dict[int, frozenset], escaped: set[str]) -> None:
    """One recorded op: its outputs' origin when it is elementwise over Linears' outputs (and scalars), else
    the Linears its inputs came from escape (`_pairs`)."""
    func, inputs, outputs = op
    if not outputs:
        return  # a query that makes no tensor (prim.device on fake tensors) moves no data
    tagged = [origin[id(t)] for t in inputs if id(t) in origin]
    if not tagged:
        return
    merged = frozenset().union(*tagged)
    others = [t for t in inputs if id(t) not in origin and t.numel() > 1]
    if _elementwise(func) and not others:
        for t in outputs:
            origin[id(t)] = merged
    else:
        escaped.update(merged)
