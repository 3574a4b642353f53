"""Writing a shard dataset (Note [shard format] in manifest.py) in bounded memory: from arrays
(launch/make_shards.py) or any iterable of samples (`write_shards`)."""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from parallel.config import ConfigError
from parallel.data.shards.manifest import DEFAULT_SHARD_BYTES, FORMAT, MANIFEST, VERSION, Manifest
from parallel.units import parse_bytes


def _task_hints(fields: dict[str, dict], stats: dict[str, tuple[int, int]]) -> dict:
    """The training task the samples suggest, and its sizes (read into data.* by parallel.config)."""
    if "tokens" in fields and len(fields["tokens"]["shape"]) == 1:  # LM windows (Note [shard format])
        return {"task": "lm", "seq_len": fields["tokens"]["shape"][0] - 1, "vocab_size": stats["tokens"][1] + 1}
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


class ShardWriter:
    """Writes samples into fixed-size shards under `out` in bounded memory; `close()` writes the manifest.

    Args:
        out: the dataset directory (created; must not hold a dataset already).
        shard_size: samples per shard, or a size with a unit ("256MB") from which that count follows.
        chunk_bytes: how much is gathered in memory before it is written.
        hints: task sizes the samples cannot show, over those inferred (a tokenizer's `vocab_size`, which
            may exceed the largest token written); checked against the data at `close()` and recorded as
            `stated` (exact sizes; an inferred vocabulary is a lower bound: Note [vocabulary bound]).
    """

    def __init__(self, out: str | os.PathLike, shard_size: int | str = DEFAULT_SHARD_BYTES,
                 chunk_bytes: int = 16 << 20, hints: dict | None = None):
        self.out = Path(out)
        if (self.out / MANIFEST).exists():
            raise ConfigError(f"out={str(out)!r}: holds a dataset already (remove it, or write elsewhere)")
        self.out.mkdir(parents=True, exist_ok=True)
        self.shard_size, self.chunk_bytes, self.hints = shard_size, chunk_bytes, dict(hints or {})
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
        hints = _task_hints(self.fields, self.stats)
        for key, value in self.hints.items():
            if key in ("vocab_size", "classes") and key in hints and value < hints[key]:
                raise ConfigError(f"{key}={value}: the samples hold ids up to {hints[key] - 1}")
            hints[key] = value
        record = {"format": FORMAT, "version": VERSION, "fields": list(self.fields.values()),
                  "record_bytes": self.dtype.itemsize, "count": self.count, "shard_size": self.rows_per_shard,
                  "hints": hints, "stated": sorted(self.hints), "shards": self.shards}
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
