"""Model building: the factory (a built-in or the user's `_target_`), the model on the meta device, and the
checks that it can be built, initialized and fed the configured data (run once, before workers start)."""
from __future__ import annotations

import fnmatch
import inspect
import os

import torch
from torch import nn

from parallel.config import INITS, Config, ConfigError, ModelConfig, fail, import_target
from parallel.data import example_input, vocab_is_bound
from parallel.init import check_initializable
from parallel.loss import logits_of
from parallel.models import MODELS
from parallel.models.hf import for_training, hf_args, hf_model, hf_pretrained, hf_weights
from parallel.models.lora import add_adapters
from parallel.tensors import as_call, main_field, meta_forward


def resolve_factory(m: ModelConfig):
    """The callable that builds the model: a built-in, or the user's `_target_`."""
    if m._target_:
        factory = import_target("model._target_", m._target_)
        if not callable(factory):
            fail("model._target_", m._target_, "is not callable")
        return factory
    if m.name == "hf":
        return hf_model
    if m.name not in MODELS:
        fail("model.name", m.name, "unknown model; use a built-in, model=hf or set model._target_",
             sorted([*MODELS, "hf"]))
    return MODELS[m.name]


def model_args(m: ModelConfig) -> dict:
    """The keyword arguments the factory is called with."""
    return hf_args(m) if m.name == "hf" and not m._target_ else dict(m.args)


def pretrained_dir(m: ModelConfig) -> str | None:
    """The model=hf directory whose own weights are loaded (model.pretrained, and no model.weights instead)."""
    return hf_weights(m) if m.name == "hf" and not m._target_ and m.weights is None else None


def weights_path(m: ModelConfig) -> str | None:
    """The pretrained weights to load: model.weights, or a model=hf directory's own."""
    return m.weights if m.weights is not None else pretrained_dir(m)


def build_model(m: ModelConfig, pretrained: bool = False) -> nn.Module:
    """The user's model as their own script builds it, on the current device, under the caller's seed: the
    factory's, or with `pretrained` (model=hf with its directory's weights) `from_pretrained`'s; then made
    ready to train (Note [Hugging Face models for training] in parallel/models/hf.py). Every build of the
    model goes through here: the meta model, rank 0's initial values (parallel.models.weights.build_own_model)
    and the constructed buffers; each caller then adds the adapters (add_adapters, Note [LoRA])."""
    if pretrained and pretrained_dir(m) is not None:
        model = hf_pretrained(**hf_args(m))
    else:
        model = resolve_factory(m)(**model_args(m))
    return for_training(model)


def build_meta_model(m: ModelConfig) -> nn.Module:
    """Build the model on the meta device (no memory) and check it is an nn.Module that can be initialized."""
    try:
        with torch.device("meta"):
            model = add_adapters(build_model(m), m)
    except ConfigError:
        raise  # model=hf's own checks name their keys
    except (TypeError, ValueError) as e:
        key = "model._target_" if m._target_ else f"model={m.name}"
        fail(key, model_args(m), f"building the model failed: {type(e).__name__}: {e}")
    if not isinstance(model, nn.Module):
        key = "model._target_" if m._target_ else "model.name"
        fail(key, m._target_ or m.name, f"must return an nn.Module, returned {type(model).__name__}")
    freeze(model, m.freeze)
    if m.init == "name":
        try:
            check_initializable(model)
        except ValueError as e:
            fail("model.init", m.init, str(e))
    return model


def freeze(model: nn.Module, patterns: list[str]) -> None:
    """Turn off `requires_grad` of every parameter whose name matches one of `patterns` (`*` wildcards),
    on the meta model, before any strategy sees it: each strategy then leaves it out of its gradients,
    gradient syncs and optimizer state as it does for any frozen parameter. A pattern that matches no
    parameter is a config error (a typo would otherwise train what was meant to stay fixed)."""
    if not patterns:
        return
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    unused = [p for p in patterns if not fnmatch.filter(names, p)]
    if unused:
        fail("model.freeze", list(patterns), f"{unused} match no parameter of {type(model).__name__}",
             f"patterns over its parameter names, e.g. {names[:3]}")
    for name, p in model.named_parameters(remove_duplicate=False):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        fail("model.freeze", list(patterns), "freezes every parameter: nothing would train")


def check_model(m: ModelConfig) -> nn.Module:
    """The factory exists, accepts `model.args`, and builds an initializable module; returns it (on meta), which
    the checks after it read (validation builds it once)."""
    if m.frozen_checkpoint is not None and not os.path.isfile(m.frozen_checkpoint):
        fail("model.frozen_checkpoint", m.frozen_checkpoint, "no such file")
    if m.init not in INITS:
        fail("model.init", m.init, "unknown initialization", list(INITS))
    factory = resolve_factory(m)
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None  # a builtin or C callable: its arguments are checked by calling it
    if sig is not None:
        try:
            sig.bind(**model_args(m))
        except TypeError as e:
            hint = ""
            if m._target_ and m.name != "custom":
                hint = f"; model.args holds the built-in '{m.name}' arguments: start from model=custom"
            fail("model.args", dict(m.args),
                 f"do not fit {getattr(factory, '__qualname__', factory)}{sig}: {e}{hint}",
                 list(sig.parameters))
    return build_meta_model(m)


