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

    def tp_plan(self, tp: int) -> dict[str, str]:
        """Tensor-parallel plan: the Linears in forward order, paired colwise -> rowwise.

        Only an activation stands between the two of a pair, so each rank keeps
        its slice of the hidden features in between; a leftover last Linear stays whole.
        """
        chain = ["inp"] + [f"blocks.{i}.fc" for i in range(len(self.blocks))] + ["head"]
        plan = {}
        for a, b in zip(chain[0::2], chain[1::2]):
            plan[a], plan[b] = "colwise", "rowwise"
        if len(chain) % 2:
            plan[chain[-1]] = "replicate"
        if self.inp.out_features % tp:
            raise ValueError(f"model.args.hidden={self.inp.out_features} must divide by tp {tp}")
        return plan


def build_mlp(in_features: int = 32, out_features: int = 4, hidden: int = 64, depth: int = 4) -> MLP:
    """The built-in `mlp` model."""
    return MLP(in_features, out_features, hidden, depth)
