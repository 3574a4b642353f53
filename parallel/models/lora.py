"""LoRA and the other PEFT adapters on the user's model: `model.lora.*`, or any PEFT config as `model.peft`.

# Note [LoRA]
The adapters are PEFT's own, put on the model as the user's script puts them:
`torch.manual_seed(trainer.seed); model = build(); model = get_peft_model(model, config)`, so their initial
values, their forward and their numbers are the user's own PEFT loop's. The framework trains the module PEFT
wraps (`peft_model.base_model.model`): the user's model with each targeted layer replaced by PEFT's adapter
layer (`q_proj` becomes `q_proj.base_layer`, `q_proj.lora_A.default`, `q_proj.lora_B.default`), every
parameter outside the adapters and `modules_to_save` frozen by PEFT. `PeftModel.forward` adds nothing to that
module's forward in training, so the outputs are equal.

Every strategy then sees a model with frozen parameters, as `model.freeze` makes one: frozen weights get no
gradients, no gradient reduction and no optimizer state, and the planner counts exactly the trainable ones.
What each strategy does with the adapters:
- data (any zero level), context, expert, offload, recomputation, compiled blocks: an adapter layer is part of
  its block; the block is sharded, streamed, recomputed or compiled whole.
- pipeline: the adapters travel with their blocks (a stage holds its layers' adapters).
- model (tensor parallel): the base layer is split by the plan's style; the adapter beside it is placed so
  that its sum with the base layer's output needs no more communication (`adapter_plan`).
Checkpoints hold the trainable tensors and the buffers only (`checkpointed`): the frozen weights come back
from where they came from at the start (the pretrained files, or the seeded build).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallel.config import ConfigError, ModelConfig, fail

ADAPTER = "default"  # PEFT's name of the one adapter a model gets
SHOWN = 20  # Linear names listed when targets match nothing
# Tensor-parallel styles of a base layer, and where its adapter's two matrices go (Note [LoRA]):
# colwise: the output is split, so lora_B (which makes the output) is split alike and lora_A stays whole;
# rowwise: the input is split, so lora_A (which reads it) is split alike, its small output summed over the
# ranks as the base layer's is, and lora_B stays whole.
ADAPTER_STYLES = {"colwise": ("lora_B", "colwise"), "colwise_gather": ("lora_B", "colwise_gather"),
                  "rowwise": ("lora_A", "rowwise"), "rowwise_split": ("lora_A", "rowwise_split")}


def import_peft():
    """PEFT, or a ConfigError saying how to install it."""
    try:
        import peft  # an optional extra: imported only when a run asks for adapters
    except ImportError:
        raise ConfigError("model.lora / model.peft need PEFT: pip install -e \".[peft]\"") from None
    return peft


def wanted(m: ModelConfig) -> bool:
    """Whether the run puts adapters on its model."""
    return m.lora.r > 0 or bool(m.peft)


@dataclass(frozen=True)
class Adapters:
    """The adapters a run puts on its model, resolved once (parallel.models.recipe.adapters_of): PEFT's config,
    and the key and value an error about them names."""

    config: Any
    key: str
    value: Any


def add_adapters(model: nn.Module, adapters: Adapters | None) -> nn.Module:
    """`model` with the run's `adapters` (Note [LoRA]), or `model` itself without them."""
    if adapters is None:
        return model
    key, value = adapters.key, adapters.value
    linears = [n for n, mod in model.named_modules() if n and _linear(mod)]
    try:
        # PEFT completes the config it is given (default targets, the base model's name): each model its own copy.
        wrapped = import_peft().get_peft_model(model, copy.deepcopy(adapters.config))
    except (ValueError, TypeError, KeyError, NotImplementedError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "not found in the base model" in text or "specify `target_modules`" in text \
                or "target_modules" in text and "None" in text:
            fail(key, value, f"matches no module PEFT can wrap in {type(model).__name__} ({text})",
                 f"its Linear layers: {_listed(linears)}")
        fail(key, value, f"PEFT cannot put these adapters on {type(model).__name__}: {type(e).__name__}: {text}")
    inner = wrapped.base_model.model
    if not any(p.requires_grad for p in inner.parameters()):
        fail(key, value, f"no trainable parameter after PEFT's adapters on {type(model).__name__}")
    return inner


def _linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _listed(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def checkpointed(m: ModelConfig, tensors: dict[str, torch.Tensor]) -> set[str] | None:
    """The names (of `tensors`: every parameter and buffer of the unpartitioned model by name) a checkpoint
    holds (Note [LoRA]): with adapters, the trainable parameters and the buffers; None (everything) without."""
    if not wanted(m):
        return None
    return {n for n, t in tensors.items() if not isinstance(t, nn.Parameter) or t.requires_grad}


def adapter_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A tensor-parallel plan (module name -> style) with every entry on an adapter layer moved onto its
    base layer, and the adapter's matrix that must be split alike added (ADAPTER_STYLES, Note [LoRA]).

    Raises:
        ConfigError: an adapter layer under a style the adapters cannot follow (sequence-parallel styles,
            embeddings): the config key to change is named.
    """
    out: dict[str, str] = {}
    for name, style in plan.items():
        module = model.get_submodule(name)
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            out[name] = style
            continue
        if style == "replicate":
            out[name] = style
            continue
        if style not in ADAPTER_STYLES or not isinstance(getattr(module, "lora_A"), nn.ModuleDict):
            raise ConfigError(f"strategy.tp_plan[{name!r}]={style!r}: {name} carries LoRA adapters, which follow "
                              f"only the styles {sorted(ADAPTER_STYLES)} of a Linear layer; leave it whole "
                              f"('{name}:replicate') or leave it out of model.lora.targets")
        out[f"{name}.base_layer"] = style
        which, adapter_style = ADAPTER_STYLES[style]
        for sub in getattr(module, which):
            out[f"{name}.{which}.{sub}"] = adapter_style
    return out


ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def base_name(name: str) -> str | None:
    """The name a tensor of the adapted model has in the model without adapters, the one its pretrained
    value is read under (`q_proj.base_layer.weight` -> `q_proj.weight`; a module to save's original and its
    trained copy -> the module's own name); None for an adapter's own tensors."""
    parts = name.split(".")
    if any(p in ADAPTER_PARTS for p in parts):
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        parts = parts[:i] + parts[i + 2:]
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))


def exported_name(name: str) -> str | None:
    """The name a tensor is exported under when the adapters are merged (Note [LoRA]): `base_name`, except
    that a module to save's untrained original is left out (its trained copy takes the name)."""
    return None if "original_module" in name.split(".") else base_name(name)


def merged_delta(module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What an adapter adds to its base layer's weight, as PEFT's merge computes it: scale x B @ A (transposed
    for a layer that keeps its weight as (in, out), GPT-2's Conv1D)."""
    delta = (b.float() @ a.float()) * module.scaling[ADAPTER]
    return delta.T if getattr(module, "fan_in_fan_out", False) else delta


def mergeable(model: nn.Module) -> list[str]:
    """The adapter layers a merge cannot fold into their base weight (not a plain LoRA Linear: DoRA, an
    embedding's adapter, a bias of its own, another PEFT method's layers): their names."""
    bad = []
    for name, module in model.named_modules():
        if not hasattr(module, "base_layer"):
            continue
        plain = type(module).__name__ == "Linear" and hasattr(module, "lora_A") and not any(
            (getattr(module, "use_dora", {}) or {}).values()) and not getattr(module, "lora_bias", {}).get(ADAPTER)
        if not plain:
            bad.append(name)
    return bad


def adapter_names(base: nn.Module, adapters: Adapters) -> tuple[Any, dict[str, str]]:
    """(the PEFT config as PEFT leaves it on `base`, the one to save; {the name PEFT's own save gives an adapter
    tensor: its name here}), from `base`, the run's model without adapters (on the meta device): the names
    `PeftModel.from_pretrained` reads."""
    peft = import_peft()
    config = copy.deepcopy(adapters.config)  # PEFT completes the config it is given: this model's own
    wrapped = peft.get_peft_model(base, config)
    ours, held = {}, {}
    for name, t in wrapped.base_model.model.state_dict(keep_vars=True).items():
        held[f"base_model.model.{name}"] = t
        ours[id(t)] = name
    saved = peft.get_peft_model_state_dict(wrapped, state_dict=held)
    return config, {k: ours[id(v)] for k, v in saved.items()}
