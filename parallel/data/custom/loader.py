"""Reading a data=custom dataset: this rank's share of each step's global batch, loaded ahead of the step
(Note [custom data] in parallel/data/custom/__init__.py)."""
from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from parallel.config import DataConfig
from parallel.data.custom.dataset import Collate, build_dataset, collate_of
from parallel.data.custom.probe import held_out_count
from parallel.init import name_seed
from parallel.tensors import to_device


def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, held-out indices) of `n` samples, each in the dataset's order: data.eval_fraction
    of them drawn by the seed alone (the same on any world size, never trained on)."""
    held = held_out_count(n, fraction)
    if held == 0:
        return np.arange(n), np.arange(0)
    out = np.random.default_rng(name_seed(seed, "data.custom.held_out")).permutation(n)[:held]
    keep = np.ones(n, dtype=bool)
    keep[out] = False
    return np.flatnonzero(keep), np.sort(out)


class MapOrder:
    """The dataset indices of the global batch of each step: epochs of `indices` permuted by (seed, epoch)
    (in their own order without `shuffle`), cut into global batches; an epoch's tail shorter than a global
    batch is dropped, so no batch mixes two epochs and every sample is seen at most once an epoch.

    Args:
        indices: the dataset indices to visit (those not held out).
        seed, batch_size: the run's seed and global batch.
        shuffle: permute each epoch.
    """

    def __init__(self, indices: np.ndarray, seed: int, batch_size: int, shuffle: bool):
        self.indices, self.seed, self.batch_size, self.shuffle = indices, seed, batch_size, shuffle
        self.per_epoch = len(indices) // batch_size
        self._epoch: tuple[int, np.ndarray] | None = None  # the last epoch's order, kept

    def epoch_order(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            order = self.indices
            if self.shuffle:
                rng = np.random.default_rng(name_seed(self.seed, f"data.custom.epoch.{epoch}"))
                order = self.indices[rng.permutation(len(self.indices))]
            self._epoch = (epoch, order)
        return self._epoch[1]

    def global_batch(self, step: int) -> np.ndarray:
        """The dataset indices of the global batch of `step` (from 1)."""
        epoch, j = divmod(step - 1, self.per_epoch)
        return self.epoch_order(epoch)[j * self.batch_size:(j + 1) * self.batch_size]


class _Steps:
    """The loader's batch sampler: this rank's indices of each step from `first` on (endless; the loader
    stops with the run)."""

    def __init__(self, order: MapOrder, lo: int, hi: int, first: int):
        self.order, self.lo, self.hi, self.first = order, lo, hi, first

    def __iter__(self) -> Iterator[list[int]]:
        step = self.first
        while True:
            yield self.order.global_batch(step)[self.lo:self.hi].tolist()
            step += 1


class _Reader:
    """What map-style and iterable sources share: a torch DataLoader started at the step asked for (again
    when a step out of sequence is asked: a resume), its batches moved to the device, the wait timed."""

    num_batches: int | None = None  # an evaluation source's count of whole batches (None: unbounded)

    def __init__(self, cfg: DataConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self._iter, self._next = None, None
        self.wait_s = 0.0

    def _loader(self, step: int, device: torch.device) -> DataLoader:
        raise NotImplementedError

    def _fetch(self, step: int, device: torch.device):
        if self._next != step:
            self.close()
            self._iter = iter(self._loader(step, device))
        t0 = time.perf_counter()
        got = next(self._iter)
        self.wait_s += time.perf_counter() - t0
        self._next = step + 1
        return got

    def _options(self, workers: int, device: torch.device) -> dict:
        # The loader's own generator seeds its workers (base seed drawn from it): drawing from the global
        # one would move the training's random stream by a number at every (re)start.
        g = torch.Generator().manual_seed(name_seed(self.seed, "data.custom.loader"))
        return {"num_workers": workers, "prefetch_factor": max(1, self.cfg.prefetch) if workers else None,
                "persistent_workers": workers > 0, "pin_memory": device.type == "cuda", "generator": g}

    def close(self) -> None:
        """Stop the loader's worker processes (dropping the iterator shuts them down)."""
        self._iter, self._next = None, None


class MapData(_Reader):
    """This rank's slice of each step's global batch of a map-style dataset, loaded by `data.workers` loader
    processes (0: in this process) `data.prefetch` batches ahead each.

    Args:
        cfg: the data config (resolved: keys and sizes set from the first sample).
        seed, batch_size: the run's seed and global batch.
        dp_rank, dp_size: this rank's place among the data-parallel ranks.
        dataset, indices, shuffle: for evaluation (parallel.data.custom.evaluation): another dataset or the
            held-out indices, in their order; default: the training set, shuffled as data.shuffle says.
    """

    def __init__(self, cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 dataset: Any = None, indices: np.ndarray | None = None, shuffle: bool | None = None):
        super().__init__(cfg, seed)
        self.dataset = build_dataset("data._target_", cfg._target_, cfg.args) if dataset is None else dataset
        if indices is None:
            indices = split_indices(len(self.dataset), cfg.eval_fraction, seed)[0]
        self.order = MapOrder(indices, seed, batch_size, cfg.shuffle if shuffle is None else shuffle)
        per_rank = batch_size // dp_size
        self.lo, self.hi = dp_rank * per_rank, (dp_rank + 1) * per_rank
        self.collate: Collate = collate_of(cfg)

    def indices(self, step: int) -> list[int]:
        """The dataset indices of this rank's samples at `step`."""
        return self.order.global_batch(step)[self.lo:self.hi].tolist()

    def _loader(self, step: int, device: torch.device) -> DataLoader:
        return DataLoader(self.dataset, batch_sampler=_Steps(self.order, self.lo, self.hi, step),
                          collate_fn=self.collate, **self._options(self.cfg.workers, device))

    def batch(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch of `step`, on `device`; the next ones load meanwhile."""
        x, y = self._fetch(step, device)
        blocking = device.type != "cuda"
        return to_device(x, device, non_blocking=not blocking), y.to(device, non_blocking=not blocking)
