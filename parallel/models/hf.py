"""`model=hf` and any Hugging Face transformers model, without a wrapper: built from the class and config the
recipe read from its directory (parallel.models.recipe.hf_source), as `from_config` builds it (its own
`_init_weights`) or, for rank 0's own build with the directory's weights, as `from_pretrained` loads it
(`hf_build`); made ready to train (`for_training`); its own tensor-parallel plan (`hf_tp_plan`), and where a
mixture-of-experts model's fused experts are (`grouped_experts`). transformers is imported only when a run
asks for it, with Hugging Face's hub kept offline.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

from parallel.config import ConfigError, fail
from parallel.torch_patches import register_grouped_mm_fake


def import_transformers():
    """transformers, or a ConfigError saying how to install it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a directory on disk only: never reach the hub
    try:
        import transformers  # an optional extra: imported only when model=hf asks for it
    except ImportError:
        raise ConfigError("model=hf needs Hugging Face transformers: pip install -e \".[hf]\"") from None
    return transformers


# Note [Hugging Face models for training]
# A transformers model gets the same handling whoever builds it (model=hf, or a `_target_` factory returning
# `LlamaForCausalLM(LlamaConfig(...))` with the config's defaults), in `for_training`, which every build
# calls (parallel.models.build.build_model):
# - the key/value cache off (`config.use_cache=False`): training never reads it, and a cache object returned
#   from forward (transformers' DynamicCache) cannot be traced into pipeline stages nor sent between them.
#   Turning it off changes no value the model computes, so the run stays the user's own loop's.
# - training mode: `from_pretrained` returns a model in eval mode (dropout off).
# - fused experts (a mixture-of-experts model's): the grouped matrix product they run is given a fake kernel
#   for every dtype its real kernels take (Note [grouped matmul on fake tensors] in parallel/torch_patches.py).
# With pretrained weights that lack some of the class's tensors, rank 0 builds the model as the user's script
# does, `torch.manual_seed(seed); cls.from_pretrained(path)` (`hf_build`), so the missing ones get the
# values from_pretrained gives them (Note [initial values] in parallel/init/values.py).
def cache_off(config) -> None:
    """Turn the key/value cache off in `config` and in its text model's config (a composite model's)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in (config, text):
        if hasattr(c, "use_cache"):
            c.use_cache = False


def is_transformers_model(model) -> bool:
    """Whether `model` is a transformers PreTrainedModel (importing nothing: such a model exists only once
    transformers has imported the module that defines the class)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def grouped_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformers experts modules of `model` (Mixtral's, Qwen3-MoE's, GPT-OSS's, ...) that dispatch on
    `config._experts_implementation` (made by transformers' `use_experts_implementation`: `is_concatenated`,
    `has_gate` set on them), by name. Their grouped matrix products on fake tensors: Note [grouped matmul on
    fake tensors] in parallel/torch_patches.py."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "is_concatenated") and hasattr(m, "has_gate") and hasattr(m, "num_experts")]


def for_training(model):
    """`model` ready to train, in place (Note [Hugging Face models for training]); any other object as it is."""
    if is_transformers_model(model):
        cache_off(model.config)
    if isinstance(model, nn.Module):
        if grouped_experts(model):  # its fake passes take the real run's grouped products (also inside a wrapper)
            register_grouped_mm_fake()
        model.train()
    return model


@contextlib.contextmanager
def _quiet_loading():
    """transformers' load report and progress bars off: the framework lists what the weights lack or hold
    beyond the model once, before workers start (parallel.models.weights.check_weights)."""
    tf_logging = import_transformers().utils.logging
    level, bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)
        if bars:
            tf_logging.enable_progress_bar()


@dataclass(frozen=True)
class HFModel:
    """What model=hf builds, resolved once from its directory (`hf_source`): the class, and its config with
    model.config's overrides set and the cache off."""

    cls: type
    config: Any
    args: dict  # hf_args: the directory, the Auto class and the overrides
    weights: str | None  # hf_weights: the directory, when from_pretrained loads its weights


def hf_build(h: HFModel, pretrained: bool = False) -> nn.Module:
    """The model `h` describes, as `from_config` builds it (its own initialization), or with `pretrained` and
    weights in its directory as `cls.from_pretrained(path)` loads it (what the weights lack initialised by
    from_pretrained, with the current global generator)."""
    config = copy.deepcopy(h.config)  # a model keeps, and may change, the config it is built from: its own
    if pretrained and h.weights is not None:
        with _quiet_loading():
            return h.cls.from_pretrained(h.weights, config=config, local_files_only=True)
    auto_class = h.args["auto_class"]
    if auto_class is not None:
        try:
            return h.cls.from_config(config)
        except ValueError as e:
            fail("model.auto_class", auto_class, f"cannot build {type(config).__name__}: {str(e).splitlines()[0]}")
    return h.cls._from_config(config)


# Note [Hugging Face tensor-parallel plans]
# A transformers model carries its own plan: `_tp_plan` on the instance (transformers merges the class's
# plan, the config's `base_model_tp_plan` under the base model's prefix, and an `embed_tokens` entry), also
# read through the `tp_plan` property; module-name patterns -> HF style names. The framework takes it as the
# model's own plan (parallel.strategies.tensor.resolve_plan), with the HF names turned into the framework's
# styles of the same placements: weights split alike, inputs and outputs laid out alike.
HF_STYLES = {
    "colwise": "colwise",                      # weight rows (output features) split, output kept split
    "rowwise": "rowwise",                      # weight columns (input features) split, output summed
    "colwise_gather_output": "colwise_gather",  # colwise, output gathered whole (lm_head)
    "colwise_rep": "colwise_gather",
    "rowwise_split_input": "rowwise_split",    # rowwise taking a whole input, cut on each rank
    "rowwise_rep": "rowwise_split",
    "embedding_rowwise": "rowwise",            # an Embedding's rows (the vocabulary) split, lookups summed
    "embedding_colwise": "colwise_gather",     # an Embedding's features split, output gathered whole
    "replicate": "replicate",
    "replicated_with_grad_allreduce": "replicate_grads",  # whole, its gradient summed over the tp ranks
}


def hf_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan a Hugging Face model carries, in the framework's style names (Note [Hugging
    Face tensor-parallel plans]); None when it carries none (GPT-2 and BERT in transformers 5.x) or is not a
    transformers model.

    Raises:
        ConfigError: the plan uses a style the framework has no equivalent of (packed, expert-parallel, ...).
    """
    plan = getattr(model, "_tp_plan", None)
    config = getattr(model, "config", None)
    if not isinstance(plan, dict) or config is None:
        return None
    plan = dict(plan)
    base = getattr(config, "base_model_tp_plan", None) or {}
    if not plan and base:  # a plan not merged onto the instance (a model built without post_init)
        prefix = getattr(model, "base_model_prefix", "")
        inner = prefix and hasattr(model, prefix)
        plan = {f"{prefix}.{k}" if inner else k: v for k, v in base.items()}
    if not plan:
        return None
    unknown = {k: v for k, v in plan.items() if v not in HF_STYLES}
    if unknown:
        raise ConfigError(f"strategy.tp_plan=[]: {type(model).__name__}'s own (Hugging Face) tensor-parallel plan "
                          f"uses styles with no equivalent here: {unknown} (mapped: {sorted(HF_STYLES)}); give "
                          f"strategy.tp_plan=[pattern:style,...] with the framework's styles instead")
    return {k: HF_STYLES[v] for k, v in plan.items()}
