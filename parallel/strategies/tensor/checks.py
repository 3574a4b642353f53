"""Checks of a resolved tensor-parallel plan against the model (on meta), run before any worker starts:
each style fits its module, widths divide by tp, attention projections split into whole heads, and tied
weights are split alike."""
from __future__ import annotations

from math import gcd

from torch import nn

from parallel.config import ConfigError
from parallel.strategies.tensor.styles import (
    KEEPS_OUTPUT_SHARDED,
    SHARDS_INPUT,
    SHARDS_OUTPUT,
    can_take,
    is_conv1d,
    is_linear,
    weight_placement,
)


def check_module(module: nn.Module, name: str, style: str, tp: int) -> None:
    """`style` can shard `module`, and the dimension it splits divides by `tp`."""
    if not can_take(style, module):
        if is_conv1d(module):
            rule = "a Conv1D takes colwise, colwise_gather, rowwise or rowwise_split"
        elif style == "positions":
            rule = f"positions shards LocallyConnected1d/2d, not {type(module).__name__}"
        else:
            rule = f"{style} shards nn.Linear, nn.Embedding or Hugging Face's Conv1D, not {type(module).__name__}"
        raise ConfigError(f"strategy.tp_plan[{name!r}]={style!r}: {rule}")
    if style == "positions":
        dim, what = 0, "output positions"
    elif style in SHARDS_OUTPUT + SHARDS_INPUT:
        dim, what = weight_placement(style, module).dim, ("input" if style in SHARDS_INPUT else "output")
        what = "rows" if isinstance(module, nn.Embedding) and style in SHARDS_INPUT else f"{what} features"
    else:
        return
    width = module.weight.shape[dim]
    if width % tp:
        raise ConfigError(f"strategy.tp={tp}: {name} has {width} {what}, which do not divide by tp {tp} ({style})")


def _width_out(module: nn.Module) -> int:
    return module.weight.shape[1] if is_conv1d(module) else module.weight.shape[0]


def _head_counts(model: nn.Module, attention: nn.Module) -> dict[str, int]:
    """The model's head counts by their config keys (Hugging Face), or the attention module's own."""
    config = getattr(model, "config", None)
    keys = ("num_attention_heads", "num_key_value_heads")
    counts = {k: getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)}
    if not counts:
        counts = {k: getattr(attention, k) for k in ("heads", "num_heads", *keys)
                  if isinstance(getattr(attention, k, None), int)}
    return counts


def check_heads(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """A projection split colwise inside an attention module gives each rank whole heads.

    An attention module is one with a `head_dim` (or `attention_head_size`, BERT's) attribute: Hugging Face's
    and the built-in gpt's. They reshape a projection's output with `view(..., -1, head_dim)`, so a rank holding
    a whole number of heads per projection computes those heads' attention as the whole model does (with
    grouped-query attention, q heads 2i and 2i+1 and their shared kv head i land on the same rank when both
    counts divide by tp). A width that is no head count of the model packs several projections (GPT-2's
    c_attn holds q, k and v): split colwise, a rank would hold q and part of k.

    Raises:
        ConfigError: naming the head count's config key and value, and the tp that would work.
    """
    config = getattr(model, "config", None)
    for name, style in plan.items():
        if style not in KEEPS_OUTPUT_SHARDED:
            continue
        module, parent = model.get_submodule(name), model.get_submodule(name.rpartition(".")[0])
        if not is_linear(module):
            continue
        head_dim = getattr(parent, "head_dim", None) or getattr(parent, "attention_head_size", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            continue
        width, counts = _width_out(module), _head_counts(model, parent)
        heads = width // head_dim
        if width % head_dim or (counts and heads not in counts.values()):
            raise ConfigError(
                f"strategy.tp_plan[{name!r}]={style!r}: {name} packs several projections in its {width} output "
                f"features ({width / head_dim:g} heads of {head_dim}; the model has {counts}), so a colwise split "
                f"would give a rank parts of different ones (e.g. all of q and part of k); leave it whole (no entry, "
                f"or 'replicate'), or use 'colwise_gather' to split only its matrix product")
        if heads % tp:
            key = next((k for k, v in counts.items() if v == heads), "heads")
            owner = type(config).__name__ if config is not None else type(parent).__name__
            valid = [d for d in range(1, max(counts.values(), default=heads) + 1)
                     if gcd(*counts.values(), heads) % d == 0]
            raise ConfigError(
                f"strategy.tp={tp}: {key}={heads} ({owner}; {name} computes {heads} heads of {head_dim}) does not "
                f"divide by tp {tp}: each rank must hold whole attention heads (valid tp: {valid}, the divisors "
                f"of {' and '.join(f'{k}={v}' for k, v in counts.items()) or heads})")


def check_ties(model: nn.Module, plan: dict[str, str]) -> None:
    """A weight shared by several modules (an input embedding tied to the output head) is split the same way
    in each, so one DTensor can stand for all of them (`shard` ties them again after sharding)."""
    holders: dict[int, list[str]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), [])
            if mod_name not in holders[id(weight)]:
                holders[id(weight)].append(mod_name)
    for names in holders.values():
        placements = {n: weight_placement(plan.get(n), model.get_submodule(n)) for n in names}
        if len(set(placements.values())) > 1:
            described = ", ".join(f"{n}: {plan.get(n, 'no entry')} ({p or 'whole'})" for n, p in placements.items())
            raise ConfigError(f"strategy.tp_plan: {' and '.join(names)} share one weight (tied), which the plan "
                              f"splits differently ({described}); give them styles that split it alike "
                              f"(an Embedding's rowwise with a Linear's colwise or colwise_gather), or keep "
                              f"both whole")
