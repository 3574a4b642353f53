"""A map-style dataset whose samples cost real CPU time to make: the one benchmarks/dataloading.py loads through
data=custom and through a hand-written DataLoader loop (importable by both, and by their loader processes);
and the same samples as a stream, whole or split into shards (`--mode stream`)."""
from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset


class Costly(Dataset):
    """`n` samples of `features` floats and `targets` regression targets; sample i is built from a generator
    seeded by i by `rounds` passes of elementwise math over `work` floats (~`rounds` x `work` x 20 ns), as a
    decode or an augmentation would cost."""

    def __init__(self, n: int = 8192, features: int = 256, targets: int = 4, work: int = 4096, rounds: int = 8):
        self.n, self.features, self.targets, self.work, self.rounds = n, features, targets, work, rounds
        self.teacher = np.random.default_rng(0).standard_normal((features, targets)).astype(np.float32)
        self.teacher /= features ** 0.5

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        v = np.random.default_rng(i).standard_normal(self.work)
        for _ in range(self.rounds):
            v = np.tanh(np.sin(v) * 1.5 + np.cos(v * 0.5))
        x = v[:self.features].astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(x @ self.teacher)


def costly(n: int = 8192, features: int = 256, targets: int = 4, work: int = 4096, rounds: int = 8) -> Costly:
    return Costly(n, features, targets, work, rounds)


def sample_cost_s(ds: Costly, samples: int = 200) -> float:
    """Seconds one sample takes to make, in this process."""
    t0 = time.perf_counter()
    for i in range(samples):
        ds[i]
    return (time.perf_counter() - t0) / samples


class CostlyStream(IterableDataset):
    """Costly's samples as a stream, sample p at position p, `n` a pass (a stream that does not split: every
    rank reads it whole)."""

    def __init__(self, n: int = 8192, features: int = 256, targets: int = 4, work: int = 4096, rounds: int = 8,
                 positions: range | None = None):
        self.samples = Costly(n, features, targets, work, rounds)
        self.positions = range(n) if positions is None else positions

    def __iter__(self):
        for i in self.positions:
            yield self.samples[i]


class ShardedCostlyStream(CostlyStream):
    """The same stream split into `n_shards` shards: shard s holds samples s, s + S, s + 2S, ..., so the split
    order (position p: element p // S of shard p mod S) is again sample p at position p."""

    def __init__(self, shards: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.n_shards = shards

    def shard(self, num_shards: int, index: int) -> CostlyStream:
        c = self.samples
        return CostlyStream(c.n, c.features, c.targets, c.work, c.rounds, self.positions[index::num_shards])


def costly_stream(shards: int = 4, n: int = 8192, features: int = 256, targets: int = 4, work: int = 4096,
                  rounds: int = 8) -> CostlyStream:
    """The costly samples as a stream: split into `shards` shards (1: a stream without `shard`)."""
    kwargs = {"n": n, "features": features, "targets": targets, "work": work, "rounds": rounds}
    return ShardedCostlyStream(shards, **kwargs) if shards > 1 else CostlyStream(**kwargs)
