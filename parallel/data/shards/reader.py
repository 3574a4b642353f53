"""Streaming a shard dataset: each rank reads its slice of every global batch, ahead of the step.

# Note [shard order]
The global batch of step k must not depend on the number of data-parallel
ranks, and any step must be reachable without replaying the ones before it
(resuming). So the order is a pure function of (seed, epoch), computed on
sample numbers, never on data:

    1. the shards are visited in an order permuted by (seed, epoch);
    2. that stream of samples is cut into windows of `data.shuffle_buffer`
       samples, and each window is permuted by (seed, epoch, window);
    3. the run reads the resulting sequence without gaps across epochs: step k
       (from 1) takes positions (k-1) x B ... k x B - 1 of it (B the global
       batch), and data-parallel rank r of d takes its contiguous B/d of them.

Memory is bounded by a few windows of sample numbers (8 bytes each; the 16
used last are kept) and the batches read ahead (`data.prefetch`), whatever
the dataset's size. A window
plays the part of a shuffle buffer: a sample moves at most a window from its
place in the shard-permuted stream.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from parallel.config import DataConfig
from parallel.data.shards.manifest import Manifest, ShardError
from parallel.init import name_seed


class ShardData:
    """This rank's slice of the global batch of each step, read from shards (Note [shard order]).

    Reader threads (`data.workers`) read the next `data.prefetch` batches while
    the current step trains; `wait_s` is the time `batch` spent waiting for them.

    Args:
        cfg: the data config (`path`, `shuffle_buffer`, `prefetch`, `workers`; task and sizes from the manifest).
        seed: the run's seed.
        batch_size: the global batch.
        dp_rank, dp_size: this rank's place among the data-parallel ranks.
    """

    def __init__(self, cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        self.cfg, self.seed, self.batch_size = cfg, seed, batch_size
        self.m = Manifest.load(cfg.path)
        self.m.input_shape()
        per_rank = batch_size // dp_size
        self.lo, self.hi = dp_rank * per_rank, (dp_rank + 1) * per_rank
        self.window = max(1, cfg.shuffle_buffer)
        self.x_dtype = torch.long if cfg.task == "lm" else torch.float32
        self.y_dtype = torch.float32 if cfg.task == "regression" else torch.long
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._orders: OrderedDict = OrderedDict()  # (epoch) -> shard order; (epoch, window) -> permutation
        self._pool = ThreadPoolExecutor(max(1, cfg.workers), thread_name_prefix="shards")
        self._pending: dict[int, Future] = {}
        self.wait_s = 0.0

    # -- order ---------------------------------------------------------------
    def _cached(self, key, make):
        with self._lock:
            if key in self._orders:
                self._orders.move_to_end(key)
                return self._orders[key]
        value = make()
        with self._lock:
            self._orders[key] = value
            while len(self._orders) > 16:  # a few windows: bounded memory
                self._orders.popitem(last=False)
        return value

    def _rng(self, *parts) -> np.random.Generator:
        return np.random.default_rng(name_seed(self.seed, "data.shards." + ".".join(map(str, parts))))

    def _shard_order(self, epoch: int) -> np.ndarray:
        n = len(self.m.shards)
        if self.window <= 1:
            return np.arange(n)
        return self._cached(("shards", epoch), lambda: self._rng("epoch", epoch).permutation(n))

    def _window_perm(self, epoch: int, w: int) -> np.ndarray:
        size = min(self.window, self.m.count - w * self.window)
        return self._cached(("window", epoch, w), lambda: self._rng("epoch", epoch, "window", w).permutation(size))

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions (0-based, across epochs) -> (shard index, row) of the samples there."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, q = np.divmod(positions, self.m.count)
        shard = np.empty_like(positions)
        row = np.empty_like(positions)
        for e in np.unique(epochs):
            sel = epochs == e
            qe = q[sel]
            if self.window > 1:
                w, off = np.divmod(qe, self.window)
                for wi in np.unique(w):
                    at = w == wi
                    qe[at] = wi * self.window + self._window_perm(int(e), int(wi))[off[at]]
            shard[sel], row[sel] = self.m.locate(self._shard_order(int(e)), qe)
        return shard, row

    def positions(self, step: int) -> np.ndarray:
        """This rank's stream positions at `step` (from 1)."""
        base = (step - 1) * self.batch_size
        return np.arange(base + self.lo, base + self.hi, dtype=np.int64)

    def sample_ids(self, step: int) -> np.ndarray:
        """The dataset indices (0..count-1, in write order) of this rank's samples at `step`."""
        shard, row = self.samples(self.positions(step))
        return self.m.starts[shard] + row

    # -- reading -------------------------------------------------------------
    def _fd(self, shard: int) -> int:
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                path = self.m.root / self.m.shards[shard]["file"]
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise ShardError(f"{path}: shard missing") from None
                self._fds[shard] = fd
            return fd

    def read(self, shard: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The records at (shard, row), in that order: one positioned read per run of neighbours."""
        n, size = len(shard), self.m.dtype.itemsize
        order = np.lexsort((row, shard))
        s, r = shard[order], row[order]
        got = np.empty(n, dtype=self.m.dtype)
        raw = got.view(np.uint8)
        cut = np.flatnonzero((np.diff(s) != 0) | (np.diff(r) != 1)) + 1
        for a, b in zip(np.r_[0, cut], np.r_[cut, n]):
            want = (b - a) * size
            done = os.preadv(self._fd(int(s[a])), [raw[a * size:b * size]], int(r[a]) * size)
            if done != want:
                path = self.m.root / self.m.shards[int(s[a])]["file"]
                raise ShardError(f"{path}: truncated (read {done} of {want} bytes at record {int(r[a])})")
        out = np.empty_like(got)
        out[order] = got
        return out

    def _load(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        records = self.read(*self.samples(self.positions(step)))
        n = len(records)
        if self.m.packed:  # a window of seq_len + 1 tokens: inputs and next-token targets (Note [shard format])
            tokens = torch.from_numpy(records["tokens"].astype(np.int64))
            return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        x = torch.from_numpy(np.ascontiguousarray(records["features"])).reshape(n, -1).to(self.x_dtype)
        y = torch.from_numpy(np.ascontiguousarray(records["targets"]))
        y = y.reshape(n) if self.cfg.task == "classification" else y.reshape(n, -1)
        return x, y.to(self.y_dtype)

    def batch(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch of `step`, on `device`; the next ones are read meanwhile."""
        for ahead in range(step, step + 1 + self.cfg.prefetch):
            if ahead not in self._pending:
                self._pending[ahead] = self._pool.submit(self._load, ahead)
        for old in [k for k in self._pending if k < step]:  # a step skipped (resumed elsewhere): drop it
            self._pending.pop(old).cancel()
        t0 = time.perf_counter()
        x, y = self._pending.pop(step).result()
        self.wait_s += time.perf_counter() - t0
        return x.to(device), y.to(device)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
