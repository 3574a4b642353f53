"""Small tensor helpers shared by the strategies, the trainer and the memory counts."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (tensor- or data-parallel), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's piece of `t`."""
    t = local(t)
    return t.numel() * t.element_size()


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold `t`'s memory. A wrapper subclass (DTensor, the async result of a functional
    collective) owns a storage of its full size that holds nothing: what it wraps holds the memory."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, name) for name in names)
    return [p for i in inner if isinstance(i, torch.Tensor) for p in plain_tensors(i)]
