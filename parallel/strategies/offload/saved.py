"""Where the tensors autograd saves for backward go under offload: the saved-tensors hooks.

Saved tensors that are views of a bound block buffer (a Linear saves its
weight's transpose) would read another block's bytes once the buffer is
reused, so they are recorded as (block, view) and the view is rebuilt from the
block's buffer at unpack, binding the block again if it is not. Other saved
tensors go to the activations tier (parallel.strategies.offload.activations) or stay.
"""
from __future__ import annotations

import torch

from parallel.strategies.offload.activations import ActivationStore
from parallel.strategies.offload.layout import Block
from parallel.strategies.offload.stream import WeightStream


class SavedTensors:
    """`pack` and `unpack` for `torch.autograd.graph.saved_tensors_hooks`.

    Args:
        stream: the block weights (views of their buffers are rebuilt, not kept).
        acts: the activations tier (None: activations stay on the device).
        device: the compute device.
    """

    def __init__(self, stream: WeightStream, acts: ActivationStore | None, device: torch.device):
        self.stream, self.acts, self.device = stream, acts, device

    def pack(self, t: torch.Tensor):
        if self.stream.streaming:
            b = self._bound_owner(t)
            if b is not None:
                return ("view", b, t.dtype, t.shape, t.stride(), t.storage_offset())
        if self.acts is not None:
            return self.acts.pack(t)
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 6 and packed[0] == "view":
            _, b, dtype, shape, stride, offset = packed
            self.stream.ensure(b)
            return b.buffer.view(dtype).as_strided(shape, stride, offset)
        if self.acts is not None:
            return self.acts.unpack(packed)
        return packed

    def _bound_owner(self, t: torch.Tensor) -> Block | None:
        """The block whose bound buffer `t` views, or None."""
        if t.device != self.device:
            return None
        return self.stream.bound.get(id(t.untyped_storage()))
