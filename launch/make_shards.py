"""Write a dataset of shards for `data=shards` (README, "Datasets larger than RAM").

    python launch/make_shards.py features=F.npy targets=T.npy out=DIR [shard_size=256MB]

F.npy holds one sample's features per row (N x F; integer tokens N x L for a
language model), T.npy its targets (N x T floats: regression; N integers:
classification; N x L tokens: lm). Both are read memory-mapped, a chunk at a
time, so arrays larger than RAM are fine. shard_size is samples per shard, or
a size with a unit (256MB, 1GiB). From Python, any iterable of samples (dicts
of arrays or tensors) works: parallel.data.shards.write_shards.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from parallel.config import ConfigError  # noqa: E402
from parallel.data.shards import ShardWriter  # noqa: E402
from parallel.entry import reported  # noqa: E402

KEYS = {"features": None, "targets": None, "out": None, "shard_size": "256MB"}


def parse(argv: list[str]) -> dict:
    args = dict(KEYS)
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in KEYS:
            raise ConfigError(f"{arg!r}: expected key=value with key one of {list(KEYS)}")
        args[key] = value
    for key in ("features", "targets", "out"):
        if not args[key]:
            raise ConfigError(f"{key}: missing (usage: make_shards.py features=F.npy targets=T.npy out=DIR)")
    size = args["shard_size"]
    args["shard_size"] = int(size) if size.isdigit() else size
    return args


@reported
def main(argv: list[str]) -> None:
    args = parse(argv)
    columns = {}
    for key in ("features", "targets"):
        try:
            columns[key] = np.load(args[key], mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}={args[key]!r}: cannot be read as a .npy array ({e})") from None
    if columns["features"].ndim == 0 or columns["targets"].ndim == 0:
        raise ConfigError("features and targets need one row per sample (a first dimension)")
    n = len(columns["features"])
    if n != len(columns["targets"]):
        raise ConfigError(f"targets: {len(columns['targets'])} samples, where features has {n}")
    t0 = time.perf_counter()
    writer = ShardWriter(args["out"], args["shard_size"])
    chunk = 1 << 16
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        writer.add_arrays({k: c[lo:hi] for k, c in columns.items()})
        print(f"\rwritten {hi:,} / {n:,} samples", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    m = writer.close()
    total = sum(s["bytes"] for s in m.shards)
    print(f"{m.count:,} samples in {len(m.shards)} shards ({total / 1e6:.1f} MB, {m.dtype.itemsize} bytes each) "
          f"in {time.perf_counter() - t0:.1f} s -> {args['out']}; task hints {m.record['hints']}")


if __name__ == "__main__":
    main(sys.argv[1:])
