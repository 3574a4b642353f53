"""Data sources: each yields this rank's slice of the global batch for a step."""
from __future__ import annotations

from typing import Protocol

import torch

from parallel.config import TASKS, DataConfig, fail, positive
from parallel.data.custom import IterData, MapData, build_custom_eval, check_custom, read_custom_hints
from parallel.data.shards import ShardData, check_shards
from parallel.data.shards import read_hints as read_shard_hints
from parallel.data.shards import vocab_is_bound as shard_vocab_is_bound
from parallel.data.spec import DataSpec, spec_of
from parallel.data.synthetic import SyntheticData

SOURCES = ("synthetic", "shards", "custom")


class DataSource(Protocol):
    """What the trainer reads: this rank's slice of the global batch of a step (a function of (seed, step),
    so any step can be read on any world size) as (input, targets), the input a tensor or a dict of fields
    by name (Note [inputs by name] in parallel/tensors.py), and `close` to stop any reader threads."""

    def batch(self, step: int, device: torch.device) -> tuple: ...

    def close(self) -> None: ...


def build_data(cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
               spec: DataSpec | None = None) -> DataSource:
    """The configured source: SyntheticData, ShardData for data=shards, the user's dataset for data=custom
    (`spec`: what validation read from it, Note [data spec] in parallel/data/spec.py)."""
    if cfg.name == "shards":
        return ShardData(cfg, seed, batch_size, dp_rank, dp_size)
    if cfg.name == "custom":
        source = IterData if spec_of(cfg.name, spec).iterable else MapData
        return source(cfg, seed, batch_size, dp_rank, dp_size)
    return SyntheticData(cfg, seed, batch_size, dp_rank, dp_size)


def build_eval_data(cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0,
                    dp_size: int = 1) -> DataSource | None:
    """The eval data (Note [evaluation] in parallel/evaluation.py), or None when the configuration has none.

    Its `batch(i, device)`, i = 1, 2, ..., is this rank's slice of global eval batch i (a fixed order, the
    same on any world size and whatever the training step); `num_batches` is how many there are (None:
    unbounded). Synthetic data holds out a stream of its own (batch i seeded by "data.eval.<i>"); data=custom
    reads data.eval or data.eval_fraction (parallel/data/custom/evaluation.py); data=shards has none.
    """
    if cfg.name == "synthetic":
        return SyntheticData(cfg, seed, batch_size, dp_rank, dp_size, stream="data.eval.")
    if cfg.name == "custom":
        return build_custom_eval(cfg, seed, batch_size, dp_rank, dp_size)
    return None


def has_eval_data(cfg: DataConfig) -> bool:
    """Whether `build_eval_data` gives eval data for this configuration (checked before workers start)."""
    custom = cfg.name == "custom" and bool(cfg.eval_fraction or (cfg.eval or {}).get("_target_"))
    return cfg.name == "synthetic" or custom


def example_target(d: DataConfig, batch: int = 2, spec: DataSpec | None = None) -> torch.Tensor:
    """Real targets of `batch` samples of the task, as the data source hands them out (random); `spec`: what
    validation read from data=custom (Note [data spec])."""
    g = torch.Generator().manual_seed(0)
    if d.name == "custom":  # shaped as the first sample's target
        spec = spec_of(d.name, spec).target
        shape, dtype = (batch, *spec["shape"]), getattr(torch, spec["dtype"])
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype)
        high = d.vocab_size if d.task == "lm" else d.classes
        return torch.randint(0, high, shape, generator=g).to(dtype)
    if d.task == "lm":
        return torch.randint(0, d.vocab_size, (batch, d.seq_len), generator=g)
    if d.task == "classification":
        return torch.randint(0, d.classes, (batch,), generator=g)
    return torch.randn(batch, d.targets, generator=g)


