"""A user's model that ran out of memory elsewhere: a convolution, then a locally connected layer.

The architecture (from Keras, channels last there): input (batch, 2, F, 1) ->
Conv2D(4, kernel (2, 1)) -> LocallyConnected2D(1, kernel (1, 1)) -> Flatten ->
Dense(1); 30,013 parameters at F = 5000. Here channels come first: the flat
data vector (2 x F values) is read as (batch, 1, 2, F); the convolution gives
(batch, 4, 1, F); the locally connected layer, one weight per position,
(batch, 1, 1, F).
"""
from __future__ import annotations

import torch
from torch import nn

from parallel.models.layers import LocallyConnected2d


class Local(nn.Module):
    def __init__(self, in_features: int, out_features: int, rows: int, channels: int, local_channels: int):
        super().__init__()
        if in_features % rows:
            raise ValueError(f"data.features={in_features} must be rows ({rows}) x the feature size")
        self.rows, self.size = rows, in_features // rows
        self.conv = nn.Conv2d(1, channels, kernel_size=(rows, 1))
        self.local = LocallyConnected2d(channels, local_channels, input_size=(1, self.size), kernel_size=(1, 1))
        self.head = nn.Linear(local_channels * self.size, out_features)

    def tp_plan(self, tp: int) -> dict[str, str]:
        """Tensor-parallel plan: the locally connected layer's positions split over the ranks; the
        convolution and the head stay whole (a few thousand parameters)."""
        return {"local": "positions"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], 1, self.rows, self.size)
        return self.head(self.local(self.conv(x)).flatten(1))


def build_local(in_features: int = 10000, out_features: int = 1, rows: int = 2, channels: int = 4,
                local_channels: int = 1) -> Local:
    """The built-in `local` model."""
    return Local(in_features, out_features, rows, channels, local_channels)
