"""A plain multi-layer perceptron: the default model, small enough to train in seconds."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    """inp -> `depth` Linear+GELU blocks -> head. Blocks live in a ModuleList so that
    later strategies can split or shard them by name."""

    def __init__(self, in_features: int, out_features: int, hidden: int, depth: int):
        super().__init__()
        self.inp = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.head = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_mlp(in_features: int = 32, out_features: int = 4, hidden: int = 64, depth: int = 4) -> MLP:
    """The built-in `mlp` model."""
    return MLP(in_features, out_features, hidden, depth)
