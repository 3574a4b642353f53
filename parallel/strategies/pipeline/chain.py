"""Turn a traced pipeline split into a chain: stage i feeds stage i+1 and nothing else.

# Note [stage chain]
torch.distributed.pipelining.pipeline() traces the forward and cuts it into
stage submodules (fx GraphModules); a value that skips a stage (a residual from
stage 0 used by stage 2) goes straight to its consumer. The stage objects built
from that trace (`build_stage`) warm up their links by sending to every
neighbour, which gloo cannot do when two stages share a rank, as V-shaped
schedules (ZBV, DualPipeV) arrange. PyTorch's plain `PipelineStage` has no such
limit but hands exactly one stage's outputs to the next. So each stage's graph
is rewritten to take every value still needed downstream and to return the
same for its successor, carrying skipped values through; every schedule then
uses `PipelineStage`. The stage modules are the traced ones, so parameter names
are the original model's. A carried value costs one extra send per stage it crosses.
"""
from __future__ import annotations

import operator

import torch
from torch import fx, nn
from torch.export.unflatten import InterpreterModule
from torch.utils._pytree import tree_map_only

Value = tuple  # (name of the producing node in the split graph, output index or None)


def _value(arg: fx.Node) -> Value:
    if arg.op == "call_function" and arg.target is operator.getitem:
        return (arg.args[0].name, arg.args[1])
    return (arg.name, None)


def chain(pipe) -> list[fx.GraphModule]:
    """Rewrite every stage of `pipe` (a torch.distributed.pipelining Pipe) in place; return them in order.

    Raises:
        ValueError: when the model's output is not one tensor made by the last stage.
    """
    placeholders, calls, out = [], [], None
    for node in pipe.split_gm.graph.nodes:
        if node.op == "placeholder":
            placeholders.append((node.name, None))
        elif node.op == "call_module":
            calls.append(node)
        elif node.op == "output":
            out = node
    result = out.args[0]
    outputs = [_value(a) for a in (result if isinstance(result, (tuple, list)) else [result])]
    if len(outputs) != 1:
        raise ValueError(f"the model must return one tensor (its logits), not {len(outputs)}; a Hugging Face "
                         "model returns hidden states and attentions too when its config asks for them "
                         "(output_hidden_states, output_attentions): set them false")
    if outputs[0][0] != calls[-1].name:
        raise ValueError("the model must return one tensor, computed in its last stage")
    takes = [[_value(a) for a in node.args] for node in calls]
    stages, live = [], list(placeholders)
    for i, node in enumerate(calls):
        later = takes[i + 1:] + ([outputs] if i == len(calls) - 1 else [])
        needed = [v for t in later for v in t]
        live_out = [v for v in live if v in needed]
        live_out += [v for v in dict.fromkeys(needed) if v[0] == node.name and v not in live_out]
        gm = pipe.split_gm.get_submodule(node.target)
        _rewrite(gm, live, takes[i], node.name, live_out)
        stages.append(gm)
        live = live_out
    return stages


def _rewrite(gm: fx.GraphModule, live_in: list[Value], takes: list[Value], name: str,
             live_out: list[Value]) -> None:
    """Make `gm` take `live_in` and return `live_out` (a bare value when there is one)."""
    g = gm.graph
    old = [n for n in g.nodes if n.op == "placeholder"]
    if len(old) > len(takes):  # what the trace left as an input of the stage that no call feeds
        unfed = ", ".join(n.name for n in old[len(takes):])
        raise ValueError(f"the traced stage {name} reads {unfed}, which nothing before it makes: a weight or buffer "
                         f"that the model's state_dict does not list under its own name (Note [fused projections "
                         f"traced] in parallel/strategies/pipeline/trace.py)")
    first = next(n for n in g.nodes if n.op != "placeholder")
    env: dict[Value, fx.Node] = {}
    with g.inserting_before(first):
        for i, v in enumerate(live_in):
            env[v] = g.placeholder(f"live_{i}")
    for ph, v in zip(old, takes):
        ph.replace_all_uses_with(env[v])
        g.erase_node(ph)
    out = next(n for n in g.nodes if n.op == "output")
    produced = out.args[0]
    if isinstance(produced, (tuple, list)):
        for i, p in enumerate(produced):
            env[(name, i)] = p
    else:
        env[(name, None)] = produced
    # Sent as they are, and a send needs contiguous memory: an attention mask is often an expanded view.
    with g.inserting_before(out):
        values = [g.call_method("contiguous", (env[v],)) for v in live_out]
    out.args = (values[0] if len(values) == 1 else tuple(values),)
    # The traced graph flattens its inputs by the original signature; the
    # rewritten one takes the live values as plain positional arguments.
    g.set_codegen(fx.graph.CodeGen())
    g.lint()
    gm.recompile()


