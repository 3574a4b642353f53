"""A frozen leading part of the model run one batch ahead of the rest, on a thread of its own.

# Note [frozen lookahead]
A model whose leading blocks are frozen (no trainable parameter) and that
splits its forward into `frozen_forward(x)` and `trainable_forward(features)`
(the built-in `stacked` does) gets the frozen part run one batch ahead: while
the head trains on batch k, a thread of its own streams the frozen blocks over
batch k+1 (the trainer hands the engine the next input, `look_ahead`). The
frozen blocks have a buffer pool of their own, sized by the largest frozen
block, so the two parts never share buffers and the head's pool is sized by
the head (both pools are made in parallel.strategies.offload.engine). Correct because
frozen weights never change: the features of batch k+1 are the same before and
after step k. The frozen part runs under no_grad, so it saves nothing for
backward.
"""
from __future__ import annotations

import time
from concurrent.futures import Executor

import torch
from torch import nn

from parallel.engine import autocast
from parallel.profiling import phased
from parallel.strategies.offload.layout import Block
from parallel.strategies.offload.tiers import finish

THREAD = "offload-ahead"  # the name of the thread the frozen part runs on (the hooks check it)


def frozen_prefix(blocks: list[Block]) -> int:
    """How many leading blocks have no trainable parameter: they never run backward (their inputs need no
    gradient either)."""
    n = 0
    while n < len(blocks) and not any(p.requires_grad for p in blocks[n].module.parameters()):
        n += 1
    return n


def splits_forward(model: nn.Module) -> bool:
    """Whether `model` splits its forward into `frozen_forward` and `trainable_forward`."""
    return callable(getattr(model, "frozen_forward", None)) and callable(getattr(model, "trainable_forward", None))


class FrozenLookahead:
    """The frozen part's features, computed one batch ahead (Note [frozen lookahead]).

    Args:
        model: the model (its `frozen_forward` is run).
        bf16: whether it runs under bf16 autocast (parallel.engine.autocast).
        device: the compute device.
        executor: the thread the frozen part runs on (named `THREAD`).
    """

    def __init__(self, model: nn.Module, bf16: bool, device: torch.device, executor: Executor):
        self.model, self.bf16, self.device, self.executor = model, bf16, device, executor
        self.next_input: torch.Tensor | None = None  # handed over by the trainer for the next step
        self.pending: tuple[torch.Tensor, object] | None = None  # (input, its features' future)
        self.wait_s, self.ahead_steps = 0.0, 0

    def look_ahead(self, x_next: torch.Tensor) -> None:
        """The input of the next step: its frozen features are computed while this step trains."""
        self.next_input = x_next

    @phased("offload frozen forward ahead")  # in a profile (Note [profiles])
    def _run(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), autocast(self.bf16, self.device):
            return self.model.frozen_forward(x)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen part's output for `x`: computed ahead during the last step, or now. Before waiting
        for it, the next input's features are queued behind it, to run while this step trains."""
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] is x:
            future = pending[1]
            self.ahead_steps += 1
        else:
            if pending is not None:
                finish(pending[1])  # another input than announced: let it end, drop it
            future = self.executor.submit(self._run, x)
        if self.next_input is not None:
            self.pending = (self.next_input, self.executor.submit(self._run, self.next_input))
            self.next_input = None
        t0 = time.perf_counter()
        features = future.result()
        self.wait_s += time.perf_counter() - t0
        return features

    def drain(self) -> None:
        """Wait for the features being computed ahead (they stay pending)."""
        if self.pending is not None:
            finish(self.pending[1])

    def tensors(self) -> list[torch.Tensor]:
        """The features made ahead, once made: on the other thread, unseen by the memory watch."""
        if self.pending is not None and self.pending[1].done():
            return [self.pending[1].result()]
        return []

    def metrics(self, steps: int) -> dict:
        """Seconds per step the head waited for the frozen features, and the share of `steps` whose features
        were ready ahead; both start over."""
        out = {"offload_frozen_wait_s": self.wait_s / steps, "offload_frozen_ahead": self.ahead_steps / steps}
        self.wait_s, self.ahead_steps = 0.0, 0
        return out
