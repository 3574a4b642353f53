"""Where each rank's initial values come from: the model's own initialization, weight files, or names.

# Note [initial values]
Strategies partition the model on the meta device and then fill the tensors
each rank holds (parallel.init.plan.materialize_and_init), each from one
`Values`, under the names of the unpartitioned model:
- `model.init=module` (the default): the values the user's own code gives,
  `torch.manual_seed(trainer.seed); model = factory(**args)` in plain PyTorch:
  constructor values, `reset_parameters()`, Hugging Face `_init_weights`,
  buffers computed in `__init__`. Global rank 0 builds the model once on the
  CPU and writes every tensor to a safetensors file in the run directory
  (`write_own_weights`); every rank then reads only the pieces it holds (`FromFiles`).
  The model must fit in one host's memory, once.
- `model.weights=PATH` (pretrained): `FromFiles` over the user's files, each rank
  reading only its pieces; no rank holds the whole model. Buffers that are not
  saved (non-persistent ones, e.g. rotary `inv_freq`) are what the model's
  constructor computes: rank 0 builds the model with its parameters on the meta
  device (the buffers alone are real, and small) and writes those buffers for
  every rank as above. With `model.strict=false`, tensors the files lack take
  the model's own values (above); for `model=hf` those are what
  `torch.manual_seed(trainer.seed); cls.from_pretrained(path)` gives them: rank 0
  builds the model that way (parallel.models.build.build_model with the seed).
- `model.init=name` (Note [initialization by name]): every tensor from a
  generator seeded by its name, one tensor at a time on every rank; no rank ever
  holds the whole model, so it is the path for a model too large for one host
  without pretrained weights.
The planner passes `Blank` (fake tensors have no values to fill).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from parallel.init.by_name import full_init_value
from parallel.init.files import WeightFiles
from parallel.init.plan import InitEntry, InitPlan


class Values:
    """The initial value of every tensor of the unpartitioned model, by name."""

    def full(self, fqn: str, entry: InitEntry, shape, dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor `fqn` (a CPU tensor of `shape`)."""
        raise NotImplementedError

    def fill(self, fqn: str, entry: InitEntry, tensor: torch.Tensor) -> None:
        """Fill this rank's `tensor` (a whole tensor or a DTensor) in place."""
        put(self.full(fqn, entry, tensor.shape, tensor.dtype), tensor)


def put(full: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy `full` into `tensor`, or this rank's piece of it into a DTensor. Every rank holds the same full
    value, so each keeps its own piece without communication (src_data_rank=None)."""
    if isinstance(tensor, DTensor):
        piece = distribute_tensor(full.to(tensor.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None)
        tensor.to_local().copy_(piece.to_local())
    else:
        tensor.copy_(full)


class Blank(Values):
    """No values (the planner's fake tensors)."""

    def full(self, fqn, entry, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def fill(self, fqn, entry, tensor):
        pass


class ByName(Values):
    """Note [initialization by name]; `root` is the whole model (Hugging Face models initialize by its method)."""

    def __init__(self, seed: int, root: nn.Module | None = None):
        self.seed, self.root = seed, root

    def full(self, fqn, entry, shape, dtype):
        return full_init_value(entry.module, entry.local_name, entry.canonical, shape, dtype, self.seed, self.root)


def _aliases(plan: InitPlan) -> dict[str, list[str]]:
    """Every canonical name -> all names of that tensor (a tied weight has several), canonical first."""
    names: dict[str, list[str]] = {}
    for fqn, entry in plan.items():
        names.setdefault(entry.canonical, [entry.canonical])
        if fqn != entry.canonical:
            names[entry.canonical].append(fqn)
    return names


def saved_in_state_dict(entry: InitEntry) -> bool:
    """Whether a state dict holds this tensor (non-persistent buffers are left out of it)."""
    return entry.local_name not in entry.module._non_persistent_buffers_set


class FromFiles(Values):
    """Values read from weight files, each rank reading only the pieces it holds.

    Names are matched as the model has them; a file saved from the same architecture without its head
    (`prefix`, Hugging Face's `base_model_prefix`) or with it matches too; a tied weight matches any of its
    names. `plain`, when given, names a tensor as the model without adapters names it (Note [LoRA] in
    parallel/models/lora.py), None for an adapter's own: those are never in the files. Names the file lacks
    come from `fallback`.
    """

    def __init__(self, files: WeightFiles, plan: InitPlan, prefix: str = "", fallback: Values | None = None,
                 plain=None):
        self.files, self.fallback = files, fallback
        self.own = {n for n in plan if plain is not None and plain(n) is None}  # an adapter's own tensors
        self.keys: dict[str, str] = {}
        for names in _aliases(plan).values():
            tried = names if plain is None else [n for name in names if (n := plain(name)) is not None] + names
            key = next((k for n in tried for k in _spellings(n, prefix) if k in files.shapes), None)
            if key is not None:
                self.keys.update({n: key for n in names})

    def problems(self, plan: InitPlan, shapes: dict[str, tuple]) -> tuple[list[str], list[str], list[str]]:
        """(missing names, unexpected file keys, shape mismatches) against the model's names and shapes."""
        missing = sorted({e.canonical for n, e in plan.items()
                          if n not in self.keys and n not in self.own and saved_in_state_dict(e)})
        used = set(self.keys.values())
        unexpected = sorted(k for k in self.files.shapes if k not in used)
        mismatched = sorted({f"{self.keys[n]}: file {list(self.files.shapes[self.keys[n]])}, model {list(shape)}"
                             for n, shape in shapes.items()
                             if n in self.keys and tuple(self.files.shapes[self.keys[n]]) != tuple(shape)})
        return missing, unexpected, mismatched

    def full(self, fqn, entry, shape, dtype):
        if fqn not in self.keys:
            return self._fallback(fqn).full(fqn, entry, shape, dtype)
        return self.files.read(self.keys[fqn]).to(dtype)

    def fill(self, fqn, entry, tensor):
        if fqn not in self.keys:
            return self._fallback(fqn).fill(fqn, entry, tensor)
        index = _piece(tensor)
        if index is None:
            return put(self.full(fqn, entry, tensor.shape, tensor.dtype), tensor)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        local.copy_(self.files.read(self.keys[fqn], index).to(tensor.dtype))

    def _fallback(self, fqn: str) -> Values:
        if self.fallback is None:
            raise KeyError(f"'{fqn}' is not in {self.files.path}")
        return self.fallback


def _spellings(name: str, prefix: str) -> list[str]:
    """`name` as a file may hold it: itself, without the model's base prefix, or with it."""
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1:]]
    return [name, f"{prefix}.{name}"]


def _piece(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The slices of the whole tensor this rank holds, when its placements are plain shards and replicas (the
    piece is then read alone); None otherwise (read whole, then distributed)."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))
