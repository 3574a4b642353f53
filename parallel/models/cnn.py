"""A small convolutional classifier over a flat feature vector read as an image."""
from __future__ import annotations

import math

import torch
from torch import nn


class CNN(nn.Module):
    """(batch, features) -> (batch, channels, side, side) -> conv blocks -> pooled head.

    The synthetic data hands out flat vectors; the model reads them as square
    images so one data source serves every built-in model.
    """

    def __init__(self, in_features: int, out_features: int, channels: int, width: int, depth: int):
        super().__init__()
        side = math.isqrt(in_features // channels)
        if channels * side * side != in_features:
            raise ValueError(f"data.features={in_features} must be channels ({channels}) x a square")
        self.shape = (channels, side, side)
        convs, c = [], channels
        for _ in range(depth):
            convs.append(nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.ReLU()))
            c = width
        self.blocks = nn.ModuleList(convs)
        self.head = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], *self.shape)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def build_cnn(in_features: int = 64, out_features: int = 10, channels: int = 1, width: int = 16,
              depth: int = 2) -> CNN:
    """The built-in `cnn` model."""
    return CNN(in_features, out_features, channels, width, depth)
