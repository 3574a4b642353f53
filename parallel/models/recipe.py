"""What a run builds, resolved once from the model group (`ModelRecipe`): the first step of Note [building a
model] in parallel/models/build.py, whole here: the factory (a built-in or the user's `_target_`), or model=hf's
class and config read from its directory (`hf_source`); the adapters' PEFT config (`adapters_of`, Note [LoRA]);
the freeze patterns; where pretrained values are read, and how the rest are made (model.init, model.strict).

model=hf's directory is read on disk only: its `config.json` names the architecture (or `model.auto_class`, or
the class `data.task` names), `model.config` overrides its settings, and its weights are loaded when it has them
and `model.pretrained` is true. Nothing is downloaded (`local_files_only`, Hugging Face's hub kept offline).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from parallel.config import ConfigError, ModelConfig, fail, import_target
from parallel.init.files import WEIGHT_NAMES
from parallel.models import MODELS
from parallel.models.hf import HFModel, cache_off, import_transformers
from parallel.models.lora import Adapters, import_peft

log = logging.getLogger("parallel")


@dataclass(frozen=True)
class ModelRecipe:
    """What a run builds and where its initial values come from, resolved once from the model group
    (Note [building a model])."""

    factory: Callable[..., Any] | None  # a built-in or the user's `_target_`; None for model=hf
    args: dict  # the factory's keyword arguments (model=hf: its directory, Auto class and overrides)
    hf: HFModel | None  # model=hf: the class and config it is built from, and its directory's weights
    adapters: Adapters | None  # model.lora / model.peft
    freeze: tuple[str, ...]  # model.freeze
    weights: str | None  # the pretrained values every rank reads its pieces of (weights_path)
    init: str  # model.init: how what the weights do not hold is made
    strict: bool  # model.strict
    target: str | None  # model._target_ and model.name, which errors about the build name
    name: str


def model_recipe(m: ModelConfig) -> ModelRecipe:
    """What to build (Note [building a model]). Raises ConfigError: an unknown model, a `_target_` that is not
    callable, a model=hf directory without a readable config, bad adapters."""
    hf = hf_source(m) if m.name == "hf" and not m._target_ else None  # model=hf: its class and config, read once
    adapters = adapters_of(m)
    factory = None if hf is not None else resolve_factory(m)
    args, pretrained = (dict(m.args), None) if hf is None else (hf.args, hf.weights)
    weights = m.weights if m.weights is not None else pretrained  # weights_path, its directory read once
    return ModelRecipe(factory, args, hf, adapters, tuple(m.freeze), weights, m.init, m.strict, m._target_, m.name)


def resolve_factory(m: ModelConfig):
    """The callable that builds the model: a built-in, or the user's `_target_`; None for model=hf (built
    from its class and config: `hf_source`)."""
    if m._target_:
        factory = import_target("model._target_", m._target_)
        if not callable(factory):
            fail("model._target_", m._target_, "is not callable")
        return factory
    if m.name == "hf":
        return None
    if m.name not in MODELS:
        fail("model.name", m.name, "unknown model; use a built-in, model=hf or set model._target_",
             sorted([*MODELS, "hf"]))
    return MODELS[m.name]


def pretrained_dir(m: ModelConfig) -> str | None:
    """The model=hf directory whose own weights are loaded (model.pretrained, and no model.weights instead;
    a `_target_` replaces model=hf's build)."""
    return hf_weights(m) if m.name == "hf" and not m._target_ else None


def weights_path(m: ModelConfig) -> str | None:
    """The pretrained weights to load: model.weights, or a model=hf directory's own."""
    return m.weights if m.weights is not None else pretrained_dir(m)


AUTO_CLASSES = ("AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
                "AutoModelForTokenClassification", "AutoModelForImageClassification", "AutoModelForQuestionAnswering",
                "AutoModelForSeq2SeqLM")
# The class a task trains, for a config.json that names no architecture (`LlamaConfig(...).save_pretrained`).
TASK_CLASSES = {"lm": "AutoModelForCausalLM", "classification": "AutoModelForSequenceClassification"}


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


def hf_config(path: str, overrides: dict | None = None):
    """The directory's config with `overrides` set (each must be a key the config has)."""
    transformers = import_transformers()
    if not (Path(path) / "config.json").is_file():
        fail("model.path", path, "has no config.json (a Hugging Face model directory, as save_pretrained writes)")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            fail(f"model.config.{key}", value, f"is not a setting of {type(config).__name__}")
        setattr(config, key, value)
    cache_off(config)
    return config


def hf_class(config, auto_class: str | None):
    """The class that builds the model: an Auto class by name, or the config's first architecture."""
    transformers = import_transformers()
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
    return m.path if m.pretrained and m.weights is None and m.path and _has_weights(m.path) else None


def _has_weights(directory: str) -> bool:
    """Whether a model directory holds weights under one of the names `save_pretrained` writes."""
    return any((Path(directory) / name).is_file() for name in WEIGHT_NAMES)


def adapters_of(m: ModelConfig) -> Adapters | None:
    """The run's adapters (None without them); raises peft_config's ConfigError."""
    config = peft_config(m)
    if config is None:
        return None
    return Adapters(config, "model.peft" if m.peft else "model.lora.targets",
                    dict(m.peft) if m.peft else list(m.lora.targets))


def peft_config(m: ModelConfig):
    """The PEFT config the run asks for (None without adapters).

    Raises:
        ConfigError: both model.lora and model.peft set; a bad value of either.
    """
    if m.lora.r < 0:
        fail("model.lora.r", m.lora.r, "must be >= 0 (0: no adapters)")
    if m.lora.r > 0 and m.peft:
        fail("model.peft", dict(m.peft), "model.lora.* and model.peft both configure adapters: keep one")
    if m.peft:
        args: dict[str, Any] = dict(m.peft)
        target = args.pop("_target_", None)
        if target is None:
            fail("model.peft", dict(m.peft), "needs _target_, a PEFT config class (e.g. peft.LoraConfig)")
        import_peft()
        cls = import_target("model.peft._target_", target)
        try:
            return cls(**{k: list(v) if isinstance(v, (list, tuple)) else v for k, v in args.items()})
        except (TypeError, ValueError) as e:
            fail("model.peft", dict(m.peft), f"{target} refuses it: {type(e).__name__}: {e}")
    if m.lora.r == 0:
        return None
    if not 0 <= m.lora.dropout < 1:
        fail("model.lora.dropout", m.lora.dropout, "must be in [0, 1)")
    peft = import_peft()
    return peft.LoraConfig(r=m.lora.r, lora_alpha=m.lora.alpha, lora_dropout=m.lora.dropout,
                           target_modules=list(m.lora.targets) or None,
                           modules_to_save=list(m.lora.modules_to_save) or None)
