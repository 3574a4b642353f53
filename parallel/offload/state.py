"""The offload engine's state in and out of the tiers, under the original parameter names: the initial
values, the full state dict, and a checkpoint's weights and AdamW state (Note [offload engine] in
parallel.offload.engine)."""
from __future__ import annotations

import torch
from torch import nn

from parallel.init import InitPlan, Values
from parallel.offload.adamw import BlockAdamW
from parallel.offload.layout import Layout
from parallel.offload.stream import WeightStream
from parallel.offload.tiers import finish


class OffloadState:
    """Reads and writes every weight, buffer and AdamW moment where it lives.

    Args:
        model: the model (its buffers and resident parameters are its own).
        layout: the blocks and the resident parameters.
        stream: the block weights.
        adamw: the AdamW state and step.
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
        """AdamW's state of every trainable parameter under its original name (CPU copies; zeros before the
        first step, as AdamW starts it)."""
        adamw, fqns, optim = self.adamw, self.layout.fqns, {}

        def put(p: nn.Parameter, m: torch.Tensor, v: torch.Tensor) -> None:
            optim[fqns[p]] = {"step": adamw.steps[p].clone(), "exp_avg": m.detach().cpu().clone(),
                              "exp_avg_sq": v.detach().cpu().clone()}

        for b in self.layout.blocks:
            if b.trainable:
                m, v, pooled = adamw.states(b)
                for s in b.trainable:
                    put(s.param, s.view(m), s.view(v))
                if pooled:
                    adamw.pool.give(m)
                    adamw.pool.give(v)
        for p in self.layout.resident:
            if p.requires_grad:
                put(p, *adamw.resident_state.get(p, (torch.zeros_like(p), torch.zeros_like(p))))
        return optim

    @torch.no_grad()
    def load(self, model: dict, optim: dict) -> None:
        """Write loaded weights, buffers and AdamW state (as `full_state_dict` and `optimizer_state` give
        them) to their homes."""
        self._load_blocks(model, optim)
        adamw = self.adamw
        for fqn, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in self.layout.block_of:
                p.copy_(model[fqn])
        for p in self.layout.resident:
            if p.requires_grad:
                s = optim[self.layout.fqns[p]]
                adamw.resident_state[p] = (s["exp_avg"].to(self.device).clone(),
                                           s["exp_avg_sq"].to(self.device).clone())
                adamw.steps[p].copy_(s["step"])
        for fqn, buf in self._saved_buffers():
            buf.copy_(model[fqn])

    def _load_blocks(self, model: dict, optim: dict) -> None:
        """Each block's weights to the params tier (or its own buffer) and its moments to the optimizer tier."""
        stream, adamw = self.stream, self.adamw
        for b in self.layout.blocks:
            flat = b.pool.take() if stream.streaming else b.buffer
            for s in b.slots:
                s.view(flat).copy_(model[s.fqn])
            if stream.streaming:
                finish(stream.tier.write(b.key(), flat[:b.nbytes]))
                b.pool.give(flat)
            if b.trainable:
                m, v, pooled = adamw.states(b)
                for s in b.trainable:
                    s.view(m).copy_(optim[s.fqn]["exp_avg"])
                    s.view(v).copy_(optim[s.fqn]["exp_avg_sq"])
                    adamw.steps[s.param].copy_(optim[s.fqn]["step"])
                if pooled:
                    finish(adamw.tier.write(b.key("m"), m[:b.nbytes]))
                    finish(adamw.tier.write(b.key("v"), v[:b.nbytes]))
                    b.state_ready = True
                    adamw.pool.give(m)
                    adamw.pool.give(v)