def stage_shapes(stages: list[nn.Module], example: tuple, wire: torch.dtype | None = None) -> list[tuple[tuple, tuple]]:
    """(inputs, outputs) of every stage of a chain for one microbatch, as meta tensors.

    In a chain each stage's outputs are exactly the next one's inputs, so one
    pass over the example finds every boundary. With `wire` (bf16 under trainer.precision=bf16) the
    floating-point values crossing a boundary are shaped in it, and each stage runs on them as it will run on
    what it receives (Note [bf16 stages] in stages.py); the last stage's outputs, which go to the loss, are kept.
    """
    shapes, values = [], tuple(example)
    with torch.no_grad():
        for i, gm in enumerate(stages):  # still on the meta device: nothing is computed
            out = gm(*(values if i == 0 or wire is None else received(values)))
            out = out if isinstance(out, tuple) else (out,)
            if wire is not None and i < len(stages) - 1:
                out = on_the_wire(out, wire)
            shapes.append((values, out))
            values = out
    return shapes


def on_the_wire(values, wire: torch.dtype):
    """`values` (a tensor or a tuple of them) as a stage hands them on: floating-point tensors in `wire`
    (Note [bf16 stages] in stages.py), boolean ones (masks) as they are."""
    return tree_map_only(torch.Tensor, lambda t: t.to(wire) if t.is_floating_point() else t, values)


def received(values):
    """What a stage computes on from the bf16 values it receives: fp32 copies, the dtype of a residual stream in
    the unsplit model under autocast (Note [bf16 stages] in stages.py); anything else as it is."""
    return tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype == torch.bfloat16 else t, values)


def compiled(stage: nn.Module) -> None:
    """Run the traced blocks inside a stage as generated Python code, not through fx.Interpreter.

    The split keeps each block as an export InterpreterModule, whose forward
    interprets its graph node by node: a per-op Python cost in every forward of
    every microbatch. Each is already finalized with a generated GraphModule;
    its (private) `_run_with_interpreter` switch selects that code instead.
    """
    for module in stage.modules():
        if isinstance(module, InterpreterModule) and module.__dict__.get("graph_module") is not None:
            _rename_self(module)
            module._run_with_interpreter = False


def _rename_self(module: InterpreterModule) -> None:
    """Give a value named `self` another name: the generated code's own `self` would be shadowed by it.

    The trace names a submodule call's result after the submodule, and BERT's attention has one called
    `self` (BertAttention.self); the interpreter keys values by node and never minds.
    """
    g = module.graph
    for node in [n for n in g.nodes if n.name == "self"]:
        with g.inserting_after(node):
            renamed = g.create_node(node.op, node.target, node.args, node.kwargs, name="self_out")
        renamed.meta = dict(node.meta)
        node.replace_all_uses_with(renamed)
        g.erase_node(node)
        module.graph_module.recompile()


def used_names(stage: nn.Module, ops: tuple[str, ...] = ("call_module", "get_attr")) -> set[str]:
    """Full names of the modules (and attributes) that the graphs of a traced stage call (read).

    A Hugging Face model's blocks sit inside outlined modules (`model.layers.1`
    is called by the graph of `model`), so every graph in the stage is read.
    """
    used = set()
    for prefix, sub in stage.named_modules():
        if isinstance(sub, (fx.GraphModule, InterpreterModule)):
            used |= {f"{prefix}.{n.target}" if prefix else n.target for n in sub.graph.nodes if n.op in ops}
    return used
