"""The offload engine's optimizer step: AdamW or SGD block by block, on weights, gradients and state streamed
from the tiers (Note [offload engine] in parallel.strategies.offload.engine).

A block's gradients are handed off as soon as they are complete (`grads_done`):
without clipping its step runs at once on a host thread, overlapping the rest
of backward; with clipping they wait on the optimizer tier for the global norm
and `step` streams every block through after backward. The update is AdamW's
own functional form (or SGD's: momentum, dampening, nesterov, weight decay), one
call per parameter group (optim.no_decay, optim.lr_scale), so every number
matches `strategy=single`. The state keeps torch's own names (AdamW: step,
exp_avg, exp_avg_sq; SGD: momentum_buffer when momentum != 0), so checkpoints
move between offload and every other strategy.
"""
from __future__ import annotations

from concurrent.futures import Executor
from contextlib import contextmanager

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from parallel.config import OptimConfig
from parallel.optim import optimizer_class, optimizer_kwargs, param_groups
from parallel.profiling import phased
from parallel.strategies.offload.layout import Block, Layout, Slot
from parallel.strategies.offload.pool import BufferPool
from parallel.strategies.offload.stream import WeightStream
from parallel.strategies.offload.tiers import finish, settle

# The classes the offload step implements, and the optim.args each takes (besides lr and weight decay).
SUPPORTED = {torch.optim.AdamW: (), torch.optim.SGD: ("momentum", "dampening", "nesterov")}


def state_keys(o: OptimConfig) -> tuple[str, ...]:
    """The per-parameter state tensors of the configured optimizer as torch names them (besides AdamW's step);
    on the optimizer tier they are a block's `m` and `v`."""
    if optimizer_class(o) is torch.optim.SGD:
        return ("momentum_buffer",) if o.args.get("momentum", 0) else ()
    return ("exp_avg", "exp_avg_sq")


