"""What a data=custom dataset's first sample says, read in the launching process before any worker starts
(parallel.validate.to_config), and the checks of data=custom's settings."""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import OmegaConf

from parallel.config import ConfigError, DataConfig, error_text, fail
from parallel.data.custom.dataset import (
    Collate,
    _count,
    _spec,
    build_dataset,
    first_sample,
    import_callable,
    infer_task,
    is_iterable,
    resolve_input_keys,
    resolve_key,
)
from parallel.data.custom.split import check_split
from parallel.data.spec import DataSpec
from parallel.tensors import main_field


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _user_batch(user: str, sample: Any) -> Any:
    """data.collate's batch of one sample."""
    fn = import_callable("data.collate._target_", user)
    try:
        return fn([sample])
    except Exception as e:  # noqa: BLE001 - the user's function
        fail("data.collate._target_", user, f"collating a sample failed: {error_text(e)}")


def _collated(key: str, target: Any, collate: Collate, sample: Any) -> tuple[Any, torch.Tensor]:
    """One sample through the configured collation -> its input (a tensor, or a dict of them by name) and
    target."""
    try:
        x, y = collate([sample])
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's collate function, or fields default_collate cannot stack
        key, target = ("data.collate._target_", collate.user) if collate.user else (key, target)
        fail(key, target, f"collating a sample failed: {error_text(e)}")
    fields = list(x.values()) if isinstance(x, dict) else [x]
    if not all(torch.is_tensor(t) and t.dim() for t in fields) or not torch.is_tensor(y):
        fail(key, target, "the batch's input must be a tensor with a sample dimension")
    return ({k: v[0] for k, v in x.items()} if isinstance(x, dict) else x[0]), y[0]


def _input_spec(x: Any) -> dict:
    """A DataSpec's input entries: the main field's `input`, and every field's by name (`named`)."""
    spec = {"input": _spec(main_field(x))}
    if isinstance(x, dict):
        spec["named"] = {k: _spec(v) for k, v in x.items()}
    return spec


def read_custom_hints(d) -> tuple[dict, DataSpec]:
    """The keys data=custom sets from the first sample (the task when data.task=auto, the sizes the built-in
    models read, the resolved input and target keys), and the DataSpec of its fields and size (Note [data
    spec] in parallel/data/spec.py).

    Args:
        d: the composed data section (a DictConfig or DataConfig) before interpolations resolve.
    """
    target, args = d._target_, _plain(d.args)
    ds = build_dataset("data._target_", target, args)
    sample = first_sample("data._target_", target, ds)
    user = (_plain(d.collate) or {}).get("_target_")
    fields = _user_batch(user, sample) if user else sample  # the keys name fields of what the model is fed
    ik, tk = resolve_input_keys(fields, _plain(d.input_key)), resolve_key(fields, d.target_key, "target")
    named, y = _collated("data._target_", target, Collate(ik, tk, user), sample)
    x = main_field(named)  # the field the task and the sizes are read from (Note [inputs by name])
    task = infer_task(x, y) if d.task == "auto" else d.task
    hints: dict[str, Any] = {"task": task, "input_key": ik, "target_key": tk,
                             "inputs": "features" if x.is_floating_point() else "tokens"}
    spec = {**_input_spec(named), "target": _spec(y), "iterable": is_iterable(ds),
            "samples": None if is_iterable(ds) else len(ds),
            "shards": check_split("data._target_", target, ds) if is_iterable(ds) else None}
    if x.is_floating_point():
        hints["features"] = x.numel()
    elif x.dim() >= 1:
        hints["seq_len"] = x.shape[-1]
    if task == "regression":
        hints["targets"] = max(1, y.numel())
    elif task == "classification":
        hints["classes"] = _size(ds, ("classes", "num_classes"), tk, "classes", d.classes, y, "target")
    elif task == "lm":
        hints["vocab_size"] = _size(ds, ("vocab_size",), tk, "vocab_size", d.vocab_size, x, "input")
        _below("data.vocab_size", hints["vocab_size"], y, "target")
    eval_cfg = _plain(d.eval) or {}
    if eval_cfg.get("_target_"):
        spec["eval_samples"] = _check_eval_sample(eval_cfg, Collate(ik, tk, user), named, y)
    return hints, DataSpec(**spec)


