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
    replicate       leave the module whole on every rank.
A colwise layer must feed a rowwise one through elementwise ops only (an
activation), so that each rank's shard of features stays its own.
"""
from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from parallel.config import Config, ConfigError

STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
    "sequence": lambda: SequenceParallel(),
    "replicate": None,
}


def resolve_plan(model: nn.Module, cfg: Config) -> dict[str, str]:
    """Module name -> style name, from strategy.tp_plan or the model's own plan; checked.

    Raises:
        ConfigError: unknown style, a pattern matching no module, a width that does
            not divide by tp, or a model without a plan.
    """
    tp = cfg.strategy.tp
    if cfg.strategy.tp_plan:
        plan = _expand(model, _parse(cfg.strategy.tp_plan))
    elif hasattr(model, "tp_plan"):
        try:
            plan = model.tp_plan(tp)
        except ValueError as e:
            raise ConfigError(f"strategy.tp={tp}: {e}") from None
    else:
        raise ConfigError(
            f"strategy.tp_plan=[]: {type(model).__name__} has no tensor-parallel plan; give one, e.g. "
            f"strategy.tp_plan=[layers.*.up:colwise,layers.*.down:rowwise] (styles: {sorted(STYLES)})")
    for name, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"strategy.tp_plan[{name!r}]={style!r}: unknown style (valid: {sorted(STYLES)})")
        _check_divisible(model.get_submodule(name), name, style, tp)
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
    if style in ("colwise", "colwise_gather", "rowwise"):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ConfigError(f"strategy.tp_plan[{name!r}]={style!r}: {style} shards nn.Linear or nn.Embedding, "
                              f"not {type(module).__name__}")
        width = module.weight.shape[0 if style != "rowwise" else 1]
        if width % tp:
            what = "output" if style != "rowwise" else "input"
            raise ConfigError(f"strategy.tp={tp}: {name} has {width} {what} features, which do not divide "
                              f"by tp {tp} ({style})")


def apply_tensor(model: nn.Module, mesh: DeviceMesh, cfg: Config) -> nn.Module:
    """Shard `model` (on meta) over the mesh's `tp` dimension by its plan, in place."""
    plan = resolve_plan(model, cfg)
    styles = {name: STYLES[style]() for name, style in plan.items() if STYLES[style] is not None}
    parallelize_module(model, mesh["tp"], styles)
    return model

