"""The offload engine's state in and out of the tiers, under the original parameter names: the initial
values, the full state dict, and a checkpoint's weights and optimizer state (Note [offload engine] in
parallel.strategies.offload.engine)."""
from __future__ import annotations

import torch
from torch import nn

from parallel.init import InitPlan, Values
from parallel.strategies.offload.adamw import BlockAdamW
from parallel.strategies.offload.layout import Layout
from parallel.strategies.offload.stream import WeightStream
from parallel.strategies.offload.tiers import finish


class OffloadState:
    """Reads and writes every weight, buffer and optimizer state tensor where it lives.

    Args:
        model: the model (its buffers and resident parameters are its own).
        layout: the blocks and the resident parameters.
        stream: the block weights.
        adamw: the optimizer's state and step.
        device: the compute device.
    """

    def __init__(self, model: nn.Module, layout: Layout, stream: WeightStream, adamw: BlockAdamW,
                 device: torch.device):
        self.model, self.layout, self.stream, self.adamw, self.device = model, layout, stream, adamw, device

    @torch.no_grad()
    def write_initial(self, plan: InitPlan, values: Values) -> None:
        """Write every parameter's initial value (Note [initial values]) straight into its home,
        one block at a time, then install the real parameters."""
        layout = self.layout

        def value(fqn: str, shape, dtype) -> torch.Tensor:
            return values.full(fqn, plan[fqn], shape, dtype)

        for p in layout.resident:
            shape, dtype = layout.shapes[p]
            p.data = value(layout.fqns[p], shape, dtype).to(self.device)
        for module in self.model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=self.device)
        for fqn, buf in self.model.named_buffers():
            buf.copy_(value(fqn, buf.shape, buf.dtype))
        for b in layout.blocks:
            flat = b.pool.take()
            for s in b.slots:
                s.view(flat).copy_(value(s.fqn, s.shape, s.dtype))
            if self.stream.streaming:
                finish(self.stream.tier.write(b.key(), flat[:b.nbytes]))
            else:
                b.buffer = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
                b.buffer.copy_(flat[:b.nbytes])
            b.pool.give(flat)
        layout.install()
        if not self.stream.streaming:
            for b in layout.blocks:
                self.stream.bind(b)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """Every parameter and persistent buffer under its original name (CPU tensors)."""
        state = {}
        for b in self.layout.blocks:
            was_bound = b.buffer is not None
            self.stream.ensure(b)
            for s in b.slots:
                state[s.fqn] = s.view(b.buffer).detach().cpu().clone()
            if not was_bound:
                self.stream.release(b)
        for fqn, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in self.layout.block_of:
                state[fqn] = p.detach().cpu().clone()
        for fqn, buf in self._saved_buffers():
            state[fqn] = buf.detach().cpu().clone()
        return state

    def _saved_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers a state dict holds: not the non-persistent ones (a rotary embedding's `inv_freq`), which
        the model's `state_dict`, `load_state_dict(strict=True)` and the checkpoint check leave out."""
        saved = self.model.state_dict(keep_vars=True)
        return [(fqn, buf) for fqn, buf in self.model.named_buffers() if fqn in saved]

    @torch.no_grad()
    def optimizer_state(self) -> dict:
        """The optimizer's state of every trainable parameter under its original name and torch's keys (CPU
        copies; zeros before the first step)."""
        adamw, fqns, optim = self.adamw, self.layout.fqns, {}

        def put(p: nn.Parameter, bufs: list[torch.Tensor]) -> None:
            state = {k: t.detach().cpu().clone() for k, t in zip(adamw.keys, bufs)}
            if adamw.cls is torch.optim.AdamW:
                state["step"] = adamw.steps[p].clone()
            optim[fqns[p]] = state

        for b in self.layout.blocks:
            if b.trainable:
                bufs, pooled = adamw.states(b)
                for s in b.trainable:
                    put(s.param, [s.view(buf) for buf in bufs])
                for buf in bufs if pooled else []:
                    adamw.pool.give(buf)
        for p in self.layout.resident:
            if p.requires_grad:
                put(p, adamw.resident_state.get(p, [torch.zeros_like(p) for _ in adamw.keys]))
        return optim

    @torch.no_grad()
    def load(self, model: dict, optim: dict) -> None:
        """Write loaded weights, buffers and optimizer state (as `full_state_dict` and `optimizer_state` give
        them) to their homes."""
        self._load_blocks(model, optim)
        adamw = self.adamw
        for fqn, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in self.layout.block_of and fqn in model:
                p.copy_(model[fqn])
        for p in self.layout.resident:
            if p.requires_grad:
                s = optim[self.layout.fqns[p]]
                adamw.resident_state[p] = [s[k].to(self.device).clone() for k in adamw.keys]
                self._loaded(p, s)
        for fqn, buf in self._saved_buffers():
            buf.copy_(model[fqn])

    def _loaded(self, p: nn.Parameter, state: dict) -> None:
        """`p`'s step counter as saved (AdamW), or its momentum buffer marked as made (SGD)."""
        if "step" in state:
            self.adamw.steps[p].copy_(state["step"])
        if self.adamw.keys:
            self.adamw.started.add(p)

    def _load_blocks(self, model: dict, optim: dict) -> None:
        """Each block's weights to the params tier (or its own buffer) and its state to the optimizer tier."""
        stream, adamw = self.stream, self.adamw
        for b in self.layout.blocks:
            flat = b.pool.take() if stream.streaming else b.buffer
            if stream.streaming and any(s.fqn not in model for s in b.slots):
                finish(stream.tier.read(b.key(), flat[:b.nbytes]))  # what the checkpoint leaves out stays
            for s in b.slots:
                if s.fqn in model:  # a LoRA checkpoint holds no frozen weights (Note [LoRA])
                    s.view(flat).copy_(model[s.fqn])
            if stream.streaming:
                finish(stream.tier.write(b.key(), flat[:b.nbytes]))
                b.pool.give(flat)
            if b.trainable:
                bufs, pooled = adamw.states(b)
                for s in b.trainable:
                    for k, buf in zip(adamw.keys, bufs):
                        s.view(buf).copy_(optim[s.fqn][k])
                    self._loaded(s.param, optim[s.fqn])
                if pooled:
                    for kind, buf in zip("mv", bufs):
                        finish(adamw.tier.write(b.key(kind), buf[:b.trained]))
                        adamw.pool.give(buf)
                    b.state_ready = True
