"""Datasets larger than RAM: fixed-size record shards on disk, streamed a batch at a time.

# Note [shard format]
A dataset is a directory:

    manifest.json      format, fields (name, dtype, shape), record size, sample
                       count, task hints, and the index: one row per shard
                       (file, first sample, count, bytes, crc32)
    shard-00000.bin    fixed-size records, back to back, no header
    shard-00001.bin    ...

Every sample has the same fields of the same shapes, so a record is one numpy
structured dtype and sample i of a shard starts at byte i x record size:
reading any sample is one positioned read (`os.preadv`, which releases the GIL,
so reader threads overlap the training step), runs of neighbouring samples are
one read, and there is nothing to decode. That is why this format and not tar
shards (WebDataset): those are read front to back, one member at a time, and
reading a given sample means scanning its shard; here each data-parallel rank
reads only its own samples, in any order the shuffle asks for. The manifest is
written last and atomically, so a directory without one is an unfinished
write; checksums (CRC-32 per shard) catch corrupt files, sizes truncated ones.

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

import json
import os
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from parallel.config import ConfigError, DataConfig, fail, positive
from parallel.init import name_seed
from parallel.units import parse_bytes

FORMAT = "parallel-shards"
VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_BYTES = 256 << 20


class ShardError(ValueError):
    """A shard that cannot be read as its manifest says (missing, truncated, corrupt); names the file."""


# ---------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------

class Manifest:
    """A dataset directory's manifest.json (Note [shard format])."""

    def __init__(self, root: Path, record: dict[str, Any]):
        self.root, self.record = root, record
        self.fields: list[dict] = record["fields"]
        self.dtype = np.dtype([(f["name"], np.dtype(f["dtype"]), tuple(f["shape"])) for f in self.fields])
        self.count: int = record["count"]
        self.shards: list[dict] = record["shards"]
        self.starts = np.cumsum([0] + [s["count"] for s in self.shards])

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Manifest":
        """Read and check the manifest of `path`; ConfigError naming `data.path` when there is none."""
        root = Path(path)
        if not root.is_dir():
            raise ConfigError(f"data.path={str(path)!r}: no such directory (write one with launch/make_shards.py)")
        file = root / MANIFEST
        if not file.is_file():
            raise ConfigError(f"data.path={str(path)!r}: holds no {MANIFEST} (not a dataset written by "
                              f"launch/make_shards.py, or its writing did not finish)")
        try:
            record = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"data.path={str(path)!r}: {MANIFEST} is not valid JSON ({e})") from None
        if record.get("format") != FORMAT or record.get("version") != VERSION:
            raise ConfigError(f"data.path={str(path)!r}: {MANIFEST} is not a {FORMAT} v{VERSION} manifest")
        m = cls(root, record)
        if m.count == 0:
            raise ConfigError(f"data.path={str(path)!r}: the dataset is empty (0 samples)")
        if m.dtype.itemsize != record["record_bytes"]:
            raise ConfigError(f"data.path={str(path)!r}: record size {record['record_bytes']} does not match "
                              f"its fields ({m.dtype.itemsize} bytes)")
        return m

    def field(self, name: str) -> dict:
        for f in self.fields:
            if f["name"] == name:
                return f
        raise ConfigError(f"data.path={str(self.root)!r}: samples have no field {name!r} "
                          f"(they have {[f['name'] for f in self.fields]}); training reads "
                          f"'features' and 'targets'")

    def check_files(self, checksums: bool, progress=None) -> None:
        """Every shard present with its size (and, with `checksums`, its CRC-32). Raises ShardError."""
        for i, s in enumerate(self.shards):
            path = self.root / s["file"]
            if not path.is_file():
                raise ShardError(f"{path}: shard missing")
            size = path.stat().st_size
            if size != s["bytes"]:
                raise ShardError(f"{path}: {size} bytes where the manifest says {s['bytes']} "
                                 f"({'truncated' if size < s['bytes'] else 'longer than written'})")
            if checksums:
                crc = _crc_file(path)
                if crc != s["crc32"]:
                    raise ShardError(f"{path}: corrupt (CRC-32 {crc:08x}, the manifest says {s['crc32']:08x})")
            if progress is not None:
                progress(i + 1, len(self.shards))

    def locate(self, order: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions `q` in the stream that visits shards in `order` -> (shard index, row)."""
        counts = np.array([self.shards[i]["count"] for i in order])
        ends = np.cumsum(counts)
        k = np.searchsorted(ends, q, side="right")
        rows = q - (ends[k] - counts[k])
        return order[k], rows


def read_hints(path: str | os.PathLike) -> dict:
    """The task and sizes the dataset's manifest sets (`data.task`, `data.features`, ...)."""
    m = Manifest.load(path)
    m.field("features"), m.field("targets")
    hints = m.record.get("hints") or {}
    if not hints:
        fail("data.path", str(path), "the manifest names no task for its features and targets")
    return hints


def check_shards(d: DataConfig) -> None:
    """data=shards' settings, and the dataset's files (sizes, or checksums with data.verify=checksum)."""
    positive("data.shuffle_buffer", d.shuffle_buffer, allow_zero=True)
    positive("data.prefetch", d.prefetch, allow_zero=True)
    positive("data.workers", d.workers)
    if d.verify not in ("size", "checksum"):
        fail("data.verify", d.verify, "unknown check", ["size", "checksum"])
    m = Manifest.load(d.path)
    x = m.field("features")
    if d.task != "lm" and len(x["shape"]) != 1:
        fail("data.path", d.path, f"features of shape {tuple(x['shape'])}: the built-in tasks take one "
             f"vector of features per sample", "shards written with features of shape (F,)")
    try:
        m.check_files(checksums=d.verify == "checksum")
    except ShardError as e:
        fail("data.path", d.path, str(e))


def _crc_file(path: Path, chunk: int = 8 << 20) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(chunk)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def _task_hints(fields: dict[str, dict], stats: dict[str, tuple[int, int]]) -> dict:
    """The training task the samples suggest, and its sizes (read into data.* by parallel.config)."""
    if "features" not in fields or "targets" not in fields:
        return {}
    x, y = fields["features"], fields["targets"]
    x_int, y_int = np.dtype(x["dtype"]).kind in "iu", np.dtype(y["dtype"]).kind in "iu"
    if x_int and y_int and x["shape"] == y["shape"] and len(x["shape"]) == 1:
        top = max(stats["features"][1], stats["targets"][1])
        return {"task": "lm", "seq_len": x["shape"][0], "vocab_size": int(top) + 1}
    features = int(np.prod(x["shape"]))
    if y_int and len(y["shape"]) == 0:
        return {"task": "classification", "features": features, "classes": int(stats["targets"][1]) + 1}
    return {"task": "regression", "features": features, "targets": int(np.prod(y["shape"]))}


# ---------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------

class ShardWriter:
    """Writes samples into fixed-size shards under `out` in bounded memory; `close()` writes the manifest.

    Args:
        out: the dataset directory (created; must not hold a dataset already).
        shard_size: samples per shard, or a size with a unit ("256MB") from which that count follows.
        chunk_bytes: how much is gathered in memory before it is written.
    """

    def __init__(self, out: str | os.PathLike, shard_size: int | str = DEFAULT_SHARD_BYTES,
                 chunk_bytes: int = 16 << 20):
        self.out = Path(out)
        if (self.out / MANIFEST).exists():
            raise ConfigError(f"out={str(out)!r}: holds a dataset already (remove it, or write elsewhere)")
        self.out.mkdir(parents=True, exist_ok=True)
        self.shard_size, self.chunk_bytes = shard_size, chunk_bytes
        self.dtype: np.dtype | None = None
        self.fields: dict[str, dict] = {}
        self.stats: dict[str, tuple[int, int]] = {}
        self.shards: list[dict] = []
        self.count = 0
        self._file = None
        self._buf: np.ndarray | None = None
        self._n = 0  # samples waiting in _buf

    def _start(self, sample: Mapping[str, Any]) -> None:
        arrays = {k: _as_array(v) for k, v in sample.items()}
        self.fields = {k: {"name": k, "dtype": a.dtype.str, "shape": list(a.shape)} for k, a in arrays.items()}
        self.dtype = np.dtype([(k, a.dtype, a.shape) for k, a in arrays.items()])
        if self.dtype.itemsize == 0:
            raise ConfigError("a sample of 0 bytes: nothing to write")
        size = self.shard_size
        rows = size if isinstance(size, int) else max(1, parse_bytes(size) // self.dtype.itemsize)
        if rows < 1:
            raise ConfigError(f"shard_size={size!r}: must be at least one sample")
        self.rows_per_shard = rows
        self._buf = np.empty(max(1, min(rows, self.chunk_bytes // self.dtype.itemsize)), dtype=self.dtype)

    def add(self, sample: Mapping[str, Any]) -> None:
        """One sample: a mapping of field name to array, tensor or number (the same fields and shapes each time)."""
        if self.dtype is None:
            self._start(sample)
        if set(sample) != set(self.fields):
            raise ConfigError(f"sample {self.count + self._n}: fields {sorted(sample)}, where the first sample "
                              f"has {sorted(self.fields)}")
        row = self._buf[self._n]
        for k, v in sample.items():
            a = _as_array(v)
            if list(a.shape) != self.fields[k]["shape"]:
                raise ConfigError(f"sample {self.count + self._n}: field {k!r} has shape {tuple(a.shape)}, where "
                                  f"the first sample's is {tuple(self.fields[k]['shape'])}")
            row[k] = a
        self._n += 1
        if self._n == len(self._buf):
            self._flush()

    def add_arrays(self, columns: Mapping[str, Any]) -> None:
        """Many samples at once: field name -> array whose first dimension is the sample (read in chunks,
        so memory-mapped inputs stay on disk)."""
        names = list(columns)
        n = len(columns[names[0]])
        for k in names:
            if len(columns[k]) != n:
                raise ConfigError(f"{k}: {len(columns[k])} samples, where {names[0]} has {n}")
        if n == 0:
            return
        if self.dtype is None:
            self._start({k: np.asarray(columns[k][0]) for k in names})
        step = len(self._buf)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            for k in names:
                block = np.asarray(columns[k][lo:hi])
                if list(block.shape[1:]) != self.fields[k]["shape"]:
                    raise ConfigError(f"{k}: samples of shape {tuple(block.shape[1:])}, expected "
                                      f"{tuple(self.fields[k]['shape'])}")
            for k in names:
                self._buf[self._n:self._n + hi - lo][k] = np.asarray(columns[k][lo:hi])
            self._n += hi - lo
            self._flush()

    def _flush(self) -> None:
        rows = self._buf[:self._n]
        for k, f in self.fields.items():  # integer ranges: the task hints (classes, vocabulary)
            if np.dtype(f["dtype"]).kind in "iu" and len(rows):
                lo, hi = int(rows[k].min()), int(rows[k].max())
                old = self.stats.get(k, (lo, hi))
                self.stats[k] = (min(lo, old[0]), max(hi, old[1]))
        done = 0
        while done < len(rows):
            if self._file is None:
                self._open_shard()
            room = self.rows_per_shard - self._shard["count"]
            part = rows[done:done + room]
            data = part.tobytes()
            self._file.write(data)
            self._shard["count"] += len(part)
            self._shard["bytes"] += len(data)
            self._shard["crc32"] = zlib.crc32(data, self._shard["crc32"])
            done += len(part)
            if self._shard["count"] == self.rows_per_shard:
                self._close_shard()
        self.count += len(rows)
        self._n = 0

    def _open_shard(self) -> None:
        name = f"shard-{len(self.shards):05d}.bin"
        first = sum(s["count"] for s in self.shards)
        self._shard = {"file": name, "first": first, "count": 0, "bytes": 0, "crc32": 0}
        self._file = open(self.out / (name + ".tmp"), "wb")

    def _close_shard(self) -> None:
        self._file.close()
        os.replace(self.out / (self._shard["file"] + ".tmp"), self.out / self._shard["file"])
        self.shards.append(self._shard)
        self._file = None

    def close(self) -> Manifest:
        """Write what is left and the manifest (atomically, last). Raises ConfigError for an empty dataset."""
        if self.dtype is None or (self.count == 0 and self._n == 0):
            raise ConfigError("the dataset is empty: no samples were given")
        if self._n:
            self._flush()
        if self._file is not None:
            self._close_shard()
        record = {"format": FORMAT, "version": VERSION, "fields": list(self.fields.values()),
                  "record_bytes": self.dtype.itemsize, "count": self.count, "shard_size": self.rows_per_shard,
                  "hints": _task_hints(self.fields, self.stats), "shards": self.shards}
        tmp = self.out / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.out / MANIFEST)
        return Manifest(self.out, record)

    def __enter__(self):
        return self

    def __exit__(self, kind, *rest):
        if kind is None:
            self.close()
        elif self._file is not None:
            self._file.close()


def _as_array(v: Any) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def write_shards(samples: Iterable[Mapping[str, Any]], out: str | os.PathLike,
                 shard_size: int | str = DEFAULT_SHARD_BYTES) -> Manifest:
    """Write any iterable of samples (dicts of arrays, tensors or numbers) as a shard dataset under `out`.

    Memory stays bounded whatever the number of samples (they are written in chunks as they come).
    Training reads the fields `features` and `targets`.
    """
    w = ShardWriter(out, shard_size)
    for sample in samples:
        w.add(sample)
    return w.close()


# ---------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------

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
        self.m.field("features"), self.m.field("targets")
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
