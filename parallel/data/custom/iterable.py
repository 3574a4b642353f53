"""Reading an iterable data=custom dataset: positions in the stream owned by (step, rank), the stream's state
kept for checkpoints (Note [custom data] in parallel/data/custom/__init__.py)."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from parallel.config import DataConfig
from parallel.data.custom.dataset import Collate, build_dataset, collate_of
from parallel.data.custom.loader import _Reader


def _as_is(batch):
    return batch


class _Stream(IterableDataset):
    """This rank's batch of each step from `first` on, read from the user's stream in order (in the loader
    process): position p is step p // B + 1's, and this rank keeps positions lo..hi-1 of each step's B. Each
    batch comes with the stream's state after its step (None when the dataset has no `state_dict`).

    Args:
        state: the state after step `first - 1` (a checkpoint's): the stream resumes there; None: the
            positions of the steps before `first` are read and dropped.
    """

    def __init__(self, dataset: Any, collate: Collate, batch_size: int, lo: int, hi: int, first: int,
                 state: dict | None):
        self.dataset, self.collate, self.batch_size = dataset, collate, batch_size
        self.lo, self.hi, self.first, self.state = lo, hi, first, state

    def _samples(self, position: int, epoch: int) -> Iterator[tuple[int, int, Any]]:
        """(position, epoch, sample) from `position` on; the stream is iterated again at its end."""
        ds = self.dataset
        while True:
            count = 0
            for sample in ds:
                yield position, epoch, sample
                position, count = position + 1, count + 1
            if count == 0:
                raise RuntimeError(f"data._target_: the iterable dataset yielded no samples (epoch {epoch})")
            epoch += 1
            if hasattr(ds, "set_epoch"):
                ds.set_epoch(epoch)

    def __iter__(self):
        ds, B = self.dataset, self.batch_size
        stateful = hasattr(ds, "state_dict") and hasattr(ds, "load_state_dict")
        position, epoch = 0, 0
        if self.state is not None and stateful:
            ds.load_state_dict(self.state["dataset"])
            position, epoch = self.state["position"], self.state["epoch"]
        if epoch and hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        samples = self._samples(position, epoch)
        step = self.first
        while True:
            begin, mine = (step - 1) * B, []
            end = step * B
            while position < end:  # this step's B positions (and, on a fresh start, those before it)
                p, epoch, sample = next(samples)
                if begin + self.lo <= p < begin + self.hi:
                    mine.append(sample)
                position = p + 1
            state = {"position": end, "epoch": epoch, "dataset": ds.state_dict()} if stateful else None
            yield (*self.collate(mine), state)
            step += 1


class IterData(_Reader):
    """This rank's slice of each step's global batch of an iterable dataset (Note [custom data]), read by
    one loader process (data.workers > 0; two would each see the whole stream only if the dataset does not
    split itself among loader workers, which torch's docs teach) or in this process (data.workers=0).

    `state_dict` / `load_state_dict` carry the stream's state after the last steps into checkpoints, for a
    dataset that has them.
    """

    def __init__(self, cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 dataset: Any = None):
        super().__init__(cfg, seed)
        self.dataset = build_dataset("data._target_", cfg._target_, cfg.args) if dataset is None else dataset
        self.batch_size = batch_size
        per_rank = batch_size // dp_size
        self.lo, self.hi = dp_rank * per_rank, (dp_rank + 1) * per_rank
        self.collate: Collate = collate_of(cfg)
        self.states: dict[int, dict] = {}  # step -> the stream's state after it (the last few)
        self._resume: dict[int, dict] = {}

    def _loader(self, step: int, device: torch.device) -> DataLoader:
        stream = _Stream(self.dataset, self.collate, self.batch_size, self.lo, self.hi, step,
                         self._resume.get(step - 1))
        return DataLoader(stream, batch_size=None, collate_fn=_as_is,
                          **self._options(min(1, self.cfg.workers), device))

    def batch(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch of `step`, on `device`; the next ones load meanwhile."""
        x, y, state = self._fetch(step, device)
        if state is not None:
            self.states[step] = state
            for old in [k for k in self.states if k < step - 2]:
                del self.states[old]
        return x.to(device), y.to(device)

    def state_dict(self) -> dict | None:
        """The stream's state after each of the last steps read (None: the dataset keeps none)."""
        return {"states": dict(self.states)} if self.states else None

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's states: the next start at step k+1 resumes the stream at its state after step k."""
        self._resume = dict(state["states"])
