"""Model building: the model as the user's script builds it (`build_model`), the meta model every strategy
starts from (`meta_model`), and the checks that it can be built, initialized and fed the configured data (run
once, before workers start).

# Note [building a model]
A run builds its model in one pass, each step in one place, in this order:
1. what to build, `model_recipe` (parallel.models.recipe, the whole step there): the factory (a built-in or
   the user's `_target_`) and its arguments, or model=hf's class and config read from its directory; the
   adapters' PEFT config; the freeze patterns; where pretrained values are read, and how the rest are made
   (model.init, model.strict).
2. the model, `build_model`: the factory's, or model=hf's class from its config (parallel.models.hf), made
   ready to train (Note [Hugging Face models for training]), then
3. its adapters, `add_adapters` at the end of `build_model` (Note [LoRA]), as the user's script puts them on;
4. `freeze`, on the meta model, before any strategy sees it (`meta_model` does 2 to 4 on the meta device);
5. its initial values, `initial_values` (parallel.models.weights; Note [initial values]).
The trainer resolves the recipe once and hands it to `meta_model` and to `initial_values`. The meta model holds
no values: where the run needs the model's own, global rank 0 alone builds it once more, through
`build_model` with the seed (`torch.manual_seed(trainer.seed)`, then the user's script: with pretrained weights
that cover the model, with its parameters on the meta device, for the buffers its constructor computes), and
every rank reads its pieces of what rank 0 wrote.
"""
from __future__ import annotations

import contextlib
import fnmatch
import inspect
import os

import torch
from torch import nn

from parallel.config import INITS, Config, ConfigError, ModelConfig, fail
from parallel.data import DataSpec, example_input, vocab_is_bound
from parallel.data.spec import spec_of
from parallel.init import check_initializable
from parallel.init.by_name import fill_own_kinds
from parallel.loss import logits_of
from parallel.models.hf import for_training, hf_build
from parallel.models.lora import add_adapters
from parallel.models.recipe import ModelRecipe, model_recipe
from parallel.tensors import as_call, main_field, meta_forward


def build_model(recipe: ModelRecipe, seed: int | None = None) -> nn.Module:
    """The user's model as their own script builds it, on the current device, then its adapters (Note [LoRA]):
    every build of the run's model goes through here (Note [building a model]).

    Args:
        recipe: what to build: the factory's model, or model=hf's class from its config, made ready to train
            (Note [Hugging Face models for training] in parallel/models/hf.py).
        seed: None: the model's structure, under the caller's generator (the meta model; the buffers its
            constructor computes). An int: its own values, as `torch.manual_seed(seed)` and then the user's
            script give them (rank 0's build, Note [initial values]): model=hf with its directory's weights
            as `from_pretrained` loads it, and the framework's own kinds of layers filled by name.
    """
    if seed is not None:
        torch.manual_seed(seed)
    if recipe.hf is None:
        model = recipe.factory(**recipe.args)
    else:
        model = hf_build(recipe.hf, pretrained=seed is not None)
    model = for_training(model)
    if seed is not None:
        fill_own_kinds(model, seed)
    return add_adapters(model, recipe.adapters)  # after the user's build, as their script adds them


def build_buffers(recipe: ModelRecipe, seed: int) -> nn.Module:
    """The model `build_model` builds, with its parameters on the meta device and its buffers as its constructor
    computes them under `torch.manual_seed(seed)` (the caller's generator left as it was): the values of the
    buffers pretrained weight files do not hold (Note [initial values]), without allocating a parameter."""
    with torch.random.fork_rng(devices=[]), _parameters_on_meta():
        torch.manual_seed(seed)
        return build_model(recipe)


