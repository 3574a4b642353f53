"""Write a dataset of shards for `data=shards` (docs/data.md, "Datasets larger than RAM").

    python launch/make_shards.py features=F.npy targets=T.npy out=DIR [shard_size=256MB]
    python launch/make_shards.py text=FILES tokenizer=TOK seq_len=L out=DIR [split=file] [eos=TOKEN|none]
                                 [dtype=auto] [pattern=REGEX] [shard_size=256MB]

Arrays: F.npy holds one sample's features per row (N x F; integer tokens N x L
for a language model), T.npy its targets (N x T floats: regression; N integers:
classification; N x L tokens: lm). Both are read a chunk at a time into
buffers used again for each chunk, so arrays larger than RAM are fine and
memory stays flat whatever their size.

Text: FILES are UTF-8 text files, directories (every file under them) or glob
patterns, comma-separated; TOK a Hugging Face tokenizer.json (or a directory
holding one) or a tiktoken file, read locally. Documents (split: each `file`,
`line` or `paragraph`) are tokenized, followed by the end-of-text token (eos:
the tokenizer's by default), and packed into samples of seq_len + 1 tokens
(inputs and shifted targets; Note [packing text] in parallel/data/shards/text.py),
streamed in bounded memory. dtype: the stored token ids (auto: uint16 when the
vocabulary fits, else uint32). pattern: a tiktoken file's split regex (GPT-2's
by default).

shard_size is samples per shard, or a size with a unit (256MB, 1GiB). From
Python, any iterable of samples (dicts of arrays or tensors) works:
parallel.data.shards.write_shards.
"""
from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.config import ConfigError  # noqa: E402
from parallel.data.shards import ShardWriter  # noqa: E402
from parallel.data.shards.arrays import NpyRows  # noqa: E402
from parallel.entry import reported  # noqa: E402

COMMON = {"out": None, "shard_size": "256MB"}
ARRAYS = {"features": None, "targets": None}
TEXT = {"text": None, "tokenizer": None, "seq_len": None, "split": "file", "eos": None, "dtype": "auto",
        "pattern": None}
USAGE = ("make_shards.py features=F.npy targets=T.npy out=DIR, or "
         "make_shards.py text=FILES tokenizer=TOK seq_len=L out=DIR")


def parse(argv: list[str]) -> dict:
    keys = {**COMMON, **ARRAYS, **TEXT}
    given: dict = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in keys:
            raise ConfigError(f"{arg!r}: expected key=value with key one of {list(keys)}")
        given[key] = value
    mode, other = (TEXT, ARRAYS) if "text" in given else (ARRAYS, TEXT)
    for key in given:
        if key in other:
            raise ConfigError(f"{key}: not an option with {'text=' if mode is TEXT else 'features= targets='} "
                              f"(usage: {USAGE})")
    args = {**COMMON, **mode, **given}
    required = ("text", "tokenizer", "seq_len", "out") if mode is TEXT else ("features", "targets", "out")
    for key in required:
        if not args[key]:
            raise ConfigError(f"{key}: missing (usage: {USAGE})")
    size = args["shard_size"]
    args["shard_size"] = int(size) if size.isdigit() else size
    if mode is TEXT:
        try:
            args["seq_len"] = int(args["seq_len"])
        except ValueError:
            raise ConfigError(f"seq_len={args['seq_len']!r}: not a whole number of tokens") from None
        if args["seq_len"] < 1:
            raise ConfigError(f"seq_len={args['seq_len']}: must be a positive number of tokens")
    return args


def from_arrays(args: dict) -> None:
    columns = {}
    for key in ("features", "targets"):
        try:
            columns[key] = NpyRows(args[key])
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}={args[key]!r}: cannot be read as a .npy array ({e})") from None
    if columns["features"].ndim == 0 or columns["targets"].ndim == 0:
        raise ConfigError("features and targets need one row per sample (a first dimension)")
    n = len(columns["features"])
    if n != len(columns["targets"]):
        raise ConfigError(f"targets: {len(columns['targets'])} samples, where features has {n}")
    t0 = time.perf_counter()
    writer = ShardWriter(args["out"], args["shard_size"])
    # Read in chunks of ~16 MB into buffers used again for each (parallel/data/shards/arrays.py).
    row_bytes = sum(c.dtype.itemsize * math.prod(c.shape[1:]) for c in columns.values())
    chunk = max(1, (16 << 20) // max(1, row_bytes))
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        writer.add_arrays({k: c.rows(lo, hi) for k, c in columns.items()})
        print(f"\rwritten {hi:,} / {n:,} samples", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    m = writer.close()
    for c in columns.values():
        c.close()
    total = sum(s["bytes"] for s in m.shards)
    print(f"{m.count:,} samples in {len(m.shards)} shards ({total / 1e6:.1f} MB, {m.dtype.itemsize} bytes each) "
          f"in {time.perf_counter() - t0:.1f} s -> {args['out']}; task hints {m.record['hints']}")


def from_text(args: dict) -> None:
    from parallel.data.shards.text import text_files, write_text_shards
    from parallel.data.shards.tokenizer import eos_id, load_tokenizer, token_dtype

    files = text_files(args["text"])  # every check before the first file is read
    tok = load_tokenizer(args["tokenizer"], args["pattern"])
    dtype = token_dtype(args["dtype"], tok.vocab_size)
    eos = eos_id(tok, args["eos"], args["tokenizer"])
    s = write_text_shards(files, tok, args["out"], args["seq_len"], split=args["split"], eos=eos, dtype=dtype,
                          shard_size=args["shard_size"])
    m = s.manifest
    total = sum(sh["bytes"] for sh in m.shards)
    print(f"{s.files} files, {s.bytes / 1e6:.1f} MB, {s.documents:,} documents -> {s.tokens:,} tokens "
          f"({s.tokens / s.seconds:,.0f} tokens/s; {s.dropped} after the last sample dropped) -> "
          f"{m.count:,} samples of {args['seq_len']} + 1 tokens in {len(m.shards)} shards ({total / 1e6:.1f} MB) "
          f"in {s.seconds:.1f} s -> {args['out']}; task hints {m.record['hints']}")


@reported
def main(argv: list[str]) -> None:
    args = parse(argv)
    (from_text if "text" in args else from_arrays)(args)


if __name__ == "__main__":
    main(sys.argv[1:])
