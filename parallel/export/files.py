"""safetensors files written a tensor at a time, sharded with an index as transformers names them.

A safetensors file is an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range; `__metadata__`) and the tensors'
bytes one after another. The library's `save_file` takes every tensor at once;
here the header is written from the entries' shapes and dtypes alone, then
each tensor's bytes are read, written and let go (Note [reading a tensor at a
time]). Shards follow `save_pretrained`: `model.safetensors` when one file
holds everything, else `model-00001-of-0000N.safetensors` and
`model.safetensors.index.json` (`weight_map`: name -> file).
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Callable

import torch

from parallel.config import RunError
from parallel.export.names import Entry

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def unsupported(entries: list[Entry]) -> list[str]:
    """Entries whose dtype safetensors cannot hold (checked before anything is written)."""
    return [f"{e.name} ({e.spec.dtype})" for e in entries if e.spec.dtype not in DTYPES]


def shards(entries: list[Entry], max_bytes: int | None) -> list[list[Entry]]:
    """The entries in order, cut into files of at most `max_bytes` (a larger tensor alone in its file);
    None: one file."""
    out: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if max_bytes is not None and out[-1] and size + e.spec.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(e)
        size += e.spec.nbytes
    return out


def write_weights(out: Path, entries: list[Entry], read: Callable[[str], torch.Tensor],
                  max_bytes: int | None, single: str = SINGLE) -> list[str]:
    """Write `entries` (each made from tensors `read` gives) into `out` as safetensors, sharded by `max_bytes`
    (None: one file, named `single`: a PEFT adapter's is adapter_model.safetensors). Returns the names written."""
    if sys.byteorder != "little":  # safetensors is little-endian; torch's bytes are the host's
        raise RunError("exporting safetensors needs a little-endian host")
    parts = shards(entries, max_bytes)
    if len(parts) == 1:
        names = [single]
    else:
        names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for name, part in zip(names, parts):
        _write_file(out / name, part, read)
    if len(parts) > 1:
        index = {"metadata": {"total_size": sum(e.spec.nbytes for e in entries),
                              "total_parameters": sum(e.spec.numel for e in entries)},
                 "weight_map": {e.name: name for name, part in zip(names, parts) for e in part}}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(INDEX)
    return names


def _write_file(path: Path, entries: list[Entry], read: Callable[[str], torch.Tensor]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": DTYPES[e.spec.dtype], "shape": list(e.spec.shape),
                          "data_offsets": [offset, offset + e.spec.nbytes]}
        offset += e.spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors' bytes start 8-byte aligned, as the library writes them
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for e in entries:
            t = e.value(read).detach()
            if tuple(t.shape) != e.spec.shape or t.dtype != e.spec.dtype:
                raise RunError(f"{e.name}: read {tuple(t.shape)} {t.dtype}, its header says {e.spec.shape} "
                               f"{e.spec.dtype}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t  # let it (and its pages) go before the next is read
