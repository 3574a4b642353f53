"""strategy=model: tensor (intra-layer) parallelism with DTensor's parallelize_module.

A plan maps module names to PyTorch ParallelStyles. It comes from, in this order:
  1. `strategy.tp_plan`: entries "pattern:style", the pattern matching module names
     with `*` wildcards (e.g. `strategy.tp_plan=[layers.*.up:colwise,layers.*.down:rowwise]`);
  2. the model's own: a built-in model's `tp_plan(tp)` method, or the plan a Hugging
     Face model carries (`_tp_plan` / its config's `base_model_tp_plan`), its style
     names turned into these (Note [Hugging Face tensor-parallel plans], parallel/models/hf.py);
  3. inferred from the forward (`infer_plan`): Linears (or Hugging Face Conv1Ds) whose
     outputs reach the next Linear through elementwise ops only, with matching widths,
     become colwise and that one rowwise (SwiGLU's gate and up -> down);
  4. else a ConfigError asks for strategy.tp_plan.

Style names (parallel.strategies.tensor.styles):
    colwise         ColwiseParallel: weight split by output features; input
                    replicated, output sharded on the last dimension.
    rowwise         RowwiseParallel: weight split by input features; input
                    sharded on the last dimension, output all-reduced (replicated).
                    On an nn.Embedding: its rows (the vocabulary) split, token ids whole.
    colwise_gather  ColwiseParallel whose output is gathered (replicated): for a
                    last layer whose full output the loss needs.
    rowwise_split   RowwiseParallel taking a whole (replicated) input, which each rank cuts.
    sequence        SequenceParallel: norms and dropout on sequence shards.
    positions       PositionwiseParallel (parallel.models.layers): a locally connected
                    layer's output positions split over the ranks; input
                    replicated, output gathered (whole).
    replicate       leave the module whole on every rank.
    replicate_grads the module whole on every rank, its gradients summed over them (Hugging Face's
                    replicated_with_grad_allreduce: a norm applied to each rank's own heads).
Sequence parallelism (`strategy.sequence_parallel=true`) adds styles that move
activations between sequence shards (dimension 1) and whole tensors:
    seq_split       the module's input is cut into this rank's sequence shard.
    seq_gather      the module's input is gathered from sequence shards (all-gather).
    rowwise_seq     RowwiseParallel whose output is reduce-scattered into sequence shards.
    colwise_seq_gather  ColwiseParallel taking sequence shards, output gathered.
A built-in model's `tp_plan(tp, sequence_parallel=True)` places them itself; a Hugging Face model's own plan
gets them from its structure (Note [sequence parallelism for a model's own plan] in sequence.py).
A colwise layer must feed a rowwise one through elementwise ops only (an
activation), so that each rank's shard of features stays its own; inside an
attention module, each rank's shard must be whole heads (checks.check_heads).
Hugging Face's Conv1D (GPT-2) takes colwise, colwise_gather, rowwise and
rowwise_split with its transposed weight split accordingly (Note [Conv1D] in styles).
"""
from __future__ import annotations

import fnmatch
import inspect
from typing import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from parallel.config import Config, ConfigError, StrategyConfig, fail
from parallel.data import example_input
from parallel.loss import TASK_LOSSES
from parallel.metrics import log
from parallel.models.hf import hf_tp_plan
from parallel.models.lora import adapter_plan
from parallel.runtime import Runtime
from parallel.strategies.tensor.checks import check_heads, check_module, check_ties
from parallel.strategies.tensor.infer import infer_plan
from parallel.strategies.tensor.rehearse import rehearse
from parallel.strategies.tensor.sequence import with_loss_parallel, with_sequence_parallel
from parallel.strategies.tensor.styles import STYLES, make_style
from parallel.strategies.tensor.traced import traced_layers
from parallel.tensors import as_call

__all__ = ["STYLES", "apply_tensor", "check_loss_parallel", "check_plan", "check_tensor_keys", "infer_plan",
           "resolve_plan", "shard", "tensor_plan"]


def resolve_plan(model: nn.Module, tp: int, entries: Sequence[str] = (), sequence_parallel: bool = False,
                 example: tuple = (), loss_parallel: bool = False) -> dict[str, str]:
    """Module name -> style name, from strategy.tp_plan, the model's own plan, or inferred; checked.

    Args:
        model: the unpartitioned model on the meta device.
        tp: the tensor-parallel degree (strategy.tp).
        entries: strategy.tp_plan's "pattern:style" entries; empty: the model's own plan, or one inferred.
        sequence_parallel: strategy.sequence_parallel (a plan with the seq_* styles).
        example: meta inputs of one batch (positional), to infer a plan from the forward.
        loss_parallel: strategy.loss_parallel (the head's logits left split: Note [loss parallelism]).

    Raises:
        ConfigError: unknown style, a pattern matching no module, a style on a module it cannot shard, a
            width or a head count that does not divide by tp, tied weights split differently, or a model
            without a plan.
    """
    return _resolve(model, tp, entries, sequence_parallel, example, loss_parallel)[0]


