"""The offload engine's optimizer step: AdamW block by block, on weights, gradients and state streamed from the
tiers (Note [offload engine] in parallel.offload.engine).

A block's gradients are handed off as soon as they are complete (`grads_done`):
without clipping its step runs at once on a host thread, overlapping the rest
of backward; with clipping they wait on the optimizer tier for the global norm
and `step` streams every block through after backward. The update is AdamW's
own functional form, so every number matches `strategy=single`.
"""
from __future__ import annotations

from concurrent.futures import Executor

import torch
from torch import nn
from torch.optim.adamw import adamw

from parallel.config import Config
from parallel.offload.layout import Block, Layout, Slot
from parallel.offload.pool import BufferPool
from parallel.offload.stream import WeightStream
from parallel.offload.tiers import finish


def _norm(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's 2-norm as torch's clipping computes it (the foreach kernel), so that the clip factor
    and every number after it equal strategy=single's."""
    return torch.nn.utils.get_total_norm([grad], 2.0, foreach=True)


class OffloadOptimizer(torch.optim.AdamW):
    """AdamW whose `step` streams blocks through the engine; its param groups carry the
    learning rate the scheduler sets. The state lives with `BlockAdamW`, not in `self.state`."""

    def __init__(self, block_adamw: "BlockAdamW", params, **kwargs):
        super().__init__(params, **kwargs)
        self.block_adamw = block_adamw

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        self.block_adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        for p in self.block_adamw.resident:
            p.grad = None


class BlockAdamW:
    """AdamW's state and step for every offloaded and resident parameter.

    Args:
        cfg: the run config (optim, trainer.clip_grad_norm).
        layout: the blocks and the resident parameters.
        stream: the block weights (read here when the step needs them).
        tier: the optimizer tier (None: state and waiting gradients stay on the device).
        pool: the buffers gradients, moments and streamed weights pass through.
        stepper: the thread a block's step runs on without clipping.
        device: the compute device.
    """

    def __init__(self, cfg: Config, layout: Layout, stream: WeightStream, tier, pool: BufferPool,
                 stepper: Executor, device: torch.device):
        self.optim_cfg, self.clip_norm = cfg.optim, cfg.trainer.clip_grad_norm
        self.params, self.blocks, self.resident = layout.params, layout.blocks, layout.resident
        self.stream, self.tier, self.pool, self.stepper, self.device = stream, tier, pool, stepper, device
        self.last_step = None  # the block step in flight (without clipping)
        # AdamW's step counters, made as torch.optim.AdamW makes them (the planner's fake tensors can read
        # a value made this way)
        self.steps = {p: torch.tensor(0.0, dtype=torch.float32) for p in self.params}
        self.state_in_memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block -> (exp_avg, exp_avg_sq)
        self.grads_in_memory: dict[int, torch.Tensor] = {}  # block -> gradients waiting for the step
        self.resident_state: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}
        self.norms: dict[nn.Parameter, torch.Tensor] = {}
        self.coef: torch.Tensor | None = None
        self.optimizer: OffloadOptimizer | None = None

    def make_optimizer(self) -> OffloadOptimizer:
        o = self.optim_cfg
        self.optimizer = OffloadOptimizer(self, self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                          weight_decay=o.weight_decay)
        return self.optimizer

    def start_step(self) -> None:
        self.norms, self.coef = {}, None

    def wait(self) -> None:
        """Wait for the block step in flight, if any."""
        if self.last_step is not None:
            finish(self.last_step)
            self.last_step = None

    def resident_grad_ready(self, p: nn.Parameter) -> None:
        self.norms[p] = _norm(p.grad)

    def grads_done(self, b: Block) -> None:
        """Every gradient of `b` is complete: hand them off and let the weights go (Note [offload engine])."""
        if b.done:
            return
        b.done = True
        slots = [s for s in b.trainable if s.param.grad is not None]
        for s in slots:
            self.norms[s.param] = _norm(s.param.grad)
        grads = self.pool.take()
        for s in slots:
            s.view(grads).copy_(s.param.grad)
            s.param.grad = None
        if self.clip_norm > 0:
            self.stream.release(b)
            self._keep_grads(b, grads)
            b.grad_slots = slots
            return
        # No clipping: step now, on the host thread, while backward goes on.
        params = b.buffer if self.stream.streaming else None
        if params is not None:
            if b.pending is not None:
                finish(b.pending)
            self.stream.unbind(b)
        if self.last_step is not None:
            finish(self.last_step)  # one step in flight at a time bounds the buffers it holds
        lr = self.optimizer.param_groups[0]["lr"]
        self.last_step = self.stepper.submit(self._step_block, b, slots, params, grads, None, lr)

    def _keep_grads(self, b: Block, grads: torch.Tensor) -> None:
        """With clipping: `b`'s gradients wait for the global norm on the optimizer tier (or the device)."""
        if self.tier is None:
            self.grads_in_memory[b.index] = grads  # kept until the step
            return
        w = b.grads_write = self.tier.write(b.key("g"), grads[:b.nbytes])
        if hasattr(w, "add_done_callback"):  # a disk write: the buffer returns when it is done
            w.add_done_callback(lambda _, buf=grads: self.pool.give(buf))
        else:
            finish(w)
            self.pool.give(grads)

    def states(self, b: Block) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """AdamW's two moments for `b`: (exp_avg, exp_avg_sq, from the pool)."""
        if self.tier is None:
            if b.index not in self.state_in_memory:
                self.state_in_memory[b.index] = (torch.zeros(b.nbytes, dtype=torch.uint8, device=self.device),
                                                 torch.zeros(b.nbytes, dtype=torch.uint8, device=self.device))
            m, v = self.state_in_memory[b.index]
            return m, v, False
        m, v = self.pool.take(), self.pool.take()
        if b.state_ready:
            finish(self.tier.read(b.key("m"), m[:b.nbytes]))
            finish(self.tier.read(b.key("v"), v[:b.nbytes]))
        else:
            m.zero_()
            v.zero_()
        return m, v, True

    def _adamw(self, params, grads, exp_avgs, exp_avg_sqs, steps, lr: float) -> None:
        o = self.optim_cfg
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, amsgrad=False, beta1=o.betas[0],
              beta2=o.betas[1], lr=lr, weight_decay=o.weight_decay, eps=o.eps, maximize=False)

    @torch.no_grad()
    def _step_block(self, b: Block, slots: list[Slot], params: torch.Tensor | None, grads: torch.Tensor,
                    coef: torch.Tensor | None, lr: float) -> None:
        """AdamW on block `b` (weights in `params`, or read here), then everything written back."""
        streaming, tier_w = self.stream.streaming, self.stream.tier
        if params is None and streaming:
            params = self.pool.take()
            finish(tier_w.read(b.key(), params[:b.nbytes]))
        elif params is None:
            params = b.buffer
        m, v, pooled = self.states(b)
        gs = [s.view(grads) for s in slots]
        if coef is not None:
            for g in gs:
                g.mul_(coef)
        self._adamw([s.view(params) for s in slots], gs, [s.view(m) for s in slots], [s.view(v) for s in slots],
                    [self.steps[s.param] for s in slots], lr)
        writes = []
        if streaming:
            writes.append(tier_w.write(b.key(), params[:b.nbytes]))
        if pooled:
            writes += [self.tier.write(b.key("m"), m[:b.nbytes]), self.tier.write(b.key("v"), v[:b.nbytes])]
            b.state_ready = True
        for w in writes:
            finish(w)
        if streaming:
            self.pool.give(params)
        if pooled:
            self.pool.give(m)
            self.pool.give(v)
        self.pool.give(grads)

    @torch.no_grad()
    def step(self) -> None:
        """The optimizer step of what backward left: every block when clipping, and the resident weights."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.wait()
        if self.clip_norm > 0:
            for b in self.blocks:
                slots = b.grad_slots
                if not slots:
                    continue
                if self.tier is None:
                    grads = self.grads_in_memory.pop(b.index)
                else:
                    finish(b.grads_write)  # a file being written reads short
                    grads = self.pool.take()
                    finish(self.tier.read(b.key("g"), grads[:b.nbytes]))
                self._step_block(b, slots, None, grads, self.coef, lr)
                b.grad_slots = []
        live = [p for p in self.resident if p.grad is not None]
        if live:
            if self.coef is not None:
                for p in live:
                    p.grad.mul_(self.coef)
            states = [self.resident_state.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p))) for p in live]
            self._adamw(live, [p.grad for p in live], [s[0] for s in states], [s[1] for s in states],
                        [self.steps[p] for p in live], lr)

    def clip(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (every parameter's, in model order); sets the clip factor the step applies."""
        norms = [self.norms[p] for p in self.params if p in self.norms]
        # As parallel.optim.clip_grads computes it, to the last bit: the norm of the per-tensor norms, squared
        # and rooted again.
        total = (torch.linalg.vector_norm(torch.stack(norms)).float() ** 2).sqrt() if norms else torch.zeros(())
        if max_norm > 0:
            self.coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    def tensors(self) -> list[torch.Tensor]:
        """Device tensors of the step kept between steps: gradients waiting for it, AdamW state on the device."""
        out = list(self.grads_in_memory.values())
        for pair in self.state_in_memory.values():
            out += list(pair)
        for pair in self.resident_state.values():
            out += list(pair)
        return out