def _size(ds: Any, names: tuple, field: str, key: str, configured: int, t: torch.Tensor, what: str) -> int:
    """classes / vocab_size: the configured value when set (not 0), else what the dataset states; the first
    sample's ids must be below it."""
    value = configured or _count(ds, names, field)
    if not value:
        fail(f"data.{key}", configured, f"the dataset does not say its {key} (no {' / '.join(names)} attribute"
             f"{', no ClassLabel feature' if key == 'classes' else ''}): set data.{key}=N")
    _below(f"data.{key}", value, t, what)
    return int(value)


def _below(key: str, value: int, t: torch.Tensor, what: str) -> None:
    if t.numel() and int(t.max()) >= value:
        fail(key, value, f"the first sample's {what} holds id {int(t.max())}: ids must be below {key}")


def _check_eval_sample(eval_cfg: dict, collate: Collate, x: Any, y: torch.Tensor) -> int | None:
    """data.eval's dataset gives samples of the training samples' fields, shapes and dtypes; returns its
    sample count (None: a stream)."""
    target = eval_cfg["_target_"]
    ds = build_dataset("data.eval._target_", target, eval_cfg.get("args") or {})
    sample = first_sample("data.eval._target_", target, ds)
    fields = _user_batch(collate.user, sample) if collate.user else sample
    resolve_input_keys(fields, collate.input_key), resolve_key(fields, collate.target_key, "target")
    ex, ey = _collated("data.eval._target_", target, collate, sample)
    if is_iterable(ds):
        check_split("data.eval._target_", target, ds)
    if _input_spec(ex) != _input_spec(x) or _spec(ey) != _spec(y):
        fail("data.eval._target_", target, f"its samples (input {_input_spec(ex)}, target {_spec(ey)}) differ "
             f"from the training samples' (input {_input_spec(x)}, target {_spec(y)})")
    return None if is_iterable(ds) else len(ds)


def check_custom(d: DataConfig, spec: DataSpec, batch_size: int, eval_every: int = 0) -> None:
    """data=custom's settings, after the first sample was read (`read_custom_hints`, which gave `spec`);
    `eval_every`: trainer.eval_every, which needs evaluation data."""
    if not d._target_:
        fail("data._target_", d._target_, "data=custom needs the dataset's factory", "package.module.callable")
    if not 0 <= d.eval_fraction < 1:
        fail("data.eval_fraction", d.eval_fraction, "must be in [0, 1) (0: nothing held out)")
    if d.eval_fraction and (d.eval or {}).get("_target_"):
        fail("data.eval_fraction", d.eval_fraction, "data.eval names an evaluation dataset already: set one")
    if eval_every and not d.eval_fraction and not (d.eval or {}).get("_target_"):
        fail("trainer.eval_every", eval_every, "data=custom has no evaluation data: set data.eval._target_ "
             "(a dataset of its own) or data.eval_fraction (a part of the training set held out)")
    if d.collate and set(d.collate) - {"_target_"}:
        fail("data.collate", dict(d.collate), "takes only _target_ (a function of a list of samples)")
    if spec.iterable and d.eval_fraction:
        fail("data.eval_fraction", d.eval_fraction, "an iterable dataset has no samples to hold out by "
             "position; give data.eval a dataset of its own")
    n = spec.samples or 0
    held = held_out_count(n, d.eval_fraction)
    if d.eval_fraction and held < batch_size:
        fail("data.eval_fraction", d.eval_fraction, f"holds out {held} of {n} samples, fewer than one global "
             f"batch (trainer.batch_size={batch_size}) to evaluate")
    if spec.eval_samples is not None and spec.eval_samples < batch_size:
        fail("data.eval._target_", d.eval["_target_"], f"the evaluation dataset has {spec.eval_samples} "
             f"samples, fewer than one global batch (trainer.batch_size={batch_size})")
    if not spec.iterable and n - held < batch_size:
        fail("data._target_", d._target_, f"the dataset has {n - held} samples to train on"
             f"{f' ({held} held out)' if held else ''}, fewer than one global batch (trainer.batch_size="
             f"{batch_size})")


def held_out_count(n: int, fraction: float) -> int:
    """How many of `n` samples data.eval_fraction holds out."""
    return int(n * fraction)
