"""Tensor parallelism over a pipeline stage whose blocks run traced (a Hugging Face model's nested blocks).

# Note [tensor parallelism over traced blocks]
A pipeline stage of nested blocks keeps the blocks as traced (Note [own or traced blocks] in
parallel/strategies/pipeline/stages.py): export InterpreterModules, under the original names, each layer one
of them (`model.layers.0.self_attn.q_proj` a graph of `aten.linear(x, weight)`, its weight the traced
parameter). Two things stand between such a stage and the plan's styles, and `traced_layers` settles both
before `shard` applies the plan as it does to the model's own modules:

1. PyTorch's ColwiseParallel and RowwiseParallel shard nn.Linear and nn.Embedding only (our own styles Hugging
   Face's Conv1D and the locally connected layers), not a graph that computes the same. Each module the plan
   splits is one of those (checks.py), a leaf that its parent's graph calls with one tensor and that returns
   one: the model's own module takes that call as its forward does, so a copy of it stands in for the traced
   one, holding the traced parameters themselves (weights tied to others stay tied; the names are the same).
   Norms and whatever else the plan leaves whole, or gives `replicate_grads` (a hook on the module's
   parameters, Qwen3's q_norm and k_norm), stay traced; the first step's check of the weights left whole
   (Note [weights left whole] in whole.py) reads the stages as it reads a whole model.
2. The trace fixed every shape the model's code read at run time: Llama's `q.view(*input_shape, -1, head_dim)`
   is `view(q, [2, 16, -1, 8])` (already right on a rank's own heads), but its grouped-query attention's
   `repeat_kv` is `expand(k[:, :, None], [2, 2, 2, 16, 8])` then `reshape(.., [2, 4, 16, 8])`: the whole
   model's kv heads (2) and heads (4). On a rank of tp 2, with one kv head, the expand would broadcast it to
   two in silence and the reshape would make four heads of q's two. So each traced graph that holds a split
   layer (the attention and MLP modules, the blocks and the base model around them) reads those shapes at
   run time again, from the tensor it reshapes, as the model's code did: an expand keeps every dimension it
   did not broadcast (-1), and a view or reshape is cut into groups of dimensions whose sizes multiply out
   alike (input [2, 2, 2, 16, 8] to output [2, 4, 16, 8]: (2)->(2), (2, 2)->(4), (16)->(16), (8)->(8)), each
   group's outermost output dimension computed from the input's sizes at run time (the product of the
   group's input sizes over its other output sizes), the others kept. The outermost is the one a colwise
   split divides: a rank holds a contiguous range of the output features, which is a range of the outermost
   dimension of any split of them into whole pieces (whole heads: check_heads). A shape that is the whole
   model's comes out as it was, so a graph of unsplit values computes exactly what it did.

Rewriting the traced graphs, not tracing the model again with each rank's head counts: a retrace would need a
model built with local sizes (per architecture: heads, kv heads, an explicit head_dim, the MLP's width), whose
parameters would no longer be the model's under its names and initial values, and a trace per tp degree; the
graphs need only their shapes read as the code read them. What this does not reach (refused before the
workers start, check.py): sequence parallelism, whose norms and dropout see sequence shards where the traced
rotary embeddings and masks are the whole sequence's. An op other than these that fixed a head count (a fused
projection cut with constant sizes, a table of per-head values) fails at the first forward (or in the
planner, which builds the same stages on fake tensors) with its shapes: a rank's tensors are smaller than the
constants there. Without the rewrite, the test Llama fails so at its first attention (SDPA: 2 heads of q, 4
of k); with it, each rank's heads sum to the whole attention (tests/unit/test_tensor_traced.py) and the runs
train as the user's loop does (tests/distributed/test_hf_pipeline.py).
"""
from __future__ import annotations

import copy
import operator
from functools import reduce

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.export.unflatten import InterpreterModule

from parallel.config import ConfigError
from parallel.strategies.tensor.styles import SHARDS_INPUT, SHARDS_OUTPUT