def check_model_takes_data(cfg: Config, model: nn.Module | None = None):
    """The model (`model`, on meta; None: built here) runs on two samples shaped as the data's and gives what
    its targets need. Returns its output (fake tensors), or None when a user's model could not run on fake
    tensors."""
    d = cfg.data
    key, value, what = ("data.path", d.path, "the shards'") if d.name == "shards" else \
        ("data.task", d.task, f"data.task={d.task}'s")
    hint = f" (model={cfg.model.name} takes data.task=lm)" if d.name == "synthetic" and cfg.model.name in ("gpt", "moe") \
        else ""
    shape = {"regression": (2, d.targets), "classification": (2, d.classes), "lm": (2, d.seq_len, d.vocab_size)}
    if d.name == "custom":  # the fields read from the first sample: name them
        key, value, what = "data.input_key", d.input_key, f"the dataset's {d.task}"
        shape["regression"] = (2, *d.spec["target"]["shape"])
        if d.spec.get("named"):  # fields by name: an lm target need not be as long as the main field
            shape["lm"] = (2, *d.spec["target"]["shape"], d.vocab_size)
    inputs = example_input(d)
    x = main_field(inputs)
    model = build_meta_model(cfg.model) if model is None else model
    _check_forward_takes_a_batch(cfg.model, model, inputs)
    args, named = as_call(inputs)
    try:
        raw = meta_forward(model, *args, **named)
    except Exception as e:  # noqa: BLE001 - any failure here is the shapes not fitting
        if cfg.model._target_ and d.name != "shards":
            return None  # a user's model may do what fake tensors cannot (read a value): its first step will tell
        field = f"field {d.input_key!r}: " if d.name == "custom" else ""
        if named:
            field = "by name: " + ", ".join(f"{k} {t.dtype} {tuple(t.shape[1:])}" for k, t in named.items())
        else:
            field += f"{x.dtype} features of shape {tuple(x.shape[1:])}"
        fail(key, value, f"the model does not take {what} samples ({field}){hint}: {type(e).__name__}: "
             f"{str(e).splitlines()[0] if str(e) else ''}")
    try:
        out = logits_of(raw)
    except TypeError as e:
        fail("model", cfg.model._target_ or cfg.model.name, str(e))
    if d.task == "lm" and vocab_is_bound(d):  # the largest id + 1, not the vocabulary's size
        _check_vocab_bound(key, value, tuple(out.shape), d.seq_len, d.vocab_size)
    elif tuple(out.shape) != shape[d.task]:
        need = f"{what} {d.task} targets need {shape[d.task]}"
        if d.name == "shards" and d.task == "lm":
            need += " (the vocabulary their tokenizer recorded)"
        if d.name == "custom":
            key, value = "data.target_key", d.target_key
            need = f"the samples' {d.task} target (field {d.target_key!r}, of shape " \
                   f"{tuple(d.spec['target']['shape'])}) needs {shape[d.task]}"
        fail(key, value, f"the model gives outputs of shape {tuple(out.shape)} for 2 samples; {need}")
    return raw


def _check_forward_takes_a_batch(m: ModelConfig, model: nn.Module, inputs) -> None:
    """A forward with required arguments besides the batch's input (a model is called as `model(x)`, or
    `model(**x)` for inputs by name: Note [inputs by name] in parallel/tensors.py): one line before any
    worker, not a TypeError at its first step (a fake-tensor run of a user's model may fail for other
    reasons, so this does not wait for one)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C++ forward: nothing to read
        return
    args, named = as_call(inputs)
    try:
        sig.bind(*args, **named)
    except TypeError as e:
        call = f"model({', '.join(f'{k}=...' for k in named)}), the data's fields by name" if named else \
            "model(inputs), the data's input tensor alone"
        fail("model._target_" if m._target_ else "model", m._target_ or m.name,
             f"its forward{sig} takes arguments a batch cannot fill ({e}): each step calls {call}",
             ["a forward whose other arguments have defaults", "a wrapper model"])


def _check_vocab_bound(key: str, value, got: tuple, seq_len: int, bound: int) -> None:
    """The model's outputs for 2 samples of shards whose vocabulary is a lower bound `bound` (their largest
    token id + 1: Note [vocabulary bound] in parallel/data/shards/manifest.py) are (2, seq_len, V) with V above
    the largest id: a pretrained model's vocabulary may hold far more tokens than the data uses."""
    fits = len(got) == 3 and got[:2] == (2, seq_len)
    if fits and got[2] >= bound:
        return
    rule = f"the shards' lm targets hold token ids up to {bound - 1}, at or above its output size {got[2]}" if fits \
        else f"the shards' lm targets need (2, {seq_len}, V) with V above their largest token id {bound - 1}"
    fail(key, value, f"the model gives outputs of shape {got} for 2 samples; {rule}",
         f"outputs of shape (2, {seq_len}, V) with V >= {bound}")
