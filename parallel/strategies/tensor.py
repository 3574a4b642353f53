"""strategy=model: tensor (intra-layer) parallelism with DTensor's parallelize_module.

A plan maps module names to PyTorch ParallelStyles. Built-in models carry their
own (`tp_plan(tp)` on the model); a user's model takes one from
`strategy.tp_plan`: entries "pattern:style", the pattern matching module names
with `*` wildcards (e.g. `strategy.tp_plan=[layers.*.up:colwise,layers.*.down:rowwise]`).

Style names:
    colwise         ColwiseParallel: weight split by output features; input
                    replicated, output sharded on the last dimension.
    rowwise         RowwiseParallel: weight split by input features; input
                    sharded on the last dimension, output all-reduced (replicated).
    colwise_gather  ColwiseParallel whose output is gathered (replicated): for a
                    last layer whose full output the loss needs.
    sequence        SequenceParallel: norms and dropout on sequence shards.
    positions       PositionwiseParallel (parallel.layers): a locally connected
                    layer's output positions split over the ranks; input
                    replicated, output gathered (whole).
    replicate       leave the module whole on every rank.
Sequence parallelism (`strategy.sequence_parallel=true`) adds styles that move
activations between sequence shards (dimension 1) and whole tensors:
    seq_split       the module's input is cut into this rank's sequence shard.
    seq_gather      the module's input is gathered from sequence shards (all-gather).
    rowwise_seq     RowwiseParallel whose output is reduce-scattered into sequence shards.
    colwise_seq_gather  ColwiseParallel taking sequence shards, output gathered.
A colwise layer must feed a rowwise one through elementwise ops only (an
activation), so that each rank's shard of features stays its own.

Without a plan, one is inferred (`infer_plan`): Linears called one right after
the other, with only elementwise ops between them and matching widths, become
colwise -> rowwise pairs.
"""
from __future__ import annotations

import fnmatch
import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parallel.config import Config, ConfigError, StrategyConfig, fail
from parallel.data import example_input
from parallel.layers import LocallyConnected1d, LocallyConnected2d, PositionwiseParallel
from parallel.metrics import log
from parallel.runtime import Runtime

SEQ = Shard(1)  # activations are (batch, sequence, features)
STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
    "sequence": lambda: SequenceParallel(),
    "replicate": None,
    "positions": lambda: PositionwiseParallel(),
    "seq_split": lambda: PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(SEQ,),
                                            use_local_output=True),
    "seq_gather": lambda: PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),),
                                             use_local_output=True),
    "rowwise_seq": lambda: RowwiseParallel(output_layouts=SEQ),
    "colwise_seq_gather": lambda: ColwiseParallel(input_layouts=SEQ, output_layouts=Replicate()),
}
SHARDS_OUTPUT = ("colwise", "colwise_gather", "colwise_seq_gather")
SHARDS_INPUT = ("rowwise", "rowwise_seq")


