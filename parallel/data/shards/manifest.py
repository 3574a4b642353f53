"""A shard dataset on disk: its format, its manifest, and the checks run before training.

# Note [shard format]
A dataset is a directory:

    manifest.json      format, fields (name, dtype, shape), record size, sample
                       count, task hints (and which were `stated`: Note
                       [vocabulary bound]), and the index: one row per shard
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

Samples have the fields `features` and `targets`, or one field `tokens`: a
language model's window of seq_len + 1 token ids, whose first seq_len are the
inputs and last seq_len the targets (text.py: Note [packing text]), so a token
is stored once and not twice.

# Note [vocabulary bound]
The manifest's task sizes are read from the samples, except those the writer
was told (`stated`: a tokenizer's `vocab_size`, launch/make_shards.py text=).
A vocabulary read from the samples is their largest token id + 1: a lower
bound on the model's vocabulary, never its size (a fine-tuning set rarely uses
every token of a pretrained model's 30k or 50k). So the check before training
(check_model_takes_data in parallel/models/build.py) takes a model whose output
size is above the largest id; a vocabulary a tokenizer recorded is the model's
size, and is checked exactly (a model of another vocabulary was trained with
another tokenizer). Manifests written before `stated` was recorded are read as
bounds.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from parallel.config import ConfigError, DataConfig, fail, positive

FORMAT = "parallel-shards"
VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_BYTES = 256 << 20


class ShardError(ValueError):
    """A shard that cannot be read as its manifest says (missing, truncated, corrupt); names the file."""


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

    @property
    def packed(self) -> bool:
        """Samples are windows of `tokens` (inputs and shifted targets in one field; Note [shard format])."""
        return any(f["name"] == "tokens" for f in self.fields)

    def stated(self, key: str) -> bool:
        """Whether the hint `key` is a size the writer was told (a tokenizer's `vocab_size`), not one read from
        the samples (Note [vocabulary bound])."""
        return key in self.record.get("stated", ())

    def field(self, name: str) -> dict:
        for f in self.fields:
            if f["name"] == name:
                return f
        raise ConfigError(f"data.path={str(self.root)!r}: samples have no field {name!r} "
                          f"(they have {[f['name'] for f in self.fields]}); training reads "
                          f"'features' and 'targets', or 'tokens'")

    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample's model input; ConfigError when the fields training reads are missing."""
        if self.packed:
            shape = self.field("tokens")["shape"]
            if len(shape) != 1 or shape[0] < 2:
                raise ConfigError(f"data.path={str(self.root)!r}: tokens of shape {tuple(shape)}: a window "
                                  f"needs shape (seq_len + 1,) with seq_len >= 1")
            return (shape[0] - 1,)
        self.field("targets")
        return tuple(self.field("features")["shape"])

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
    m.input_shape()
    hints = m.record.get("hints") or {}
    if not hints:
        fail("data.path", str(path), "the manifest names no task for its features and targets")
    return hints


def vocab_is_bound(path: str | os.PathLike) -> bool:
    """Whether the dataset's `vocab_size` is only its largest token id + 1, not a size a tokenizer recorded
    (Note [vocabulary bound])."""
    return not Manifest.load(path).stated("vocab_size")


def check_shards(d: DataConfig) -> None:
    """data=shards' settings, and the dataset's files (sizes, or checksums with data.verify=checksum)."""
    positive("data.shuffle_buffer", d.shuffle_buffer, allow_zero=True)
    positive("data.prefetch", d.prefetch, allow_zero=True)
    positive("data.workers", d.workers)
    if d.verify not in ("size", "checksum"):
        fail("data.verify", d.verify, "unknown check", ["size", "checksum"])
    m = Manifest.load(d.path)
    shape = m.input_shape()
    if d.task != "lm" and len(shape) != 1:
        fail("data.path", d.path, f"features of shape {shape}: the built-in tasks take one "
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
