"""`model=hf`: a Hugging Face transformers model from a directory on disk, without a wrapper.

The architecture comes from the directory's `config.json` (`architectures`, `model.auto_class`, or the class
`data.task` names), with `model.config` overrides; the model is built as `from_config` builds it (its own
`_init_weights`), and its weights are loaded from the directory when it has them and `model.pretrained` is
true (parallel.init.values; what they lack as `from_pretrained` initialises it, `hf_build`). Nothing is
downloaded: the directory is read with `local_files_only`, and Hugging Face's hub is kept offline.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from parallel.config import ConfigError, ModelConfig, fail
from parallel.init.files import has_weights
from parallel.models.hf_moe import grouped_experts
from parallel.torch_patches import register_grouped_mm_fake

log = logging.getLogger("parallel")

AUTO_CLASSES = ("AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
                "AutoModelForTokenClassification", "AutoModelForImageClassification", "AutoModelForQuestionAnswering",
                "AutoModelForSeq2SeqLM")
# The class a task trains, for a config.json that names no architecture (`LlamaConfig(...).save_pretrained`).
TASK_CLASSES = {"lm": "AutoModelForCausalLM", "classification": "AutoModelForSequenceClassification"}


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a directory on disk only: never reach the hub
    try:
        import transformers  # an optional extra: imported only when model=hf asks for it
    except ImportError:
        raise ConfigError("model=hf needs Hugging Face transformers: pip install -e \".[hf]\"") from None
    return transformers


def hf_config(path: str, overrides: dict | None = None):
    """The directory's config with `overrides` set (each must be a key the config has)."""
    transformers = _transformers()
    if not (Path(path) / "config.json").is_file():
        fail("model.path", path, "has no config.json (a Hugging Face model directory, as save_pretrained writes)")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            fail(f"model.config.{key}", value, f"is not a setting of {type(config).__name__}")
        setattr(config, key, value)
    cache_off(config)
    return config


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
    tf_logging = _transformers().utils.logging
    level, bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)
        if bars:
            tf_logging.enable_progress_bar()


def hf_class(config, auto_class: str | None):
    """The class that builds the model: an Auto class by name, or the config's first architecture."""
    transformers = _transformers()
    if auto_class is not None:
        if auto_class not in AUTO_CLASSES and not (auto_class.startswith("AutoModel")
                                                   and hasattr(transformers, auto_class)):
            fail("model.auto_class", auto_class, "is not a transformers Auto class", list(AUTO_CLASSES))
        return getattr(transformers, auto_class)
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        fail("model.auto_class", None, "config.json names no architectures and data.task names no class "
             f"({', '.join(f'{t}: {c}' for t, c in TASK_CLASSES.items())}): set the Auto class to build it with",
             list(AUTO_CLASSES))
    if not hasattr(transformers, architectures[0]):
        fail("model.path", None, f"config.json's architecture {architectures[0]} is not in transformers "
             f"{transformers.__version__}")
    return getattr(transformers, architectures[0])


@dataclass(frozen=True)
class HFModel:
    """What model=hf builds, resolved once from its directory (`hf_source`): the class, and its config with
    model.config's overrides set and the cache off."""

    cls: type
    config: Any
    args: dict  # hf_args: the directory, the Auto class and the overrides
    weights: str | None  # hf_weights: the directory, when from_pretrained loads its weights


def hf_source(m: ModelConfig) -> HFModel:
    """The class and config of model=hf's directory, and whether its weights are loaded."""
    args = hf_args(m)
    try:
        conf = hf_config(args["path"], args["config"])
        cls = hf_class(conf, args["auto_class"])
    except ConfigError:
        raise  # its own checks name their keys
    except (TypeError, ValueError) as e:  # transformers refusing the directory's config
        fail("model=hf", args, f"building the model failed: {type(e).__name__}: {e}")
    return HFModel(cls, conf, args, hf_weights(m))


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


def derive_auto_class(m: ModelConfig, task: str) -> None:
    """model=hf of a directory whose config.json names no architecture: `model.auto_class` from the task
    (TASK_CLASSES), in place, said in the log; nothing when it is set, or the task names no class (hf_class
    then says what to set)."""
    if m.name != "hf" or m._target_ or m.auto_class is not None or not m.path or task not in TASK_CLASSES:
        return
    try:
        architectures = json.loads((Path(m.path) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return  # no readable config.json: hf_config names the problem
    if not architectures:
        m.auto_class = TASK_CLASSES[task]
        log.info("model.path=%s: config.json names no architectures; data.task=%s builds it with %s (set "
                 "model.auto_class for another class)", m.path, task, m.auto_class)


def hf_args(m: ModelConfig) -> dict:
    """`hf_source`'s arguments from the model group."""
    if m.path is None or m.path == "???":
        fail("model.path", m.path, "model=hf builds the model of a directory: set model.path=DIR")
    return {"path": m.path, "auto_class": m.auto_class, "config": dict(m.config)}


def hf_weights(m: ModelConfig) -> str | None:
    """The directory's weights when they are to be loaded: model.pretrained, the directory has them, and no
    model.weights replaces them."""
    return m.path if m.pretrained and m.weights is None and m.path and has_weights(m.path) else None


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
