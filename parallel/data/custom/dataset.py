"""The user's dataset: built from its factory, its samples' fields picked and collated, and what its first sample
says about the task and the sizes (read before the workers start, as data=shards reads its manifest)."""
from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from parallel.config import TASKS, ConfigError, error_text, fail, import_target

# The fields a dict sample is read from when data.input_key / data.target_key are not set, first found first
# (Hugging Face's names for token ids and images, then the plain x / y).
INPUT_KEYS = ("input_ids", "pixel_values", "x")
TARGET_KEYS = ("labels", "y")


def import_callable(key: str, target: Any) -> Callable:
    """The callable a dotted path 'package.module.name' names; a ConfigError naming `key` otherwise."""
    found = import_target(key, target)
    if not callable(found):
        fail(key, target, "is not callable")
    return found


def _hf(obj: Any, name: str) -> bool:
    """Whether `obj` is a Hugging Face `datasets.<name>` (the package is only imported if the factory did)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(obj, getattr(module, name, ()))


def is_iterable(ds: Any) -> bool:
    """A stream (torch IterableDataset or Hugging Face datasets.IterableDataset), not indexed by position."""
    return isinstance(ds, IterableDataset) or _hf(ds, "IterableDataset")


def build_dataset(key: str, target: Any, args: Mapping) -> Any:
    """Call the user's factory `target(**args)` and check it returned a dataset this module can read.

    A Hugging Face dataset without a format is given the torch one (its samples' arrays become tensors, as
    the loader's collation needs). Raises ConfigError naming `key`.
    """
    factory = import_callable(key, target)
    try:
        ds = factory(**dict(args))
    except ConfigError:
        raise
    except (TypeError, ValueError, OSError) as e:
        fail(key, target, f"building the dataset with args {dict(args)} failed: {error_text(e)}")
    if (_hf(ds, "Dataset") or _hf(ds, "IterableDataset")) and getattr(ds, "format", {}).get("type") is None:
        ds = ds.with_format("torch")
    if is_iterable(ds):
        return ds
    if not (isinstance(ds, Dataset) or _hf(ds, "Dataset")):
        fail(key, target, f"returned a {type(ds).__module__}.{type(ds).__qualname__}, not a dataset",
             "a torch.utils.data.Dataset (map-style, with __len__), an IterableDataset or a datasets.Dataset")
    try:
        len(ds)
    except TypeError:
        fail(key, target, f"returned a map-style {type(ds).__qualname__} without __len__ (the order of its "
             "samples needs their count); give it __len__, or make it an IterableDataset")
    return ds


def first_sample(key: str, target: Any, ds: Any) -> Any:
    """The dataset's first sample (a stream's first item); a ConfigError for an empty one."""
    try:
        if is_iterable(ds):
            return next(iter(ds))
        if len(ds) == 0:
            raise IndexError
        return ds[0]
    except (StopIteration, IndexError):
        fail(key, target, "the dataset is empty")


def _keys_of(sample: Any) -> list:
    return list(sample.keys()) if isinstance(sample, Mapping) else list(range(len(sample)))


def resolve_key(sample: Any, key: str | None, which: str) -> str:
    """The field of `sample` that data.<which>_key names (or its default), as the string the config keeps.

    Raises ConfigError naming the key, and the sample's fields, when the sample has no such field.
    """
    cfg_key = f"data.{which}_key"
    if isinstance(sample, Mapping):
        if key is None:
            defaults = INPUT_KEYS if which == "input" else TARGET_KEYS
            found = [k for k in defaults if k in sample]
            if not found:
                fail(cfg_key, None, f"the samples are dicts without any of {list(defaults)}: name the field "
                     f"that goes to the {'model' if which == 'input' else 'loss'}", _keys_of(sample))
            return found[0]
        if key not in sample:
            fail(cfg_key, key, "the samples have no such field", _keys_of(sample))
        return key
    if isinstance(sample, Sequence) and not isinstance(sample, (str, bytes)) and not torch.is_tensor(sample):
        index = ("0" if which == "input" else "1") if key is None else str(key)
        if not index.isdigit() or int(index) >= len(sample):
            fail(cfg_key, key, f"the samples are {type(sample).__name__}s of {len(sample)} items: an index",
                 _keys_of(sample))
        return index
    fail("data._target_", type(sample).__name__, "samples must be tuples or dicts holding the model's input "
         "and the target", "(input, target), {'x': ..., 'y': ...}, {'input_ids': ..., 'labels': ...}")


def resolve_input_keys(sample: Any, keys: Any) -> str | list[str]:
    """data.input_key resolved (`resolve_key`): one field, or a list of fields passed by name (Note [inputs by
    name] in parallel/tensors.py), each checked; a ConfigError for a list over samples that are not dicts."""
    if keys is None or isinstance(keys, (str, int)):
        return resolve_key(sample, keys, "input")
    keys = [str(k) for k in keys]
    if not keys or len(set(keys)) != len(keys):
        fail("data.input_key", keys, "a list of fields passed to the forward by name must name each once")
    if not isinstance(sample, Mapping):
        fail("data.input_key", keys, f"fields passed by name need dict samples; these are "
             f"{type(sample).__name__}s", "one index, or samples that are dicts")
    return [resolve_key(sample, k, "input") for k in keys]


def input_of(sample: Any, key: str | list[str]) -> Any:
    """A sample's (or a collated batch's) input: the field `key`, or the fields of a list by name, as tensors."""
    if isinstance(key, list):
        return {k: as_tensor(pick(sample, k)) for k in key}
    return as_tensor(pick(sample, key))


def pick(sample: Any, key: str) -> Any:
    """The field `key` (as `resolve_key` returned it) of a sample or of a collated batch."""
    return sample[key] if isinstance(sample, Mapping) else sample[int(key)]


def as_tensor(value: Any) -> torch.Tensor:
    """A field as the framework trains on it: a tensor, fp32 for floating point and int64 for integers
    (token ids and class labels, as embeddings and cross-entropy take them)."""
    t = value if torch.is_tensor(value) else torch.as_tensor(value)
    if t.is_floating_point() and t.dtype != torch.float32:
        t = t.float()
    elif not t.is_floating_point() and not t.is_complex() and t.dtype not in (torch.bool, torch.int64):
        t = t.long()
    return t


class Collate:
    """A list of samples -> (inputs, targets): each sample's input (a field, or a dict of fields by name) and
    target collated by PyTorch's default_collate, or the whole samples by the user's `data.collate._target_`,
    whose batch the keys then read.

    Picklable (it runs in the loader's worker processes).
    """

    def __init__(self, input_key: str | list[str], target_key: str, user: str | None = None):
        self.input_key, self.target_key, self.user = input_key, target_key, user
        self._fn = None

    def __getstate__(self):
        return {**self.__dict__, "_fn": None}

    def __call__(self, samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        if self.user is None:
            pairs = [(input_of(s, self.input_key), as_tensor(pick(s, self.target_key))) for s in samples]
            return default_collate(pairs)
        if self._fn is None:
            self._fn = import_callable("data.collate._target_", self.user)
        batch = self._fn(samples)
        return input_of(batch, self.input_key), as_tensor(pick(batch, self.target_key))


def configured_input_key(key: Any) -> str | list[str]:
    """data.input_key as the config holds it once resolved: one field, or the list of fields by name."""
    return str(key) if isinstance(key, (str, int)) else [str(k) for k in key]


def collate_of(d) -> Collate:
    """The collation data.collate asks for, reading the keys the config holds (resolved before the start)."""
    return Collate(configured_input_key(d.input_key), str(d.target_key), (d.collate or {}).get("_target_"))


def _spec(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _count(ds: Any, names: tuple[str, ...], key: str) -> int | None:
    """A size the dataset states: an attribute (`classes` as torchvision's, `num_classes`, `vocab_size`), or
    the number of names of a Hugging Face ClassLabel field."""
    for name in names:
        value = getattr(ds, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, Sequence) and not isinstance(value, str) and value:
            return len(value)
    features = getattr(ds, "features", None)  # a Hugging Face dataset's Features (a dict of field -> type)
    feature = features.get(key) if isinstance(features, Mapping) else None
    return getattr(feature, "num_classes", None)


def infer_task(x: torch.Tensor, y: torch.Tensor) -> str:
    """The task a sample's (input, target) suggests: lm (a sequence of token ids in, one of ids out: the same
    shape, or an encoder-decoder's target of its own length), classification (one integer label), regression
    (floating-point targets)."""
    if not x.is_floating_point() and not y.is_floating_point() and x.dim() == 1 and y.dim() == 1:
        return "lm"
    if not y.is_floating_point() and y.dim() == 0:
        return "classification"
    if y.is_floating_point():
        return "regression"
    fail("data.task", "auto", f"cannot tell the task from a sample with input {_spec(x)} and target {_spec(y)}",
         list(TASKS))
