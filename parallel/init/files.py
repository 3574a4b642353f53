"""Weight files as users have them, read a piece at a time: `.safetensors`, `.pt`/`.bin` state dicts, a sharded
safetensors index (`*.safetensors.index.json`), or a Hugging Face model directory (`config.json` beside its
weights). Only names, shapes and dtypes are read up front; a tensor's bytes are read when a rank asks for the
piece it holds.

safetensors reads a slice of a tensor from its file without the rest; a `.pt` file is opened memory-mapped, so a
slice touches only its own pages.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "pytorch_model.pt")


class WeightFileError(ValueError):
    """A weight file that cannot be read; the message names it."""


def find_weights(path: str) -> list[Path]:
    """The files holding the weights at `path` (a file, an index, or a directory); raises WeightFileError."""
    p = Path(path)
    if p.is_dir():
        for name in WEIGHT_NAMES:
            if (p / name).is_file():
                return find_weights(str(p / name))
        raise WeightFileError(f"{path} holds none of {list(WEIGHT_NAMES)}")
    if not p.is_file():
        raise WeightFileError(f"{path}: no such file or directory")
    if p.name.endswith(".index.json"):
        try:
            weight_map = json.loads(p.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise WeightFileError(f"{path} is not a weight index ({type(e).__name__}: {e})") from None
        files = sorted({p.parent / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightFileError(f"{path} names files that are not there: {missing}")
        return files
    return [p]


class WeightFiles:
    """Every tensor of the weight files at `path`: its name, shape and dtype, and its pieces on demand."""

    def __init__(self, path: str):
        self.path = path
        self.files = find_weights(path)
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._open: dict[Path, object] = {}
        for f in self.files:
            for name, shape in self._header(f).items():
                self.where[name], self.shapes[name] = f, shape

    def _header(self, f: Path) -> dict[str, tuple[int, ...]]:
        if f.suffix == ".safetensors":
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise WeightFileError(f"{f} is not a safetensors file ({type(e).__name__}: {e})") from None
            self._open[f] = handle
            return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
        try:
            state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - torch.load raises many kinds for a file that is not a state dict
            raise WeightFileError(f"{f} is not a PyTorch state dict ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise WeightFileError(f"{f} holds a {type(state).__name__}, not a state dict of tensors")
        self._open[f] = state
        return {k: tuple(v.shape) for k, v in state.items()}

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, or its piece `index` (one slice per dimension), read from its file (a new CPU tensor)."""
        handle = self._open[self.where[name]]
        if isinstance(handle, dict):
            tensor = handle[name]
            return (tensor if index is None else tensor[index]).clone()
        if index is None or not self.shapes[name]:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]

    def close(self) -> None:
        self._open.clear()


def save_weights(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Write `tensors` (no two sharing storage) to a safetensors file, atomically."""
    tmp = f"{path}.tmp{os.getpid()}"
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)