def _norm(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's 2-norm as torch's clipping computes it (the foreach kernel), so that the clip factor
    and every number after it equal strategy=single's."""
    return torch.nn.utils.get_total_norm([grad], 2.0, foreach=True)


class StepStream:
    """Where a block's step runs under a GPU: a stream of its own (nothing on the CPU).

    Its moments are read in first, then the update waits for the event recorded after its gradients were
    handed off (`ready`), not for everything the compute stream has queued since; its writes to the host follow
    the update on the write stream and are waited for on another thread (`BlockAdamW`). So the next block's
    moments come in while this block's results go out, both while backward computes the blocks before them.
    """

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def ready(self) -> "torch.cuda.Event | None":
        """An event after the work queued so far on the caller's stream (None on the CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        return event

    @contextmanager
    def on(self):
        """Run the body's GPU work on the step stream."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def after(self, ready: "torch.cuda.Event | None") -> None:
        """What the step stream queues next waits for `ready` (`ready()`'s event; None on the CPU)."""
        if self.stream is not None:
            self.stream.wait_event(ready)

    def done(self) -> "torch.cuda.Event | None":
        """An event after the step stream's work so far (None on the CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


class OffloadOptimizer(torch.optim.Optimizer):
    """The optimizer whose `step` streams blocks through the engine; its param groups carry the
    learning rate the scheduler sets. The state lives with `BlockAdamW`, not in `self.state`."""

    def __init__(self, block_adamw: "BlockAdamW", groups, **kwargs):
        super().__init__(groups, kwargs)
        self.block_adamw = block_adamw

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        self.block_adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        self.block_adamw.drop_waiting()  # nothing, after a step that ran
        for p in self.block_adamw.resident:
            p.grad = None


class BlockAdamW:
    """The optimizer's state and step (AdamW or SGD) for every offloaded and resident parameter.

    Args:
        optim: the optimizer group (its class, settings and parameter groups).
        deferred: whether blocks step after backward, the global norm first, rather than during it
            (OffloadSettings.deferred).
        layout: the blocks and the resident parameters.
        stream: the block weights (read here when the step needs them).
        tier: the optimizer tier (None: state and waiting gradients stay on the device).
        pool: the buffers gradients, moments and streamed weights pass through.
        stepper: the thread a block's step runs on without clipping.
        finisher: the thread that waits for a step's writes and gives its buffers back.
        device: the compute device.
    """

    def __init__(self, optim: OptimConfig, deferred: bool, layout: Layout, stream: WeightStream, tier,
                 pool: BufferPool, stepper: Executor, finisher: Executor, device: torch.device):
        self.optim_cfg, self.deferred = optim, deferred
        self.halted = False  # during backward: a block's gradients were not finite, no later block steps
        self.cls = optimizer_class(optim)
        self.kwargs = optimizer_kwargs(optim, self.cls)
        self.keys = state_keys(optim)
        self.params, self.blocks, self.resident = layout.params, layout.blocks, layout.resident
        self.stream, self.tier, self.pool, self.stepper, self.device = stream, tier, pool, stepper, device
        self.last_step = None  # the block step in flight (without clipping)
        self.finisher = finisher
        self.finishing: list = []  # the steps whose writes are being waited for (`_finish_later`)
        # (block, buffer): a block stepped first in the next forward, whose new weights stay bound for it
        self.kept: list[tuple[Block, torch.Tensor]] = []
        self.step_stream = StepStream(device)
        # AdamW's step counters, made as torch.optim.AdamW makes them (the planner's fake tensors can read
        # a value made this way)
        self.steps = {p: torch.tensor(0.0, dtype=torch.float32) for p in self.params}
        self.started: set[nn.Parameter] = set()  # SGD: parameters whose momentum buffer exists
        self.state_in_memory: dict[int, list[torch.Tensor]] = {}  # block -> its state tensors (`keys`)
        self.grads_in_memory: dict[int, torch.Tensor] = {}  # block -> gradients waiting for the step
        self.resident_state: dict[nn.Parameter, list[torch.Tensor]] = {}
        self.group_of: dict[nn.Parameter, int] = {}
        self.norms: dict[nn.Parameter, torch.Tensor] = {}
        self.coef: torch.Tensor | None = None
        self.optimizer: OffloadOptimizer | None = None

    def make_optimizer(self, names: dict[int, str]) -> OffloadOptimizer:
        """The optimizer the trainer and the scheduler see, its groups made from the parameters' `names`."""
        groups = param_groups(self.params, names, self.optim_cfg)
        self.optimizer = OffloadOptimizer(self, groups, **self.kwargs)
        self.group_of = {p: i for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        return self.optimizer

    def hyper(self) -> list[dict]:
        """Every group's settings now (lr as the scheduler set it), for a step that may run later."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def start_step(self) -> None:
        self.norms, self.coef, self.halted = {}, None, False

    def finite(self, slots: list[Slot]) -> bool:
        """Whether a block stepped during backward may apply its gradients: they are finite, and so were every
        earlier block's this step (Note [non-finite steps]). One read of its norms (none on fake tensors)."""
        norms = [self.norms[s.param] for s in slots]
        if not self.halted and norms and not is_fake(norms[0]):
            self.halted = not bool(torch.isfinite(torch.stack(norms)).all())
        return not self.halted

    def drop_waiting(self) -> None:
        """The gradients of a step that did not run (skipped: Note [non-finite steps]): their buffers back."""
        for b in self.blocks:
            if not b.grad_slots:
                continue
            if self.tier is None:
                self.pool.give(self.grads_in_memory.pop(b.index))
            else:
                finish(b.grads_write)  # its buffer returns when the write is done
            b.grad_slots = []

    def wait(self) -> None:
        """Wait for the block step in flight, if any, and for every step's writes; then the blocks stepped
        first in the next forward are bound to their new weights (the newest, where several steps kept some)."""
        if self.last_step is not None:
            finish(self.last_step)
            self.last_step = None
        while self.finishing:
            finish(self.finishing.pop(0))
        kept, self.kept = self.kept, []
        for b, buf in reversed(kept):
            if b.buffer is None:
                b.buffer, b.pending = buf, None
                self.stream.bind(b)
            else:
                b.pool.give(buf)

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
        if self.deferred:
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
            finish(self.last_step)  # one step being queued at a time (its writes end on the finisher thread)
        ready = self.step_stream.ready()  # after the gradients' copies and the block's backward
        ahead, b.state_reads = b.state_reads, None
        self.last_step = self.stepper.submit(self._step_block, b, slots, params, grads, None, self.hyper(), ready,
                                             ahead)

    def _keep_grads(self, b: Block, grads: torch.Tensor) -> None:
        """With clipping: `b`'s gradients wait for the global norm on the optimizer tier (or the device)."""
        if self.tier is None:
            self.grads_in_memory[b.index] = grads  # kept until the step
            return
        w = b.grads_write = self.tier.write(b.key("g"), grads[:b.trained])
        if hasattr(w, "add_done_callback"):  # a disk write: the buffer returns when it is done
            w.add_done_callback(lambda _, buf=grads: self.pool.give(buf))
        else:
            finish(w)
            self.pool.give(grads)

    def prefetch_states(self, b: Block) -> None:
        """Start reading `b`'s optimizer state into pool buffers ahead of its step (Note [offload engine]):
        without clipping, with state on a tier, and only while the pool keeps enough free buffers for a whole
        step (gradients, state) besides."""
        if (self.tier is None or self.deferred or not self.keys or not b.state_ready or b.done
                or b.state_reads is not None or not b.trainable):
            return
        bufs = self.pool.take_spare(len(self.keys), reserve=2 + len(self.keys))
        if bufs is not None:
            b.state_reads = (bufs, [self.tier.read(b.key(kind), buf[:b.trained]) for kind, buf in zip("mv", bufs)])

    def drop_states(self, b: Block) -> None:
        """The state read ahead for a block that did not step (no gradient this step): its buffers back."""
        if b.state_reads is not None:
            bufs, reads = b.state_reads
            b.state_reads = None
            for r in reads:
                settle(r)  # no stream of the next taker is ordered after this read
            for buf in bufs:
                self.pool.give(buf)

    def states(self, b: Block, ahead=None) -> tuple[list[torch.Tensor], bool]:
        """The state tensors (`keys`) of `b`: (flat buffers, whether they come from the pool). `ahead`: what
        `prefetch_states` read, waited for here (on the step stream under a GPU)."""
        if ahead is not None:
            bufs, reads = ahead
            for r in reads:
                finish(r)
            return bufs, True
        if self.tier is None:
            if b.index not in self.state_in_memory:
                self.state_in_memory[b.index] = [torch.zeros(b.trained, dtype=torch.uint8, device=self.device)
                                                  for _ in self.keys]
            return self.state_in_memory[b.index], False
        bufs = [self.pool.take() for _ in self.keys]  # given back by the finisher thread, never by this one
        for kind, buf in zip("mv", bufs):
            if b.state_ready:
                finish(self.tier.read(b.key(kind), buf[:b.trained]))
            else:
                buf.zero_()
        return bufs, True

    def _update(self, params: list[nn.Parameter], weights: list[torch.Tensor], grads: list[torch.Tensor],
                states: list[list[torch.Tensor]], hyper: list[dict]) -> None:
        """The optimizer's functional step on `weights` (the storage of `params`), one call per group."""
        by_group: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            by_group.setdefault(self.group_of[p], []).append(i)
        for g, idx in by_group.items():
            h = hyper[g]
            w, gs, st = [weights[i] for i in idx], [grads[i] for i in idx], [states[i] for i in idx]
            ps = [params[i] for i in idx]
            if self.cls is torch.optim.AdamW:
                # The multi-tensor kernel: 1.25x the per-tensor loop on the host and bit-equal to it
                # (benchmarks/host_step.py); the planner's fake tensors take the loop, whose step count is a
                # tensor op rather than a value read.
                foreach = not is_fake(w[0])
                adamw(w, gs, [s[0] for s in st], [s[1] for s in st], [], [self.steps[p] for p in ps], foreach=foreach,
                      amsgrad=False, beta1=h["betas"][0], beta2=h["betas"][1], lr=h["lr"], weight_decay=h["weight_decay"],
                      eps=h["eps"], maximize=False)
                continue
            # SGD starts its momentum buffer as a copy of the first gradient: it is handed None then, and what
            # it made is kept in the buffer's home.
            bufs = [s[0] if s and p in self.started else None for s, p in zip(st, ps)]
            sgd(w, gs, bufs, foreach=False, weight_decay=h["weight_decay"], momentum=h.get("momentum", 0),
                lr=h["lr"], dampening=h.get("dampening", 0), nesterov=h.get("nesterov", False), maximize=False)
            for s, buf, p in zip(st, bufs, ps):
                if s and buf is not s[0]:
                    s[0].copy_(buf)
                self.started.add(p)

    @torch.no_grad()
    @phased("offload optimizer step")  # in a profile (Note [profiles])
    def _step_block(self, b: Block, slots: list[Slot], params: torch.Tensor | None, grads: torch.Tensor,
                    coef: torch.Tensor | None, hyper: list[dict], ready, ahead=None) -> None:
        """The step of block `b` (weights in `params`, or read here; its state as `states` gives it), then
        everything written back. Under a GPU it is queued on the step stream, the update after `ready`
        (`StepStream`), and returns once queued: the finisher thread waits for the writes and gives the buffers
        back (`_finish_later`). The first block of the next forward keeps its new weights (`kept`)."""
        streaming, tier_w = self.stream.streaming, self.stream.tier
        with self.step_stream.on():
            read = None
            if params is None and streaming:
                params = self.pool.take()
                read = tier_w.read(b.key(), params[:b.nbytes])
            elif params is None:
                params = b.buffer
            bufs, pooled = self.states(b, ahead)
            finish(read)  # (None: nothing read)
            self.step_stream.after(ready)
            writes = []
            # During backward, non-finite gradients step nothing from here on (the trainer then stops the run)
            if self.deferred or self.finite(slots):
                gs = [s.view(grads) for s in slots]
                if coef is not None:
                    for g in gs:
                        g.mul_(coef)
                self._update([s.param for s in slots], [s.view(params) for s in slots], gs,
                             [[s.view(buf) for buf in bufs] for s in slots], hyper)
                if streaming:
                    writes.append(tier_w.write(b.key(), params[:b.trained]))  # the frozen rest is unchanged
                if pooled:
                    writes += [self.tier.write(b.key(kind), buf[:b.trained]) for kind, buf in zip("mv", bufs)]
                    b.state_ready = True
            done = self.step_stream.done()
        keep = streaming and b.index == b.group[0]
        if keep:
            self.kept.append((b, params))  # bound by `wait` once every write is done
        self._finish_later(writes, done, ([params] if streaming and not keep else []) + (bufs if pooled else [])
                           + [grads])

    def _finish_later(self, writes: list, done, buffers: list[torch.Tensor]) -> None:
        """On the finisher thread: wait for `writes` and the step stream's `done` event, then give `buffers`
        back to the pool (only then may another transfer or step use them)."""
        def run():
            for w in writes:
                finish(w)
            if done is not None:
                done.synchronize()
            for buf in buffers:
                self.pool.give(buf)
        self.finishing = [f for f in self.finishing if not f.done() or f.exception() is not None]
        self.finishing.append(self.finisher.submit(run))

    @torch.no_grad()
    def step(self) -> None:
        """The optimizer step of what backward left: every block when clipping, and the resident weights."""
        hyper = self.hyper()
        self.wait()
        if self.deferred:
            for b in self.blocks:
                slots = b.grad_slots
                if not slots:
                    continue
                if self.tier is None:
                    grads = self.grads_in_memory.pop(b.index)
                else:
                    finish(b.grads_write)  # a file being written reads short
                    grads = self.pool.take()
                    finish(self.tier.read(b.key("g"), grads[:b.trained]))
                # after the gradients' read and the clip factor, queued on this thread's stream
                self._step_block(b, slots, None, grads, self.coef, hyper, self.step_stream.ready())
                b.grad_slots = []
        live = [p for p in self.resident if p.grad is not None]
        if live:
            if self.coef is not None:
                for p in live:
                    p.grad.mul_(self.coef)
            states = [self.resident_state.setdefault(p, [torch.zeros_like(p) for _ in self.keys]) for p in live]
            self._update(live, live, [p.grad for p in live], states, hyper)
        self.wait()  # every block's new weights written before the next forward reads them

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
        """Device tensors of the step kept between steps: gradients waiting for it, its state on the device."""
        out = list(self.grads_in_memory.values())
        for bufs in self.state_in_memory.values():
            out += list(bufs)
        for bufs in self.resident_state.values():
            out += list(bufs)
        return out
