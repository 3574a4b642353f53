"""Streams read in disjoint parts: which shard and element each position of a splittable stream is, which
rank and loader worker reads which shard, and each shard read as a cycle of its own (Note [custom data] in
parallel/data/custom/__init__.py)."""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import IterableDataset, get_worker_info

from parallel.config import error_text, fail


def shard_count(ds: Any) -> int:
    """S, the shards a stream splits into: its `n_shards` when that is an int > 1 and it has a callable
    `shard(num_shards, index)` (a Hugging Face datasets.IterableDataset has both); 1 otherwise (read whole)."""
    n = getattr(ds, "n_shards", None)
    if isinstance(n, int) and not isinstance(n, bool) and n > 1 and callable(getattr(ds, "shard", None)):
        return n
    return 1


def check_split(key: str, target: Any, ds: Any) -> int:
    """A stream's shard count (`shard_count`), after checking that a stream with `n_shards` and `shard` gives
    a positive int count and an iterable shard; raises ConfigError naming `key` otherwise."""
    if not (hasattr(ds, "n_shards") and hasattr(ds, "shard")):
        return 1
    n = getattr(ds, "n_shards")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        fail(key, target, f"the stream's n_shards is {n!r}: it must be a positive int (its shard count)")
    if n == 1:
        return 1
    try:
        piece = ds.shard(n, 0)
    except Exception as e:  # noqa: BLE001 - the user's method
        fail(key, target, f"the stream's shard({n}, 0) failed: {error_text(e)}")
    if not isinstance(piece, Iterable):
        fail(key, target, f"the stream's shard({n}, 0) returned a {type(piece).__name__}, not an iterable "
             "(each shard is read as a stream of its own)")
    return n


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` not above `at_most` (at least 1)."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


@dataclass(frozen=True)
class ShardPlan:
    """Who reads what of a stream of `shards` shards (Note [custom data]).

    Position p of the global order is element p // S of shard p mod S. Data-parallel rank r of R owns the
    positions p of each step with p mod R == r (in order); it reads the shards s with s mod g == r mod g,
    g = gcd(R, S): only its own when R divides S (g = R), else shared with R / g - 1 other ranks. Its loader
    workers (`workers`, data.workers; 0: this process alone) take its shards in turn: the m-th goes to worker
    m mod `readers`, `readers` the largest divisor of the rank's shard count not above `workers`.
    """

    shards: int
    ranks: int = 1
    rank: int = 0
    workers: int = 0

    @property
    def group(self) -> int:
        return math.gcd(self.ranks, self.shards)

    @property
    def disjoint(self) -> bool:
        """Whether each shard is read by one rank only."""
        return self.group == self.ranks

    @cached_property
    def mine(self) -> list[int]:
        """The shards this rank reads, in order."""
        return [s for s in range(self.shards) if s % self.group == self.rank % self.group]

    @property
    def readers(self) -> int:
        """How many processes read this rank's shards: its loader workers (1: this process, or one worker)."""
        return largest_divisor(len(self.mine), max(1, self.workers))

    def worker_shards(self, worker: int) -> list[int]:
        return self.mine[worker::self.readers]

    @cached_property
    def _readers_of(self) -> dict[int, int]:
        return {s: m % self.readers for m, s in enumerate(self.mine)}

    def reader_of(self, shard: int) -> int:
        return self._readers_of[shard]

    def kept(self, begin: int, end: int) -> list[int]:
        """This rank's positions among begin..end-1."""
        first = begin + (self.rank - begin) % self.ranks
        return list(range(first, end, self.ranks))

    def consumed(self, position: int, shard: int) -> int:
        """How many elements of `shard` the positions before `position` take."""
        return max(0, -(-(position - shard) // self.shards))


def locate(position: int, shards: int) -> tuple[int, int]:
    """(shard, element) of a position of the global order."""
    return position % shards, position // shards


def interleave(plan: ShardPlan, kept: list[int], parts: list[list]) -> list:
    """This rank's samples of `kept` in their order, from each reader's part (its samples in that order)."""
    each = [iter(p) for p in parts]
    return [next(each[plan.reader_of(p % plan.shards)]) for p in kept]


def interleave_rows(plan: ShardPlan, kept: list[int], parts: list[tuple[torch.Tensor, ...]]) -> tuple:
    """`interleave` for parts collated row by row (each reader's (inputs, targets), a row a sample; inputs by
    name are a dict of such tensors: Note [inputs by name] in parallel/tensors.py)."""
    flat = [tree_flatten(part) for part in parts]
    offsets, order = 0, []
    for leaves, _ in flat:
        order.append(range(offsets, offsets + len(leaves[0])))
        offsets += len(leaves[0])
    index = torch.tensor(interleave(plan, kept, order), dtype=torch.long)
    merged = [torch.cat(column)[index] for column in zip(*(leaves for leaves, _ in flat))]
    return tree_unflatten(merged, flat[0][1])


def merge_states(per_rank: list[dict]) -> dict:
    """The states of every shard after each step, from each rank's states of its own shards ({step:
    {"position", "shards": {shard: state}}}); only the steps every rank knew are kept."""
    merged: dict[int, dict] = {}
    for states in per_rank:
        for step, state in states.items():
            merged.setdefault(step, {"position": state["position"], "shards": {}})["shards"].update(state["shards"])
    every = set.intersection(*(set(s) for s in per_rank)) if per_rank else set()
    return {step: merged[step] for step in sorted(every)}


def samples_of(shard: Any) -> Iterator:
    """The samples of one shard object, all of them, in whatever process reads it.

    A Hugging Face IterableDataset iterated in a DataLoader worker splits itself among the workers by
    torch's get_worker_info (a one-shard dataset then yields nothing in workers 1..W-1); its public batch
    iterator `iter(batch_size=1)` does not, and each one-sample batch is unbatched here. Any other object is
    iterated as it is (a user's stream must not split itself by worker: each shard is one worker's).
    """
    module = sys.modules.get("datasets")
    if module is None or not isinstance(shard, module.IterableDataset):
        yield from shard
        return
    for batch in shard.iter(batch_size=1):
        if not isinstance(batch, Mapping):
            raise RuntimeError(f"data._target_: the Hugging Face stream's batches are {type(batch).__name__}s, "
                               "not dicts: give it the torch, numpy or python format")
        yield {k: v[0] for k, v in batch.items()}


class ShardCycle:
    """One shard of the stream read as a cycle of its own: at its end it starts again, its epoch counted
    and `set_epoch(epoch)` called when it has one; `element` counts the elements read, over all epochs.

    Args:
        piece: the shard object (the stream's `shard(S, s)`).
        state: a saved `state()` (None: the shard's start).
    """

    def __init__(self, piece: Any, state: dict | None = None):
        self.piece, self.element, self.epoch = piece, 0, 0
        self.stateful = hasattr(piece, "state_dict") and hasattr(piece, "load_state_dict")
        if state is not None:
            piece.load_state_dict(state["dataset"])
            self.element, self.epoch = state["element"], state["epoch"]
        if self.epoch and hasattr(piece, "set_epoch"):
            piece.set_epoch(self.epoch)
        self._it: Iterator | None = None
        self._count, self._resumed = 0, state is not None

    def next(self) -> Any:
        while True:
            if self._it is None:
                self._it, self._count = samples_of(self.piece), 0
            try:
                sample = next(self._it)
            except StopIteration:
                if self._count == 0 and not self._resumed:  # a resumed epoch may have had nothing left
                    raise RuntimeError(f"data._target_: a shard of the stream yielded no samples (epoch "
                                       f"{self.epoch})") from None
                self._it, self._resumed, self.epoch = None, False, self.epoch + 1
                if hasattr(self.piece, "set_epoch"):
                    self.piece.set_epoch(self.epoch)
                continue
            self._count, self.element = self._count + 1, self.element + 1
            return sample

    def state(self) -> dict:
        return {"element": self.element, "epoch": self.epoch, "dataset": self.piece.state_dict()}


class Parts(IterableDataset):
    """One reader's part of this rank's samples of each step from `first` on: (reader, samples in position
    order, its shards' states after the step or None). Reader w is loader worker w (or this process).
    With `collate`, the part comes collated (sending a few batched tensors from a loader process costs far
    less than one shared tensor per sample).

    Each of the reader's shards starts at its state after step `first - 1` (`states`, a checkpoint's), or is
    read from its start and its elements before that step dropped (only its reader reads them).
    """

    def __init__(self, dataset: Any, plan: ShardPlan, batch_size: int, first: int, states: dict | None,
                 collate: Callable | None = None):
        self.dataset, self.plan, self.batch_size, self.first, self.states = dataset, plan, batch_size, first, states
        self.collate = collate

    def _open(self, reader: int) -> dict[int, ShardCycle]:
        plan, begin = self.plan, (self.first - 1) * self.batch_size
        cycles = {}
        for s in plan.worker_shards(reader):
            cycle = ShardCycle(self.dataset.shard(plan.shards, s), (self.states or {}).get(s))
            if cycle.element > plan.consumed(begin, s):
                raise RuntimeError(f"data: the saved state of shard {s} is past step {self.first - 1}")
            for _ in range(plan.consumed(begin, s) - cycle.element):
                cycle.next()
            cycles[s] = cycle
        return cycles

    def __iter__(self):
        info = get_worker_info()
        reader = 0 if info is None else info.id
        plan, B, step = self.plan, self.batch_size, self.first
        cycles = self._open(reader)
        stateful = all(c.stateful for c in cycles.values())
        while True:
            part = []
            for p in range((step - 1) * B, step * B):
                cycle = cycles.get(p % plan.shards)
                if cycle is not None:
                    sample = cycle.next()
                    if p % plan.ranks == plan.rank:
                        part.append(sample)
            yield (reader, part if self.collate is None else self.collate(part),
                   {s: c.state() for s, c in cycles.items()} if stateful else None)
            step += 1