@contextlib.contextmanager
def _parameters_on_meta():
    """Build a model with its parameters on the meta device and its buffers real.

    Written here because PyTorch has no such mode (`torch.device("meta")` puts buffers there too): every
    parameter a module registers goes to meta as it is registered; what `__init__` computes for buffers stays.
    """
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def meta_model(recipe: ModelRecipe) -> nn.Module:
    """The model `recipe` describes on the meta device (no memory), its adapters on and `model.freeze` applied,
    checked to be an nn.Module (steps 2 to 4 of Note [building a model])."""
    try:
        with torch.device("meta"):
            model = build_model(recipe)
    except ConfigError:
        raise  # model=hf's own checks name their keys
    except (TypeError, ValueError) as e:
        key = "model._target_" if recipe.target else f"model={recipe.name}"
        fail(key, recipe.args, f"building the model failed: {type(e).__name__}: {e}")
    if not isinstance(model, nn.Module):
        fail("model._target_" if recipe.target else "model.name", recipe.target or recipe.name,
             f"must return an nn.Module, returned {type(model).__name__}")
    freeze(model, recipe.freeze)
    return model


def build_meta_model(m: ModelConfig) -> nn.Module:
    """The meta model of the model group `m`: its recipe resolved, then `meta_model` (for what needs the model's
    structure alone: plans, checks, the planner)."""
    return meta_model(model_recipe(m))


def freeze(model: nn.Module, patterns: tuple[str, ...] | list[str]) -> None:
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
    """The factory exists, accepts `model.args`, and builds a module that model.init can initialize; returns it
    (on meta), which the checks after it read (validation builds it once)."""
    if m.frozen_checkpoint is not None and not os.path.isfile(m.frozen_checkpoint):
        fail("model.frozen_checkpoint", m.frozen_checkpoint, "no such file")
    if m.init not in INITS:
        fail("model.init", m.init, "unknown initialization", list(INITS))
    recipe = model_recipe(m)
    try:
        sig = None if recipe.factory is None else inspect.signature(recipe.factory)
    except (TypeError, ValueError):
        sig = None  # a builtin or C callable: its arguments are checked by calling it
    if sig is not None:
        try:
            sig.bind(**recipe.args)
        except TypeError as e:
            hint = ""
            if m._target_ and m.name != "custom":
                hint = f"; model.args holds the built-in '{m.name}' arguments: start from model=custom"
            fail("model.args", dict(m.args),
                 f"do not fit {getattr(recipe.factory, '__qualname__', recipe.factory)}{sig}: {e}{hint}",
                 list(sig.parameters))
    model = meta_model(recipe)
    if recipe.init == "name":
        try:
            check_initializable(model)
        except ValueError as e:
            fail("model.init", recipe.init, str(e))
    return model


def check_model_takes_data(cfg: Config, model: nn.Module | None = None, data: DataSpec | None = None):
    """The model (`model`, on meta; None: built here) runs on two samples shaped as the data's (`data`: what was
    read from data=custom, Note [data spec] in parallel/data/spec.py) and gives what its targets need. Returns
    its output (fake tensors), or None when a user's model could not run on fake tensors."""
    d = cfg.data
    data = spec_of(d.name, data)
    key, value, what = ("data.path", d.path, "the shards'") if d.name == "shards" else \
        ("data.task", d.task, f"data.task={d.task}'s")
    hint = f" (model={cfg.model.name} takes data.task=lm)" if d.name == "synthetic" and cfg.model.name in ("gpt", "moe") \
        else ""
    shape = {"regression": (2, d.targets), "classification": (2, d.classes), "lm": (2, d.seq_len, d.vocab_size)}
    if d.name == "custom":  # the fields read from the first sample: name them
        key, value, what = "data.input_key", d.input_key, f"the dataset's {d.task}"
        shape["regression"] = (2, *data.target["shape"])
        if data.named:  # fields by name: an lm target need not be as long as the main field
            shape["lm"] = (2, *data.target["shape"], d.vocab_size)
    inputs = example_input(d, spec=data)
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
                   f"{tuple(data.target['shape'])}) needs {shape[d.task]}"
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