def _resolve(model: nn.Module, tp: int, entries: Sequence[str], sp: bool, example: tuple, lp: bool = False) \
        -> tuple[dict[str, str], str]:
    """(the checked plan, where it came from: "config", "model", "hugging face" or "inferred")."""
    if entries:
        plan, source = _expand(model, _parse(entries)), "config"
    elif callable(getattr(model, "tp_plan", None)):  # a built-in model's method
        plan, source = _method_plan(model, tp, sp), "model"
    elif (hf := hf_tp_plan(model)) is not None:
        plan, source = _expand(model, hf, strict=False), "hugging face"
        if sp:  # Note [sequence parallelism for a model's own plan]
            plan = with_sequence_parallel(model, plan, _seq_len(example), tp)
    else:
        if sp:
            raise ConfigError("strategy.sequence_parallel=true: an inferred plan has no sequence parallelism; "
                              "give strategy.tp_plan with the seq_* styles")
        plan, source = infer_plan(model, example), "inferred"
    if lp:  # Note [loss parallelism] in sequence.py
        plan = with_loss_parallel(model, plan)
    plan = adapter_plan(model, plan)  # LoRA layers: the base layer split, the adapter beside it (Note [LoRA])
    try:
        _check(model, plan, tp)
    except ConfigError as e:
        if source not in ("hugging face", "inferred"):
            raise
        whose = "inferred" if source == "inferred" else f"{type(model).__name__}'s own (Hugging Face) plan"
        raise ConfigError(f"{e} [the plan checked: {whose}; strategy.tp_plan=[pattern:style,...] replaces it]") \
            from None
    return plan, source


def _seq_len(example: tuple) -> int | None:
    """The sequence length of a batch's main input (batch, sequence, ...), or None without one."""
    x = example[0] if example else None
    return x.shape[1] if getattr(x, "ndim", 0) >= 2 else None


def _check(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    for name, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"strategy.tp_plan[{name!r}]={style!r}: unknown style (valid: {sorted(STYLES)})")
    check_heads(model, plan, tp)  # before widths: a head count names the config key to change
    for name, style in plan.items():
        check_module(model.get_submodule(name), name, style, tp)
    check_ties(model, plan)


def _method_plan(model: nn.Module, tp: int, sp: bool) -> dict[str, str]:
    """The plan of a model's own `tp_plan(tp[, sequence_parallel])` method (the built-in models)."""
    takes_sp = "sequence_parallel" in inspect.signature(model.tp_plan).parameters
    if sp and not takes_sp:
        raise ConfigError(f"strategy.sequence_parallel=true: {type(model).__name__} has no sequence-parallel "
                          f"plan (give strategy.tp_plan with the seq_* styles, or set it false)")
    try:
        return model.tp_plan(tp, sequence_parallel=sp) if takes_sp else model.tp_plan(tp)
    except ValueError as e:
        raise ConfigError(f"strategy.tp={tp}: {e}") from None


def _parse(entries: Sequence[str]) -> dict[str, str]:
    """["pattern:style", ...] -> {pattern: style}."""
    plan = {}
    for entry in entries:
        pattern, sep, style = str(entry).rpartition(":")
        if not sep or not pattern:
            raise ConfigError(f"strategy.tp_plan entry {entry!r}: must be 'pattern:style', "
                              f"e.g. 'layers.*.up:colwise' (styles: {sorted(STYLES)})")
        plan[pattern.strip()] = style.strip()
    return plan


def _expand(model: nn.Module, patterns: dict[str, str], strict: bool = True) -> dict[str, str]:
    """{pattern: style} -> {module name: style}; a later pattern wins. `strict`: a pattern matching no
    module is an error (the user's; a Hugging Face plan may name modules a configuration leaves out)."""
    names = [n for n, _ in model.named_modules() if n]
    plan: dict[str, str] = {}
    for pattern, style in patterns.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits and strict:
            raise ConfigError(f"strategy.tp_plan[{pattern!r}]: the pattern matches no module "
                              f"(modules: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''})")
        for n in hits:
            plan[n] = style
    return plan


def tensor_plan(model: nn.Module, tp: int, entries: Sequence[str], sequence_parallel: bool,
                example: tuple, loss_parallel: bool = False) -> dict[str, str]:
    """The checked plan for `model` (on meta; the arguments as `resolve_plan`'s); an inferred or a Hugging Face
    one is printed."""
    plan, source = _resolve(model, tp, entries, sequence_parallel, example, loss_parallel)
    if source in ("inferred", "hugging face"):
        what = "inferred" if source == "inferred" else f"{type(model).__name__}'s own (Hugging Face)"
        log.info("%s tensor-parallel plan (set strategy.tp_plan to change it): %s", what,
                 ", ".join(f"{n}:{s}" for n, s in plan.items()))
    return plan


