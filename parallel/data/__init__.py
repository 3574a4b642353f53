"""Data sources: each yields this rank's slice of the global batch for a step."""
from __future__ import annotations

from typing import Protocol

import torch

from parallel.config import TASKS, DataConfig, fail, positive
from parallel.data.shards import ShardData, check_shards
from parallel.data.synthetic import SyntheticData


class DataSource(Protocol):
    """What the trainer reads: this rank's slice of the global batch of a step (a function of (seed, step),
    so any step can be read on any world size), and `close` to stop any reader threads."""

    def batch(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]: ...

    def close(self) -> None: ...


def build_data(cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> DataSource:
    """The configured source: SyntheticData, or ShardData for data=shards."""
    if cfg.name == "shards":
        return ShardData(cfg, seed, batch_size, dp_rank, dp_size)
    return SyntheticData(cfg, seed, batch_size, dp_rank, dp_size)


def build_eval_data(cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0,
                    dp_size: int = 1) -> DataSource | None:
    """The eval data (Note [evaluation] in parallel/evaluation.py), or None when the configuration has none.

    Its `batch(i, device)`, i = 1, 2, ..., is this rank's slice of eval batch i (a fixed order, whatever the
    training step or the world size); `num_batches` is how many there are (None: unbounded). Synthetic data
    holds out a stream of its own (batch i seeded by "data.eval.<i>"); data=shards has none.
    """
    if cfg.name == "synthetic":
        return SyntheticData(cfg, seed, batch_size, dp_rank, dp_size, stream="data.eval.")
    return None


def has_eval_data(cfg: DataConfig) -> bool:
    """Whether `build_eval_data` gives eval data for this configuration (checked before workers start)."""
    return cfg.name == "synthetic"


def example_target(d: DataConfig, batch: int = 2) -> torch.Tensor:
    """Real targets of `batch` samples of the task, as the data source hands them out (random)."""
    g = torch.Generator().manual_seed(0)
    if d.task == "lm":
        return torch.randint(0, d.vocab_size, (batch, d.seq_len), generator=g)
    if d.task == "classification":
        return torch.randint(0, d.classes, (batch,), generator=g)
    return torch.randn(batch, d.targets, generator=g)


def example_input(d: DataConfig, batch: int = 2, device: str | torch.device = "meta") -> tuple:
    """The model's positional inputs for `batch` samples, as the data source hands them out (zeros)."""
    if d.task == "lm" or d.inputs == "tokens":
        return (torch.zeros(batch, d.seq_len, dtype=torch.long, device=device),)
    return (torch.zeros(batch, d.features, device=device),)


def check_data(d: DataConfig) -> None:
    """The data group's settings (and, for data=shards, the dataset's files)."""
    if d.name not in ("synthetic", "shards"):
        fail("data.name", d.name, "unknown data source", ["synthetic", "shards"])
    if d.name == "shards":
        check_shards(d)
    if d.task not in TASKS:
        fail("data.task", d.task, "unknown task", list(TASKS))
    if d.inputs not in ("features", "tokens"):
        fail("data.inputs", d.inputs, "unknown kind of input", ["features", "tokens"])
    if d.inputs == "tokens" and d.name == "shards":
        fail("data.inputs", d.inputs, "data=shards feeds what its manifest says; data.inputs is for synthetic data")
    for key in ("features", "targets", "classes", "vocab_size", "seq_len"):
        positive(f"data.{key}", getattr(d, key))
    if d.noise < 0:
        fail("data.noise", d.noise, "must be >= 0")


__all__ = ["DataSource", "ShardData", "SyntheticData", "build_data", "build_eval_data", "check_data",
           "example_input", "example_target", "has_eval_data"]