SPLITS = (*SHARDS_OUTPUT, *SHARDS_INPUT, "positions")  # the styles that shard a module's weights
aten = torch.ops.aten
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def traced_layers(stage: nn.Module, model: nn.Module, plan: dict[str, str]) -> None:
    """Make a pipeline stage's traced modules ready for `plan`'s styles, in place (on meta; Note [tensor
    parallelism over traced blocks]): the layers the plan splits are copies of `model`'s own, holding the
    traced parameters, and the traced graphs around them read their shapes at run time. A stage of the model's
    own blocks has nothing traced to change."""
    held = dict(stage.named_modules())
    split = [n for n, style in plan.items() if style in SPLITS and isinstance(held.get(n), InterpreterModule)]
    for name in split:
        _own_layer(held, name, model.get_submodule(name))
    for prefix, sub in held.items():
        if isinstance(sub, InterpreterModule) and any(n.startswith(prefix + "." if prefix else "") for n in split):
            if any([_run_time_shapes(sub.graph, node) for node in list(sub.graph.nodes)]):
                sub.graph.lint()
                sub.__dict__["graph_module"].recompile()  # the generated code the stage runs (chain.compiled)


def _own_layer(held: dict[str, nn.Module], name: str, original: nn.Module) -> None:
    """Put a copy of the model's own `original` in place of the traced module `name`, with its parameters."""
    traced = held[name]
    parent_name, _, leaf = name.rpartition(".")
    parent = held[parent_name]
    calls = [n for n in parent.graph.nodes if n.op == "call_module" and n.target == leaf]
    params = dict(traced.named_parameters())
    with unset_fake_temporarily():  # the planner's fake mode would copy meta tensors as fake ones
        own = copy.deepcopy(original)
    if (any(original.children()) or set(params) != {n for n, _ in own.named_parameters()}
            or any(len(c.args) != 1 or c.kwargs for c in calls)):
        raise ConfigError(f"strategy.tp_plan[{name!r}]: a pipeline stage runs this {type(original).__name__} "
                          f"traced, not as a layer its style can split (Note [tensor parallelism over traced "
                          f"blocks] in parallel/strategies/tensor/traced.py); use strategy.pp=1 or leave it whole")
    for pname, p in params.items():
        own.register_parameter(pname, p)
    setattr(parent, leaf, own)
    held[name] = own


def _run_time_shapes(graph: fx.Graph, node: fx.Node) -> bool:
    """Rewrite one view, reshape or expand of `graph` to read its sizes at run time; whether it changed."""
    if node.op != "call_function" or len(node.args) < 2 or not isinstance(node.args[0], fx.Node):
        return False
    source, sizes = node.args[0], node.args[1]
    whole_in, whole_out = _shape(source), _shape(node)
    if (whole_in is None or whole_out is None or not isinstance(sizes, (list, tuple))
            or not all(isinstance(s, int) for s in sizes) or 0 in whole_in or 0 in whole_out):
        return False
    if node.target is aten.expand.default:
        lead = len(sizes) - len(whole_in)
        kept = [s if d < lead or whole_in[d - lead] != s else -1 for d, s in enumerate(sizes)]
        if kept == list(sizes):
            return False
        node.update_arg(1, kept)
        return True
    if node.target not in VIEWS:
        return False
    groups = _groups(whole_in, whole_out)
    if groups is None:
        return False
    new: list = list(whole_out)
    with graph.inserting_before(node):
        for ins, outs in groups:
            outer = next((j for j in outs if whole_out[j] != 1), None)
            if outer is None:
                continue
            sizes_in = [graph.call_function(aten.sym_size.int, (source, i)) for i in ins if whole_in[i] != 1]
            size = reduce(lambda x, y: graph.call_function(operator.mul, (x, y)), sizes_in)
            rest = reduce(operator.mul, [whole_out[j] for j in outs if j != outer], 1)
            new[outer] = size if rest == 1 else graph.call_function(operator.floordiv, (size, rest))
    node.update_arg(1, new)
    return True


def _shape(node) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not all(isinstance(s, int) for s in value.shape):
        return None
    return tuple(value.shape)


def _groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Dimensions of `a` and of `b` (sizes with the same product) in groups whose sizes multiply out alike,
    in order; dimensions of size 1 left at either end join their neighbour's group. None: none to be found."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ins, outs, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ins.append(i)
                pa, i = pa * a[i], i + 1
            elif pb < pa and j < len(b):
                outs.append(j)
                pb, j = pb * b[j], j + 1
            else:
                return None
        groups.append((ins, outs))
    if not groups or any(a[k] != 1 for k in range(i, len(a))) or any(b[k] != 1 for k in range(j, len(b))):
        return None
    groups[-1][0].extend(range(i, len(a)))
    groups[-1][1].extend(range(j, len(b)))
    return groups