def shard(module: nn.Module, mesh: DeviceMesh, plan: dict[str, str], model: nn.Module | None = None) -> None:
    """Apply the plan's styles to `module` (on meta) over the mesh's `tp` dimension, in place.

    Names in the plan that `module` does not hold are skipped: a pipeline stage
    takes the entries for its own layers. A weight tied between modules (which
    the plan check made sure are split alike) is one parameter again afterwards:
    each style replaces its module's parameters with DTensors of its own.
    `model`: the unpartitioned model, for a pipeline stage whose blocks run traced (Note [tensor parallelism
    over traced blocks] in traced.py).
    """
    if model is not None:
        traced_layers(module, model, plan)
    held = dict(module.named_modules())
    styles = {n: make_style(s, held[n]) for n, s in plan.items() if n in held}
    styles = {n: style for n, style in styles.items() if style is not None}
    if not styles:
        return
    tied = _tied(module)
    parallelize_module(module, mesh["tp"], styles)
    for places in tied:
        (first, name), rest = places[0], places[1:]
        for mod, attr in rest:
            mod.register_parameter(attr, getattr(first, name))


def _tied(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of each parameter held in more than one place."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((mod, attr))
    return [v for v in places.values() if len(v) > 1]


def apply_tensor(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime) -> nn.Module:
    """strategy=model: shard `model` (on meta) over the mesh's `tp` dimension by its plan, in place."""
    s, example = cfg.strategy, as_call(example_input(cfg.data, spec=runtime.data))[0]
    shard(model, mesh, tensor_plan(model, s.tp, s.tp_plan, s.sequence_parallel, example, s.loss_parallel))
    return model


def check_tensor_keys(s: StrategyConfig, allowed: bool) -> None:
    """tp_plan and sequence_parallel are set only where layers are split over tensor-parallel ranks."""
    rule = "strategy=model, or strategy=hybrid with strategy.tp > 1"
    if s.tp_plan and not allowed:
        fail("strategy.tp_plan", list(s.tp_plan), f"a tensor-parallel plan needs {rule}")
    if s.sequence_parallel and not allowed:
        fail("strategy.sequence_parallel", True,
             f"sequence parallelism shards between tensor-parallel layers: it needs {rule}")
    if s.loss_parallel and not allowed:
        fail("strategy.loss_parallel", True, f"loss parallelism splits the logits over tensor-parallel ranks: it "
             f"needs {rule}")


def check_loss_parallel(cfg: Config) -> None:
    """strategy.loss_parallel=true needs the built-in cross-entropy without label smoothing and no pipeline
    (Note [loss parallelism] in parallel/strategies/tensor/sequence.py)."""
    s, c = cfg.strategy, cfg.loss
    if not s.loss_parallel:
        return
    name = c.name or TASK_LOSSES.get(cfg.data.task, "mse")
    if c._target_ or name != "cross_entropy":
        fail("strategy.loss_parallel", True, f"computes the built-in cross-entropy on logits split by the "
             f"vocabulary; this run's loss is {c._target_ or 'loss.name=' + name}",
             ["loss.name=cross_entropy (data.task=lm's and classification's default)", "strategy.loss_parallel=false"])
    if c.args.get("label_smoothing"):
        fail("strategy.loss_parallel", True, "PyTorch's loss parallelism has no label smoothing "
             f"(loss.args.label_smoothing={c.args['label_smoothing']})", "strategy.loss_parallel=false")
    if s.pp is not None and s.pp > 1:
        fail("strategy.loss_parallel", True, f"a pipeline's last stage computes the loss inside its schedule "
             f"(strategy.pp={s.pp}); loss parallelism runs without one", "strategy.loss_parallel=false")


def check_plan(model: nn.Module, cfg: Config, data=None) -> None:
    """The plan resolves against the model (on meta): styles known, patterns matched, widths and head counts
    divisible, tied weights split alike; and a rank's forward and backward under it, rehearsed on fake tensors,
    give the whole model's output shapes (Note [plan rehearsal] in parallel/strategies/tensor/rehearse.py).
    `data`: what was read from the data (parallel.data.spec.DataSpec)."""
    s, example = cfg.strategy, as_call(example_input(cfg.data, spec=data))[0]
    plan, source = _resolve(model, s.tp, s.tp_plan, s.sequence_parallel, example, s.loss_parallel)
    if source == "model" and type(model).__module__.startswith("parallel."):
        return  # a built-in model's own plan, proven against single by the suite (Note [plan rehearsal])
    name = type(model).__name__
    if source == "config":
        what, hint = f"strategy.tp_plan={list(s.tp_plan)!r}", ""
    else:
        whose = {"inferred": f"the plan inferred for {name}", "model": f"{name}'s own plan",
                 "hugging face": f"{name}'s own (Hugging Face) plan"}[source]
        what, hint = f"strategy.tp={s.tp}: {whose}", "strategy.tp_plan=[pattern:style,...] replaces it"
    rehearse(model, plan, s.tp, example, shard, what, hint)