def resolve_plan(model: nn.Module, cfg: Config, example: tuple = ()) -> dict[str, str]:
    """Module name -> style name, from strategy.tp_plan, the model's own plan, or inferred; checked.

    Args:
        model: the unpartitioned model on the meta device.
        cfg: the run config (strategy.tp, tp_plan, sequence_parallel).
        example: meta inputs of one batch, to infer a plan from the forward.

    Raises:
        ConfigError: unknown style, a pattern matching no module, a width that does
            not divide by tp, or a model without a plan.
    """
    tp, sp = cfg.strategy.tp, cfg.strategy.sequence_parallel
    if cfg.strategy.tp_plan:
        plan = _expand(model, _parse(cfg.strategy.tp_plan))
    elif hasattr(model, "tp_plan"):
        takes_sp = "sequence_parallel" in inspect.signature(model.tp_plan).parameters
        if sp and not takes_sp:
            raise ConfigError(f"strategy.sequence_parallel=true: {type(model).__name__} has no sequence-parallel "
                              f"plan (give strategy.tp_plan with the seq_* styles, or set it false)")
        try:
            plan = model.tp_plan(tp, sequence_parallel=sp) if takes_sp else model.tp_plan(tp)
        except ValueError as e:
            raise ConfigError(f"strategy.tp={tp}: {e}") from None
    else:
        if sp:
            raise ConfigError("strategy.sequence_parallel=true: an inferred plan has no sequence parallelism; "
                              "give strategy.tp_plan with the seq_* styles")
        plan = infer_plan(model, example)
    for name, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"strategy.tp_plan[{name!r}]={style!r}: unknown style (valid: {sorted(STYLES)})")
        _check_divisible(model.get_submodule(name), name, style, tp)
    return plan


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

    A pair is a Linear A whose output goes, through elementwise ops only (an
    activation, dropout), straight into the next Linear called, B, with B's
    input width equal to A's output width; A becomes colwise and B rowwise, so
    each rank keeps its slice of A's features all the way to B. Linears called
    more than once per forward are left whole, as is every unpaired one.

    Raises:
        ConfigError: no pair was found (the model needs an explicit plan).
    """
    linears = {m: n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
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
        with torch.no_grad(), _Ops(events):
            model(*example)
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


def _parse(entries: list[str]) -> dict[str, str]:
    """["pattern:style", ...] -> {pattern: style}."""
    plan = {}
    for entry in entries:
        pattern, sep, style = str(entry).rpartition(":")
        if not sep or not pattern:
            raise ConfigError(f"strategy.tp_plan entry {entry!r}: must be 'pattern:style', "
                              f"e.g. 'layers.*.up:colwise' (styles: {sorted(STYLES)})")
        plan[pattern.strip()] = style.strip()
    return plan


def _expand(model: nn.Module, patterns: dict[str, str]) -> dict[str, str]:
    names = [n for n, _ in model.named_modules() if n]
    plan: dict[str, str] = {}
    for pattern, style in patterns.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ConfigError(f"strategy.tp_plan[{pattern!r}]: the pattern matches no module "
                              f"(modules: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''})")
        for n in hits:
            plan[n] = style
    return plan


def _check_divisible(module: nn.Module, name: str, style: str, tp: int) -> None:
    if style == "positions":
        if not isinstance(module, (LocallyConnected1d, LocallyConnected2d)):
            raise ConfigError(f"strategy.tp_plan[{name!r}]={style!r}: positions shards LocallyConnected1d/2d, "
                              f"not {type(module).__name__}")
        positions = module.weight.shape[0]
        if positions % tp:
            raise ConfigError(f"strategy.tp={tp}: {name} has {positions} output positions, which do not divide "
                              f"by tp {tp} (positions)")
        return
    if style in SHARDS_OUTPUT + SHARDS_INPUT:
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ConfigError(f"strategy.tp_plan[{name!r}]={style!r}: {style} shards nn.Linear or nn.Embedding, "
                              f"not {type(module).__name__}")
        dim = 1 if style in SHARDS_INPUT else 0
        if isinstance(module, nn.Embedding):
            dim = 1 - dim  # an Embedding's weight is (rows, features): colwise splits features
        width = module.weight.shape[dim]
        if width % tp:
            what = "input" if style in SHARDS_INPUT else "output"
            raise ConfigError(f"strategy.tp={tp}: {name} has {width} {what} features, which do not divide "
                              f"by tp {tp} ({style})")


def tensor_plan(model: nn.Module, cfg: Config) -> dict[str, str]:
    """The checked plan for `model` (on meta); an inferred one is printed."""
    plan = resolve_plan(model, cfg, example_input(cfg.data))
    if not cfg.strategy.tp_plan and not hasattr(model, "tp_plan"):
        log.info("inferred tensor-parallel plan (set strategy.tp_plan to change it): %s",
                 ", ".join(f"{n}:{s}" for n, s in plan.items()))
    return plan


def shard(module: nn.Module, mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """Apply the plan's styles to `module` (on meta) over the mesh's `tp` dimension, in place.

    Names in the plan that `module` does not hold are skipped: a pipeline stage
    takes the entries for its own layers.
    """
    held = {n for n, _ in module.named_modules()}
    styles = {n: STYLES[s]() for n, s in plan.items() if STYLES[s] is not None and n in held}
    if styles:
        parallelize_module(module, mesh["tp"], styles)


def apply_tensor(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime) -> nn.Module:
    """Shard `model` (on meta) over the mesh's `tp` dimension by its plan, in place."""
    shard(model, mesh, tensor_plan(model, cfg))
    return model



def check_tensor_keys(s: StrategyConfig, allowed: bool) -> None:
    """tp_plan and sequence_parallel are set only where layers are split over tensor-parallel ranks."""
    rule = "strategy=model, or strategy=hybrid with strategy.tp > 1"
    if s.tp_plan and not allowed:
        fail("strategy.tp_plan", list(s.tp_plan), f"a tensor-parallel plan needs {rule}")
    if s.sequence_parallel and not allowed:
        fail("strategy.sequence_parallel", True,
             f"sequence parallelism shards between tensor-parallel layers: it needs {rule}")


def check_plan(model: nn.Module, cfg: Config) -> None:
    """The plan resolves against the model (on meta): styles known, patterns matched, widths divisible."""
    resolve_plan(model, cfg, example_input(cfg.data))
