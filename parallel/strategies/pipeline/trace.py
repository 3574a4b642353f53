"""The model's forward traced (on meta) and cut into stages before the named blocks.

# Note [tracing for the pipeline]
The split is traced with PyTorch's own `torch.distributed.pipelining.pipeline` (torch.export underneath):
values that skip stages, tied weights and parameter names come out right, and a Hugging Face model's
forward, with its masks, position ids and rotary embeddings, is one graph however it is written. Splitting
by module boundaries instead (running each stage's blocks with the arguments its first block was given)
would need every model's code between its blocks (embedding scale, mask building, rotary embeddings, final
norm, a head that slices the sequence) written again per architecture; the trace has it.

PyTorch's tracer fails on Hugging Face models with rotary embeddings (pytorch/pytorch#184361; seen here
on torch 2.13 with transformers 5.23): HF computes them under `torch.no_grad()`, which export records as
a `wrap_with_set_grad_enabled` higher-order op whose body is a submodule of the traced root, and the
per-stage module outlining (`_outline_submodules`) does not carry that submodule into the stage that
calls it (the outlined `rotary_emb` is called without its inputs: "Expected positional argument for
parameter unsqueeze_default"). Before the cut, each such region is inlined into the
graph (`_inline_grad_regions`, given to `pipeline` as its `split_policy`): its ops run where it was, and
each result of a region that had gradients off is detached, which gives the values and gradients the
region gave (`no_grad(f)(x)` is `f(x).detach()` for an `f` that changes nothing in place). Export also puts a check of
the input's dtype before each cast it records (`aten._assert_tensor_metadata`: Llama's norms cast to fp32 and
back): the dtypes of a trace on meta in the model's dtype, which a bf16 stage's autocast (Note [bf16 stages]
in stages.py) changes on purpose; the checks are dropped with the regions, the casts stay. The cuts are
marked by forward pre-hooks calling `pipe_split()` (what `split_spec` does by wrapping forwards, which
`pipeline` takes only without a `split_policy`).

Tracing on meta records `device='meta'` in the ops that make or move tensors (positions from
`torch.arange`, a buffer moved `.to(x.device)`), also inside the blocks; `retarget` points them at the
rank's device once a stage is built. A model may also choose an op's dtype by its tensors' device: Hugging
Face's grouped experts count the tokens per expert with `torch.histc` of the expert ids as integers, except
on the CPU, whose histc takes floating point only, where it counts them as floats; traced on meta, the
integer count is recorded, and `retarget` gives a CPU rank's histc its input as floats (the same counts:
the ids are small integers, exact in fp32), the op the model runs there.

The trace also records where the model's code converted a tensor (`x.to(torch.float32)` in a Hugging Face
RMSNorm) an `_assert_tensor_metadata` of the dtype it saw then, which the run's own casts may change: under
FSDP2's bf16 parameters (Note [mixed precision] in parallel/strategies/data.py) an embedding hands its norm a
bf16 tensor, and the assert stopped a bf16 run of a Hugging Face model under dp x pp ("Tensor dtype mismatch!
Expected: Float, Got: c10::BFloat16"). `retarget` removes those asserts (they compute nothing); the conversion
after each is kept as traced (to fp32), as autocast then casts the next matrix product's inputs anyway.

# Note [fused projections traced]
PyTorch's pipeline() finds each weight the trace reads by the model's `state_dict(keep_vars=True)` and moves
it into the stage that uses it. A module whose state-dict hooks save its weights under other names has them
missing there: torchtitan's fused attention (`fuse_qkv=true`, its debug model's default) saves its one
`wqkv` as the stock `wq`, `wk` and `wv` for checkpoints that the unfused model reads. The weight is then left
as an input of its stage that nothing feeds (`forward() missing 1 required positional argument: 'live_0'`
when the stage ran). The copy that is traced has its state-dict hooks removed: the stages hold `wqkv` by its
own name, as the parameters every strategy keeps; how the user's model saves itself is no part of its
forward. (tests/user_model.py `titan_llama`; torch 2.13.)
"""
from __future__ import annotations

import copy
import operator
import warnings

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.pipelining import pipe_split, pipeline
from torch.export.unflatten import InterpreterModule

from parallel.config import ConfigError

GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled
DTYPE_CHECK = torch.ops.aten._assert_tensor_metadata.default

# Tracing copies torch's own pytree specs (so does copying a traced stage,
# stages.py), whose deprecated LeafSpec check warns once per process from
# inside torch; nothing to act on here.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def trace(model: nn.Module, example: tuple, starts: list[str]):
    """Trace `model` (on meta) on one microbatch's inputs `example` (split.example_microbatch, taken as `by_name`
    says) and cut it before each name in `starts[1:]` (Note [tracing for the pipeline]).

    Tracing rearranges the module it is given (tied weights above all), so it
    works on a copy: the model can be traced again, with other cuts.
    """
    with unset_fake_temporarily():  # under the planner's fake mode a meta buffer would copy as a fake tensor
        model = copy.deepcopy(model)
    for module in model.modules():  # the copy's own names for its weights (Note [fused projections traced])
        module._state_dict_hooks.clear()
        module._state_dict_pre_hooks.clear()
    for name in starts[1:]:
        model.get_submodule(name).register_forward_pre_hook(lambda *_: pipe_split())
    try:
        args, named = by_name(example)
        return pipeline(model, mb_args=args, mb_kwargs=named, split_policy=_inline_grad_regions)
    except Exception as e:  # torch.export raises many types; all mean "cannot trace"
        raise untraceable(model, e) from None