def planned_data(cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 spec: DataSpec | None = None) -> DataSource:
    """Batches of the configured shapes for the planner, which reads no dataset: synthetic ones, or zeros
    shaped as data=custom's first sample (`spec`, Note [data spec])."""
    if cfg.name == "custom":
        return _SpecData(cfg, spec_of(cfg.name, spec), batch_size // dp_size)
    return SyntheticData(cfg, seed, batch_size, dp_rank, dp_size)


class _SpecData:
    def __init__(self, cfg: DataConfig, spec: DataSpec, per_rank: int):
        self.cfg, self.spec, self.per_rank = cfg, spec, per_rank

    def batch(self, step: int, device: torch.device) -> tuple:
        target = self.spec.target
        y = torch.zeros(self.per_rank, *target["shape"], dtype=getattr(torch, target["dtype"]), device=device)
        return example_input(self.cfg, self.per_rank, device, spec=self.spec), y

    def close(self) -> None:
        """Nothing to stop."""


def example_input(d: DataConfig, batch: int = 2, device: str | torch.device = "meta", spec: DataSpec | None = None):
    """The model's input for `batch` samples, as the data source hands it out: a tensor of zeros, or for
    data=custom's fields by name a dict of them (Note [inputs by name] in parallel/tensors.py; a mask of
    ones), each of the first sample's shape and dtype (`spec`: what validation read from data=custom, Note
    [data spec] in parallel/data/spec.py; the other sources' shapes follow from `d`).
    `parallel.tensors.as_call` makes it the forward's arguments."""
    def zeros(spec: dict, ones: bool = False) -> torch.Tensor:
        fill = torch.ones if ones else torch.zeros
        return fill(batch, *spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)

    spec = spec_of(d.name, spec)
    if spec.named:
        return {k: zeros(field, "mask" in k) for k, field in spec.named.items()}
    if spec.input is not None:
        return zeros(spec.input)
    if d.task == "lm" or d.inputs == "tokens":
        return torch.zeros(batch, d.seq_len, dtype=torch.long, device=device)
    return torch.zeros(batch, d.features, device=device)


def read_hints(d) -> tuple[dict, DataSpec]:
    """The task and sizes a dataset sets before interpolations resolve (data=shards: its manifest; data=custom:
    its first sample), and what else validation reads from it (data=custom's DataSpec: Note [data spec]);
    nothing for synthetic data."""
    if d.name == "shards":
        if not d.path:
            fail("data.path", d.path, "data=shards needs the dataset directory",
                 "a directory written by launch/make_shards.py")
        return read_shard_hints(d.path), DataSpec()
    if d.name == "custom":
        return read_custom_hints(d)
    return {}, DataSpec()


def vocab_is_bound(d: DataConfig) -> bool:
    """Whether data.vocab_size is only a lower bound on the model's vocabulary (the largest token id + 1 of
    data=shards written without a tokenizer: Note [vocabulary bound] in parallel/data/shards/manifest.py), so
    that a wider model's output fits. Synthetic data's (its ids' range) and data=custom's (set, or stated by
    the dataset) are exact, as is a tokenizer's."""
    return d.name == "shards" and d.task == "lm" and shard_vocab_is_bound(d.path)


def check_data(d: DataConfig, batch_size: int, eval_every: int = 0, spec: DataSpec | None = None) -> None:
    """The data group's settings (and, for data=shards, the dataset's files; for data=custom, its size and
    evaluation data, from `spec`)."""
    if d.name not in SOURCES:
        fail("data.name", d.name, "unknown data source", list(SOURCES))
    if d.name == "shards":
        check_shards(d)
    if d.name == "custom":
        check_custom(d, spec_of(d.name, spec), batch_size, eval_every)
    elif d.eval_fraction or (d.eval or {}).get("_target_"):
        fail("data.eval_fraction" if d.eval_fraction else "data.eval", d.eval_fraction or dict(d.eval),
             "evaluation datasets are for data=custom")
    if d.task not in TASKS:
        fail("data.task", d.task, "unknown task", list(TASKS))
    if d.inputs not in ("features", "tokens"):
        fail("data.inputs", d.inputs, "unknown kind of input", ["features", "tokens"])
    if d.inputs == "tokens" and d.name == "shards":
        fail("data.inputs", d.inputs, "data=shards feeds what its manifest says; data.inputs is for synthetic data")
    # data=custom leaves the sizes its task does not use at 0 (not read from the dataset).
    used = {"regression": "targets", "classification": "classes", "lm": "vocab_size"}
    for key in ("features", "targets", "classes", "vocab_size", "seq_len"):
        unused = d.name == "custom" and key in used.values() and key != used[d.task]
        positive(f"data.{key}", getattr(d, key), allow_zero=unused)
    if d.noise < 0:
        fail("data.noise", d.noise, "must be >= 0")


__all__ = ["DataSource", "DataSpec", "IterData", "MapData", "ShardData", "SyntheticData", "build_data",
           "build_eval_data", "check_data", "example_input", "example_target", "has_eval_data", "planned_data",
           "read_hints", "vocab_is_bound"]
