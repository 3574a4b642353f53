"""The module and gradient hooks that stream blocks through forward and backward
(Note [offload engine] in parallel.strategies.offload.engine).

    forward   a block's forward pre-hook binds its weights (waiting for the
              read if needed) and starts reading the next `prefetch` blocks;
              its forward hook lets them go (in training, not the last
              `prefetch + 1`: backward starts with them).
    backward  a block's backward pre-hook binds it again and starts reading the
              `prefetch` blocks before it (and their saved activations) and
              the optimizer state of it and the block before it; once every
              trainable parameter of the block has its gradient
              (post-accumulate-grad hooks) the gradients are handed to the step.

Prefetching stays within a block's group: the frozen blocks run ahead
(Note [frozen lookahead]) and the rest never read into each other's pools.
"""
from __future__ import annotations

import threading
import warnings

import torch
from torch.utils.checkpoint import checkpoint

from parallel.batchnorm import recompute_contexts
from parallel.strategies.offload.activations import ActivationStore
from parallel.strategies.offload.adamw import BlockAdamW
from parallel.strategies.offload.layout import Block, Layout
from parallel.strategies.offload.lookahead import THREAD
from parallel.strategies.offload.stream import WeightStream

# The backward pre-hook of the first block fires although no input of it needs
# a gradient (its weights do); torch warns about that case, which is the one
# the engine relies on.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                        "to module outputs since no inputs require gradients")


class BlockHooks:
    """Binds, prefetches and lets go of blocks as forward and backward reach them; hands gradients off.

    Args:
        layout: the blocks and the resident parameters.
        stream: the block weights.
        adamw: the step the gradients are handed to.
        acts: the activations tier (None: activations stay on the device).
        prefetch: blocks read ahead of the one computing.
        n_frozen: leading blocks that never run backward.
        recompute: wrap each block's forward in activation checkpointing (strategy.activations=checkpoint).
    """

    def __init__(self, layout: Layout, stream: WeightStream, adamw: BlockAdamW, acts: ActivationStore | None,
                 prefetch: int, n_frozen: int, recompute: bool):
        self.blocks, self.resident = layout.blocks, layout.resident
        self.stream, self.adamw, self.acts = stream, adamw, acts
        self.prefetch, self.n_frozen, self.recompute = prefetch, n_frozen, recompute
        self.phase = "forward"

    def install(self) -> None:
        for b in self.blocks:
            b.module.register_forward_pre_hook(lambda m, a, b=b: self._before_forward(b))
            b.module.register_forward_hook(lambda m, a, o, b=b: self._after_forward(b))
            if any(s.param.requires_grad for s in b.slots) or self.stream.streaming:
                b.module.register_full_backward_pre_hook(lambda m, g, b=b: self._before_backward(b))
            for s in b.trainable:
                s.param.register_post_accumulate_grad_hook(lambda p, b=b: self._grad_ready(b))
            if self.recompute and not b.ahead:  # ahead: no_grad, nothing saved
                b.module.forward = self._checkpointed(b, b.module.forward)
        for p in self.resident:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.adamw.resident_grad_ready)

    def _checkpointed(self, b: Block, forward):
        """`forward` of block `b` under activation checkpointing. Its recomputation in backward binds the
        block's weights itself: the backward pre-hook that binds them otherwise does not fire for a block whose
        output is no tensor (a Hugging Face model's ModelOutput), and the module's forward hooks do not run
        around a recomputation. BatchNorm running statistics move once (Note [batch norm])."""
        contexts = recompute_contexts(b.module)

        def bound_forward(*args, **kwargs):
            self.stream.ensure(b)  # bound already in forward (the pre-hook): only a recomputation reads
            return forward(*args, **kwargs)

        return lambda *a, **k: checkpoint(bound_forward, *a, use_reentrant=False, context_fn=contexts, **k)

    def start_step(self) -> None:
        for b in self.blocks:
            b.grads_ready, b.done = 0, False
        self.phase = "forward"

    def end_step(self) -> None:
        """After backward: blocks whose parameters got no gradient this step (unused) still hand off what
        they have, and every block's weights are let go."""
        for b in self.blocks:
            if b.trainable and not b.done and b.grads_ready:
                self.adamw.grads_done(b)
            if b.buffer is not None and self.stream.streaming:
                self.stream.release(b)
            self.adamw.drop_states(b)

    def _prefetch(self, start: int, step: int) -> None:
        lo, hi = self.blocks[start].group
        if step < 0:
            lo = max(lo, self.n_frozen)
        for k in range(1, self.prefetch + 1):
            j = start + k * step
            if lo <= j < hi:
                if self.acts is not None and step < 0:
                    self.acts.prefetch(j)
                if not self.stream.fetch(self.blocks[j], wait=False):
                    return

    def _before_forward(self, b: Block) -> None:
        if b.ahead:
            self.stream.ensure(b)
            self._prefetch(b.index, +1)
            return
        if threading.current_thread().name.startswith(THREAD):
            raise RuntimeError(f"frozen_forward ran block {b.name!r}, which has trainable parameters: a model's "
                               "frozen_forward must run only its leading frozen blocks (Note [frozen lookahead])")
        if self.acts is not None:
            self.acts.block = b.index
        self.stream.ensure(b)
        if self.phase == "forward":
            self._prefetch(b.index, +1)

    def _after_forward(self, b: Block) -> None:
        if b.ahead or (self.phase == "forward" and not self._kept_for_backward(b)):
            self.stream.release(b)

    def _kept_for_backward(self, b: Block) -> bool:
        """Whether `b` stays bound after a training forward: the last `prefetch + 1` blocks, which backward
        reaches first, so it starts without reading them again."""
        return torch.is_grad_enabled() and b.index >= b.group[1] - (self.prefetch + 1)

    def _before_backward(self, b: Block) -> None:
        self.phase = "backward"
        self.stream.ensure(b)
        if self.acts is not None:
            self.acts.prefetch(b.index)
        self._prefetch(b.index, -1)
        lo = max(b.group[0], self.n_frozen)
        for j in (b.index, b.index - 1):  # this block's optimizer state, and the next one's in backward
            if j >= lo:
                self.adamw.prefetch_states(self.blocks[j])

    def _grad_ready(self, b: Block) -> None:
        b.grads_ready += 1
        if b.grads_ready == len(b.trainable):
            self.adamw.grads_done(b)
