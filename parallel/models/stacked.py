"""Two networks stacked: a frozen, pretrained feature extractor feeding a trainable head.

The extractor's weights never train (requires_grad false): they come from
`model.frozen_checkpoint` when it is set (a state dict holding `frozen.*`
entries, e.g. a final_model.pt of an earlier run, or the extractor's own
`0.fc.weight`-style keys), or else from the usual initialization by name.
Under strategy=offload the extractor streams through the device without
gradients or optimizer state, and the head after it, so the two never need
to be on the device together.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn


@functools.lru_cache(maxsize=2)
def _load(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


class PretrainedLinear(nn.Linear):
    """A Linear initialized from a checkpoint by its own name, when one is given."""

    def __init__(self, i: int, o: int, source: str | None, names: tuple[str, ...]):
        super().__init__(i, o)
        self.source, self.names = source, names

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if self.source is None:  # PyTorch's default for a Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1.0 / math.sqrt(self.in_features)
            tensor.uniform_(-bound, bound, generator=generator)
            return
        state = _load(self.source)
        for prefix in self.names:
            if prefix + name in state:
                tensor.copy_(state[prefix + name].to(tensor.dtype).reshape(tensor.shape))
                return
        raise KeyError(f"model.frozen_checkpoint={self.source!r} holds none of "
                       f"{[p + name for p in self.names]}")


class Block(nn.Module):
    def __init__(self, i: int, o: int, source: str | None = None, index: int | None = None):
        super().__init__()
        names = (f"frozen.{index}.fc.", f"{index}.fc.")
        self.fc = PretrainedLinear(i, o, source, names) if index is not None else nn.Linear(i, o)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Stacked(nn.Module):
    def __init__(self, in_features: int, out_features: int, hidden: int, frozen_depth: int, head_depth: int,
                 frozen_checkpoint: str | None = None):
        super().__init__()
        widths = [in_features] + [hidden] * frozen_depth
        self.frozen = nn.ModuleList(Block(a, b, frozen_checkpoint, i) for i, (a, b) in enumerate(zip(widths, widths[1:])))
        self.frozen.requires_grad_(False)
        self.head = nn.ModuleList([Block(hidden, hidden) for _ in range(head_depth)] + [nn.Linear(hidden, out_features)])

    # Split in two so that strategy=offload can run the frozen part one batch
    # ahead of the head (Note [frozen lookahead] in parallel.strategies.offload.lookahead).
    def frozen_forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # nothing flows back into the extractor
            for block in self.frozen:
                x = block(x)
        return x

    def trainable_forward(self, features: torch.Tensor) -> torch.Tensor:
        for block in self.head:
            features = block(features)
        return features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trainable_forward(self.frozen_forward(x))


def build_stacked(in_features: int = 32, out_features: int = 4, hidden: int = 64, frozen_depth: int = 3,
                  head_depth: int = 2, frozen_checkpoint: str | None = None) -> Stacked:
    """The built-in `stacked` model."""
    return Stacked(in_features, out_features, hidden, frozen_depth, head_depth, frozen_checkpoint)
