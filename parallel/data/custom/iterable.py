"""Reading an iterable data=custom dataset: positions in the stream owned by (step, rank), the stream's state
kept for checkpoints (Note [custom data] in parallel/data/custom/__init__.py)."""
from __future__ import annotations

import logging
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from parallel.config import DataConfig
from parallel.data.custom.dataset import Collate, build_dataset, collate_of
from parallel.data.custom.loader import _Reader
from parallel.data.custom.split import Parts, ShardPlan, interleave, interleave_rows, merge_states, shard_count
from parallel.tensors import to_device

log = logging.getLogger("parallel")


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
    """This rank's slice of each step's global batch of an iterable dataset (Note [custom data]).

    A stream that splits into shards (`n_shards` > 1 and `shard`) is read in parts: this rank's shards only
    (when the data-parallel size divides the shard count), by up to `data.workers` loader processes whose
    parts are put back in order here. Any other stream is read whole by one loader process (data.workers > 0;
    two would each see the whole stream only if the dataset does not split itself among loader workers,
    which torch's docs teach) or in this process (data.workers=0).

    `state_dict` / `load_state_dict` carry the stream's state after the last steps into checkpoints, for a
    dataset that has them (a split stream: every shard's, gathered from the ranks that read them).

    Args:
        key: the config key that names the dataset (for messages).
    """

    def __init__(self, cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 dataset: Any = None, key: str = "data._target_"):
        super().__init__(cfg, seed)
        self.dataset = build_dataset(key, cfg._target_, cfg.args) if dataset is None else dataset
        self.batch_size = batch_size
        per_rank = batch_size // dp_size
        self.lo, self.hi = dp_rank * per_rank, (dp_rank + 1) * per_rank
        self.collate: Collate = collate_of(cfg)
        self.states: dict[int, dict] = {}  # step -> the stream's state after it (the last few)
        self._resume: dict[int, dict] = {}
        shards = shard_count(self.dataset)
        self.plan = ShardPlan(shards, dp_size, dp_rank, cfg.workers) if shards > 1 else None
        if self.plan is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            _say_plan(self.plan, key)

    def _loader(self, step: int, device: torch.device) -> DataLoader | Iterator:
        if self.plan is not None:
            return self._parts(step, device)
        stream = _Stream(self.dataset, self.collate, self.batch_size, self.lo, self.hi, step,
                         self._resume.get(step - 1))
        return DataLoader(stream, batch_size=None, collate_fn=_as_is,
                          **self._options(min(1, self.cfg.workers), device))

    def _parts(self, step: int, device: torch.device) -> Iterator:
        """The batches of a split stream from `step` on: each reader's part of each step, put in order."""
        plan, B = self.plan, self.batch_size
        resume = self._resume.get(step - 1) or {}
        # The readers collate their parts when the batch is theirs alone, or its rows can be put back in order
        # (torch's default_collate stacks samples); a user's collate function gets the samples in order here.
        rows = plan.readers == 1 or self.collate.user is None
        parts = Parts(self.dataset, plan, B, step, resume.get("shards"), self.collate if rows else None)
        workers = plan.readers if self.cfg.workers else 0
        it = iter(DataLoader(parts, batch_size=None, collate_fn=_as_is, in_order=True,
                             **self._options(workers, device)))
        while True:
            # An iterable dataset's loader asks its workers in turn and returns their items in that order
            # (in_order): item i of each step is worker i's part; checked, as the order of samples rests on it.
            got = [next(it) for _ in range(plan.readers)]
            if [g[0] for g in got] != list(range(plan.readers)):
                raise RuntimeError(f"data: the loader's parts came from workers {[g[0] for g in got]}, not in turn")
            kept = plan.kept((step - 1) * B, step * B)
            if plan.readers == 1:
                x, y = got[0][1]
            else:
                x, y = interleave_rows(plan, kept, [g[1] for g in got]) if rows else \
                    self.collate(interleave(plan, kept, [g[1] for g in got]))
            shards = {s: st for g in got if g[2] is not None for s, st in g[2].items()}
            yield x, y, {"position": step * B, "shards": shards} if got[0][2] is not None else None
            step += 1

    def batch(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch of `step`, on `device`; the next ones load meanwhile."""
        x, y, state = self._fetch(step, device)
        if state is not None:
            self.states[step] = state
            for old in [k for k in self.states if k < step - 2]:
                del self.states[old]
        return to_device(x, device), y.to(device)

    def state_dict(self) -> dict | None:
        """The stream's state after each of the last steps read (None: the dataset keeps none). A split
        stream's holds every shard's state, gathered from the ranks (collective: every rank calls it)."""
        if self.plan is None or not self.states or not dist.is_initialized() or dist.get_world_size() == 1:
            return {"states": dict(self.states)} if self.states else None
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, self.states)
        return {"states": merge_states(every)}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's states: the next start at step k+1 resumes the stream at its state after step k."""
        self._resume = dict(state["states"])


def _say_plan(plan: ShardPlan, key: str) -> None:
    """Log how a split stream is read, once (rank 0): a warning when the ranks cannot read disjoint shards."""
    if not plan.disjoint:
        log.warning("%s: the stream's %d shards cannot be split among %d data-parallel ranks (%d does not divide "
                    "%d): each rank reads %d of them and keeps its own positions, correct but not faster "
                    "(Note [custom data])", key, plan.shards, plan.ranks, plan.ranks, plan.shards, len(plan.mine))
    if plan.workers > 1 and plan.readers != plan.workers:
        log.info("%s: data.workers=%d, but a rank's %d shards are read by %d loader processes (the largest "
                 "divisor of %d not above %d)", key, plan.workers, len(plan.mine), plan.readers, len(plan.mine),
                 plan.workers)