def by_name(example: tuple) -> tuple[tuple, dict]:
    """How the model's forward takes split.example_microbatch's inputs: by position, except the positions under
    context parallelism (its only second input), which go by name, `position_ids` (the built-in gpt's second
    argument; a Hugging Face model's second is its attention mask). The traced first stage takes both by
    position, in that order, as the engine hands them."""
    return (example[:1], {"position_ids": example[1]}) if len(example) == 2 else (example, {})


def untraceable(model: nn.Module, e: Exception) -> ConfigError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return ConfigError(
        f"strategy=pipeline: the forward of {type(model).__name__} cannot be traced into stages "
        f"({type(e).__name__}: {first}). Pipelining needs a forward without data-dependent Python "
        "control flow that takes and returns tensors; rewrite that part (e.g. torch.where instead of "
        "`if` on a tensor's value), or use strategy=data.")


def _inline_grad_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every `wrap_with_set_grad_enabled` region of `gm` by its ops, and drop the dtype checks export
    put before each cast (see the Note)."""
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is DTYPE_CHECK]:
        gm.graph.erase_node(node)
    while True:
        region = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target is GRAD_REGION), None)
        if region is None:
            break
        _inline(gm, region)
    gm.graph.lint()
    gm.recompile()
    return gm


def _inline(gm: fx.GraphModule, region: fx.Node) -> None:
    enabled, body_ref, *args = region.args
    body = getattr(gm, body_ref.target)
    g = gm.graph
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, args))
    results = []
    with g.inserting_before(region):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = list(fx.node.map_arg(node.args[0], lambda n: env[n]))
                break
            if node.op == "get_attr":  # a region nested in this one: its body moves up with it
                name = _free_name(gm, node.target)
                setattr(gm, name, getattr(body, node.target))
                env[node] = g.get_attr(name)
            else:
                env[node] = g.node_copy(node, lambda n: env[n])
            env[node].meta.setdefault("nn_module_stack", region.meta.get("nn_module_stack", {}))
        if not enabled:  # computed without gradients: detached, so nothing flows back through it
            results = [g.call_function(torch.ops.aten.detach.default, (r,)) if isinstance(r, fx.Node) else r
                       for r in results]
            for r in results:
                r.meta["nn_module_stack"] = region.meta.get("nn_module_stack", {})
    for user in list(region.users):
        assert user.target is operator.getitem  # noqa: S101 - a region returns a tuple, read item by item
        user.replace_all_uses_with(results[user.args[1]])
        g.erase_node(user)
    g.erase_node(region)
    if not body_ref.users:
        g.erase_node(body_ref)
        delattr(gm, body_ref.target)


def _free_name(gm: nn.Module, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def retarget(module: nn.Module, device) -> None:
    """Point the ops of every traced graph in `module` that name the meta device at `device`, and drop its
    dtype asserts (see the Note).

    The device is an argument by name (`torch.arange(..., device=)`) or by position (`aten.to.device`).
    """
    for sub in module.modules():
        if not isinstance(sub, (fx.GraphModule, InterpreterModule)):
            continue
        changed = False
        for node in list(sub.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
                sub.graph.erase_node(node)  # the trace's dtype, which a run's casts may change (see the Note)
                changed = True
                continue
            changed |= _histc_as_floats(sub.graph, node, device)
            if _is_meta(node.kwargs.get("device")):
                node.update_kwarg("device", device)
                changed = True
            for i, arg in enumerate(node.args):
                if isinstance(arg, torch.device) and _is_meta(arg):
                    node.update_arg(i, torch.device(device))
                    changed = True
        # An InterpreterModule runs its graph, or the code generated from it (chain.compiled): both see the change.
        code = sub if isinstance(sub, fx.GraphModule) else sub.__dict__.get("graph_module")
        if changed and code is not None:
            code.recompile()


def _histc_as_floats(graph: fx.Graph, node: fx.Node, device) -> bool:
    """A histc of integers traced on meta, on a CPU rank: its input converted to fp32 first (see the Note)."""
    source = node.args[0] if node.target is torch.ops.aten.histc.default else None
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    if value is None or value.is_floating_point() or torch.device(device).type != "cpu":
        return False
    with graph.inserting_before(node):
        floats = graph.call_function(torch.ops.aten.to.dtype, (source, torch.float32))
    floats.meta.update(source.meta, val=value.float())
    node.update_arg(0, floats)
    return True


def _is_meta(device) -> bool:
    return device is not None and str(device) == "meta"
