"""strategy=offload: one device; weights, gradients, optimizer state and activations streamed from the tiers below.

# Note [offload engine]
The model is cut into blocks (the same candidates the pipeline split uses: the
top-level children in forward order, ModuleList children one level down).
Each block's parameters are packed into one flat byte buffer whose home is the
params tier; every parameter object stays the same for the whole run, and its
`.data` points either into a bound buffer or at an empty placeholder.

  forward   a block's forward pre-hook binds its buffer (waiting for the read
            if needed) and starts reading the next `prefetch` blocks; its
            forward hook unbinds it.
  backward  a block's backward pre-hook binds it again and starts reading the
            `prefetch` blocks before it (and their saved activations). When
            every trainable parameter of the block has its gradient
            (post-accumulate-grad hooks), the gradients leave the device:
            - without clipping (trainer.clip_grad_norm=0) the block's AdamW
              step runs right then on a host thread, overlapping the rest of
              backward, and writes the new weights and state back;
            - with clipping, the step needs the global norm first: gradients
              go to the optimizer tier, and `OffloadOptimizer.step` streams
              every block (weights, gradients, state) through the step after
              backward.
  buffers   come from a pool of `4 x (prefetch + 1)` buffers of the largest
            block's size, so device memory is bounded by block sizes and the
            prefetch depth, not by the model.

Saved tensors that are views of a bound buffer (a Linear saves its weight's
transpose) would read another block's bytes once the buffer is reused, so a
saved-tensors hook records them as (block, view) and rebuilds the view from the
block's buffer at unpack, binding the block if it is not. Other saved tensors
go to the activations tier (parallel.offload.activations) or stay.

Parameters held by several blocks (tied weights) and those outside every
block stay resident. The step is AdamW's own functional form, so every number
matches `strategy=single`.

# Note [frozen lookahead]
A model whose leading blocks are frozen (no trainable parameter) and that
splits its forward into `frozen_forward(x)` and `trainable_forward(features)`
(the built-in `stacked` does) gets the frozen part run one batch ahead: while
the head trains on batch k, a thread of its own streams the frozen blocks over
batch k+1 (the trainer hands the engine the next input, `look_ahead`). The
frozen blocks have a buffer pool of their own, sized by the largest frozen
block, so the two parts never share buffers and the head's pool is sized by
the head. Correct because frozen weights never change: the features of batch
k+1 are the same before and after step k. The frozen part runs under no_grad,
so it saves nothing for backward.
"""
from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.adamw import adamw
from torch.utils.checkpoint import checkpoint

from parallel.blocks import candidates
from parallel.config import Config, RunError
from parallel.data import example_input
from parallel.engine import Engine, autocast
from parallel.init import InitPlan, full_init_value
from parallel.loss import loss_fn
from parallel.metrics import log
from parallel.offload.activations import ActivationStore
from parallel.offload.tiers import Counters, DiskTier, HostTier, check_disk, effective, finish
from parallel.runtime import Runtime

ALIGN = 64

# The backward pre-hook of the first block fires although no input of it needs
# a gradient (its weights do); torch warns about that case, which is the one
# the engine relies on.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                        "to module outputs since no inputs require gradients")


@dataclass
class Slot:
    """One parameter's place in its block's flat buffer."""

    param: nn.Parameter
    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass
class Block:
    index: int
    name: str
    module: nn.Module
    slots: list[Slot]
    nbytes: int
    buffer: torch.Tensor | None = None  # bound or being read
    pending: object = None
    grads_ready: int = 0
    done: bool = False  # gradients handed off this step
    state_ready: bool = False  # AdamW state exists on the optimizer tier
    grad_slots: list[Slot] = field(default_factory=list)  # with clipping: whose gradients wait for the step
    grads_write: object = None  # the write of those gradients to the optimizer tier
    pool: "BufferPool | None" = None  # where its weights are read into
    group: tuple[int, int] = (0, 0)  # the blocks [lo, hi) that prefetching stays within
    ahead: bool = False  # a frozen block run one batch ahead (Note [frozen lookahead])

    @property
    def trainable(self) -> list[Slot]:
        return [s for s in self.slots if s.param.requires_grad]


def _return_freed_memory() -> None:
    """Have glibc give large freed blocks back to the system at once (Linux only).

    glibc raises its mmap threshold after the first large free, so later
    tensors of that size come from the heap, where freed space stays in the
    process: the activations that went to disk would still count against the
    process's memory. A fixed 1 MiB threshold keeps large tensors in their own
    mappings, returned when freed.
    """
    import ctypes
    import sys

    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 1 << 20)


def _norm(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's 2-norm as torch's clipping computes it (the foreach kernel), so that the clip factor
    and every number after it equal strategy=single's."""
    return torch.nn.utils.get_total_norm([grad], 2.0, foreach=True)


class BufferPool:
    """`capacity` flat byte buffers of one size, reused.

    All of them are allocated at the start: the device memory the engine
    holds is then the same from the first step on, whatever the timing of the
    transfers (made on demand, the count would depend on how long writes keep
    buffers busy), so a run that does not fit fails at once, and the planner's
    prediction (parallel.planner) is what the run holds.
    """

    def __init__(self, nbytes: int, device: torch.device, capacity: int):
        self.nbytes, self.device, self.capacity = nbytes, device, capacity
        self.cond = threading.Condition()
        self.all = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(capacity)]
        self.free: list[torch.Tensor] = list(self.all)

    def take(self, wait: bool = True) -> torch.Tensor | None:
        with self.cond:
            while not self.free:
                if not wait:
                    return None
                self.cond.wait()
            return self.free.pop()

    def give(self, buf: torch.Tensor) -> None:
        with self.cond:
            self.free.append(buf)
            self.cond.notify()


class OffloadOptimizer(torch.optim.AdamW):
    """AdamW whose `step` streams blocks through the engine; its param groups carry the
    learning rate the scheduler sets. The state lives with the engine, not in `self.state`."""

    def __init__(self, engine: "OffloadEngine", params, **kwargs):
        super().__init__(params, **kwargs)
        self.engine = engine

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        for p in self.engine.resident:
            p.grad = None


class OffloadIO:
    """The classes that move offloaded bytes: the real disk tier and activation store. The planner passes
    stand-ins that move nothing (Note [runtime])."""

    disk_tier = DiskTier
    activation_store = ActivationStore


class OffloadEngine(Engine):
    """The whole model on one device, its blocks streamed (Note [offload engine])."""

    def __init__(self, model: nn.Module, cfg: Config, runtime: Runtime, plan: InitPlan, blocks: list[str],
                 run_dir: Path, loss_fn):
        s, device, io = cfg.strategy, runtime.device, runtime.offload_io or OffloadIO()
        self.cfg, self.device, self.loss_fn = cfg, device, loss_fn
        _return_freed_memory()
        self.prefetch = s.prefetch
        self.clip_norm = cfg.trainer.clip_grad_norm
        self.counters = {kind: Counters() for kind in ("params", "optimizer", "activations")}
        self.waits = Counters()
        self.steps_run = 0
        self.tier_names = {"params": effective(s.params, device), "optimizer": effective(s.optimizer, device),
                           "activations": s.activations if s.activations == "checkpoint"
                           else effective(s.activations, device)}
        self.path = Path(s.path) if s.path else Path(run_dir) / "offload"
        self.io = runtime.executor(2, "offload-io")
        self.stepper = runtime.executor(1, "offload-step")
        self.last_step = None
        self.model = model
        self._realize(model, blocks)
        disk_bytes = self._disk_bytes()
        if disk_bytes and runtime.check_disk:
            why = check_disk(self.path, disk_bytes)
            if why:
                raise RunError(f"strategy.path={str(self.path)!r}: {why}")
        self.tiers = {}
        for kind in ("params", "optimizer"):
            t = self.tier_names[kind]
            self.tiers[kind] = (io.disk_tier(self.path / kind, self.counters[kind], self.io) if t == "disk"
                                else HostTier(device, self.counters[kind]) if t == "cpu" else None)
        act = self.tier_names["activations"]
        self.acts = None
        if act in ("disk", "cpu"):
            self.acts = io.activation_store(self.path if act == "disk" else None, device, self.counters["activations"],
                                        self.io)
        self.stream_params = self.tiers["params"] is not None
        # Leading blocks with no trainable parameter never run backward (their inputs need no gradient either).
        self.n_frozen = 0
        while self.n_frozen < len(self.blocks) and \
                not any(p.requires_grad for p in self.blocks[self.n_frozen].module.parameters()):
            self.n_frozen += 1
        splits = callable(getattr(model, "frozen_forward", None)) and callable(getattr(model, "trainable_forward", None))
        self.n_ahead = self.n_frozen if s.lookahead and splits else 0
        ahead, rest = self.blocks[:self.n_ahead], self.blocks[self.n_ahead:]
        # Bound + prefetched blocks, and one block in its step (weights, gradients, two moments).
        self.pool = BufferPool(max((b.nbytes for b in rest), default=ALIGN), device, 4 * (self.prefetch + 1) + 2)
        # The frozen part only runs forward: the bound block and those read ahead of it.
        self.ahead_pool = BufferPool(max((b.nbytes for b in ahead), default=ALIGN), device, self.prefetch + 2)
        for b in self.blocks:
            b.pool, b.group, b.ahead = (self.ahead_pool, (0, len(ahead)), True) if b.index < len(ahead) else \
                (self.pool, (len(ahead), len(self.blocks)), False)
        self.ahead = runtime.executor(1, "offload-ahead")
        self.next_input: torch.Tensor | None = None  # handed over by the trainer for the next step
        self.pending_features: tuple[torch.Tensor, object] | None = None  # (input, its features' future)
        self.frozen_wait_s, self.frozen_ahead_steps = 0.0, 0
        # AdamW's step counters, made as torch.optim.AdamW makes them (the planner's fake tensors can read
        # a value made this way)
        self.steps = {p: torch.tensor(0.0, dtype=torch.float32) for p in self.params}
        self.state_in_memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block -> (exp_avg, exp_avg_sq)
        self.grads_in_memory: dict[int, torch.Tensor] = {}  # block -> gradients waiting for the step
        self.resident_state: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}
        self.norms: dict[nn.Parameter, torch.Tensor] = {}
        self.coef: torch.Tensor | None = None
        self.optimizer: OffloadOptimizer | None = None
        self.phase = "forward"
        # id of a bound buffer's storage -> its block (pool buffers live for the whole run, so ids stay theirs)
        self.bound: dict[int, Block] = {}
        try:
            self._write_initial(plan)
        except BaseException:
            self.close()  # no files left behind
            raise
        self._hook()

    # ---- building -------------------------------------------------------------------------------

    def _realize(self, model: nn.Module, names: list[str]) -> None:
        """Real parameter objects (empty until bound), blocks and their layouts, resident parameters.

        The new parameters go into the model only after initialization
        (`_install`): the initialization rules read shapes off the meta ones.
        """
        real: dict[int, nn.Parameter] = {}
        self.shapes: dict[nn.Parameter, tuple] = {}
        self._slots_to_fill: list[tuple[nn.Module, str, nn.Parameter]] = []
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None:
                    continue
                q = real.get(id(p))
                if q is None:
                    q = real[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype, device=self.device),
                                                   requires_grad=p.requires_grad)
                    self.shapes[q] = (p.shape, p.dtype)
                self._slots_to_fill.append((module, name, q))
        self.params = [real[id(p)] for p in dict.fromkeys(model.parameters())]  # the single-device order
        fqns = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            fqns.setdefault(real[id(p)], fqn)
        holders: dict[nn.Parameter, set[int]] = {}
        mods = [model.get_submodule(n) for n in names]
        for i, m in enumerate(mods):
            for p in m.parameters():
                holders.setdefault(real[id(p)], set()).add(i)
        self.blocks: list[Block] = []
        for i, (name, m) in enumerate(zip(names, mods)):
            slots, offset = [], 0
            for p in dict.fromkeys(real[id(p)] for p in m.parameters()):
                if len(holders[p]) != 1:
                    continue  # shared between blocks: resident
                shape, dtype = self.shapes[p]
                nbytes = shape.numel() * dtype.itemsize
                slots.append(Slot(p, fqns[p], shape, dtype, offset, nbytes))
                offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
            self.blocks.append(Block(i, name, m, slots, max(offset, ALIGN)))
        in_block = {id(s.param) for b in self.blocks for s in b.slots}
        self.resident = [p for p in self.params if id(p) not in in_block]
        self.fqns = fqns
        self.block_of = {id(s.param): b for b in self.blocks for s in b.slots}

    def _install(self) -> None:
        """Put the real parameters into the model, in place of the meta ones."""
        for module, name, q in self._slots_to_fill:
            module._parameters[name] = q
        self._slots_to_fill = []

    def _disk_bytes(self) -> int:
        """Bytes the disk tier needs (activations not included: they depend on the batch)."""
        total = sum(b.nbytes for b in self.blocks)
        need = 0
        if self.tier_names["params"] == "disk":
            need += total
        if self.tier_names["optimizer"] == "disk":
            need += 3 * total  # two AdamW moments, and the gradients when clipping
        return need

    @torch.no_grad()
    def _write_initial(self, plan: InitPlan) -> None:
        """Initialize every parameter by name (Note [initialization by name]) straight into its home,
        one block at a time, then install the real parameters."""
        seed = self.cfg.trainer.seed

        def value(fqn: str, shape, dtype) -> torch.Tensor:
            module, local, canonical = plan[fqn]
            return full_init_value(module, local, canonical, shape, dtype, seed)

        for p in self.resident:
            shape, dtype = self.shapes[p]
            p.data = value(self.fqns[p], shape, dtype).to(self.device)
        for module in self.model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=self.device)
        for fqn, buf in self.model.named_buffers():
            module, local, canonical = plan[fqn]
            buf.copy_(full_init_value(module, local, canonical, buf.shape, buf.dtype, seed))
        for b in self.blocks:
            flat = b.pool.take()
            for s in b.slots:
                s.view(flat).copy_(value(s.fqn, s.shape, s.dtype))
            if self.stream_params:
                finish(self.tiers["params"].write(self._key(b), flat[:b.nbytes]))
            else:
                b.buffer = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
                b.buffer.copy_(flat[:b.nbytes])
            b.pool.give(flat)
        self._install()
        if not self.stream_params:
            for b in self.blocks:
                self._bind(b)

    @staticmethod
    def _key(b: Block, kind: str = "w") -> str:
        return f"{kind}{b.index}"

    def _hook(self) -> None:
        for b in self.blocks:
            b.module.register_forward_pre_hook(lambda m, a, b=b: self._before_forward(b))
            b.module.register_forward_hook(lambda m, a, o, b=b: self._after_forward(b))
            if any(s.param.requires_grad for s in b.slots) or self.stream_params:
                b.module.register_full_backward_pre_hook(lambda m, g, b=b: self._before_backward(b))
            for s in b.trainable:
                s.param.register_post_accumulate_grad_hook(lambda p, b=b: self._grad_ready(b))
            if self.tier_names["activations"] == "checkpoint" and not b.ahead:  # ahead: no_grad, nothing saved
                forward = b.module.forward
                b.module.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
        for p in self.resident:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._resident_grad_ready)

    # ---- binding ----------------------------------------------------------------------------------

    def _fetch(self, b: Block, wait: bool = True) -> bool:
        """Start reading block `b`'s weights into a pool buffer (no-op if bound or on its way)."""
        if b.buffer is not None or not self.stream_params:
            return True
        buf = b.pool.take(wait=wait)
        if buf is None:
            return False
        b.buffer = buf
        b.pending = self.tiers["params"].read(self._key(b), buf[:b.nbytes])
        return True

    def _ensure(self, b: Block) -> None:
        """Block `b`'s weights bound and readable."""
        if not self.stream_params:
            return
        self._fetch(b)
        if b.pending is not None:
            t0 = time.perf_counter()
            finish(b.pending)
            self.waits.add(wait_s=time.perf_counter() - t0)
            b.pending = None
        self._bind(b)

    def _bind(self, b: Block) -> None:
        for s in b.slots:
            s.param.data = s.view(b.buffer)
        self.bound[id(b.buffer.untyped_storage())] = b

    def _unbind(self, b: Block) -> torch.Tensor:
        buf = b.buffer
        self.bound.pop(id(buf.untyped_storage()), None)
        for s in b.slots:
            s.param.data = torch.empty(0, dtype=s.dtype, device=self.device)
        b.buffer, b.pending = None, None
        return buf

    def _release(self, b: Block) -> None:
        if self.stream_params and b.buffer is not None:
            if b.pending is not None:
                finish(b.pending)
            b.pool.give(self._unbind(b))

    def _prefetch(self, start: int, step: int) -> None:
        lo, hi = self.blocks[start].group
        if step < 0:
            lo = max(lo, self.n_frozen)
        for k in range(1, self.prefetch + 1):
            j = start + k * step
            if lo <= j < hi:
                if self.acts is not None and step < 0:
                    self.acts.prefetch(j)
                if not self._fetch(self.blocks[j], wait=False):
                    return

    # ---- hooks --------------------------------------------------------------------------------------

    def _before_forward(self, b: Block) -> None:
        if b.ahead:
            self._ensure(b)
            self._prefetch(b.index, +1)
            return
        if threading.current_thread().name.startswith("offload-ahead"):
            raise RuntimeError(f"frozen_forward ran block {b.name!r}, which has trainable parameters: a model's "
                               "frozen_forward must run only its leading frozen blocks (Note [frozen lookahead])")
        if self.acts is not None:
            self.acts.block = b.index
        self._ensure(b)
        if self.phase == "forward":
            self._prefetch(b.index, +1)

    def _after_forward(self, b: Block) -> None:
        if self.phase == "forward" or b.ahead:
            self._release(b)

    def _before_backward(self, b: Block) -> None:
        self.phase = "backward"
        self._ensure(b)
        if self.acts is not None:
            self.acts.prefetch(b.index)
        self._prefetch(b.index, -1)

    def _grad_ready(self, b: Block) -> None:
        b.grads_ready += 1
        if b.grads_ready == len(b.trainable):
            self._grads_done(b)

    def _resident_grad_ready(self, p: nn.Parameter) -> None:
        self.norms[p] = _norm(p.grad)

    def _grads_done(self, b: Block) -> None:
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
            self._release(b)
            tier = self.tiers["optimizer"]
            if tier is None:
                self.grads_in_memory[b.index] = grads  # kept until the step
            else:
                w = b.grads_write = tier.write(self._key(b, "g"), grads[:b.nbytes])
                if hasattr(w, "add_done_callback"):  # a disk write: the buffer returns when it is done
                    w.add_done_callback(lambda _, buf=grads: self.pool.give(buf))
                else:
                    finish(w)
                    self.pool.give(grads)
            b.grad_slots = slots
            return
        # No clipping: step now, on the host thread, while backward goes on.
        params = b.buffer if self.stream_params else None
        if params is not None:
            if b.pending is not None:
                finish(b.pending)
            self._unbind(b)
        if self.last_step is not None:
            finish(self.last_step)  # one step in flight at a time bounds the buffers it holds
        lr = self.optimizer.param_groups[0]["lr"]
        self.last_step = self.stepper.submit(self._step_block, b, slots, params, grads, None, lr)

    # ---- the step -----------------------------------------------------------------------------------

    def _states(self, b: Block) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """AdamW's two moments for `b`: (exp_avg, exp_avg_sq, from the pool)."""
        if self.tiers["optimizer"] is None:
            if b.index not in self.state_in_memory:
                self.state_in_memory[b.index] = (torch.zeros(b.nbytes, dtype=torch.uint8, device=self.device),
                                                 torch.zeros(b.nbytes, dtype=torch.uint8, device=self.device))
            m, v = self.state_in_memory[b.index]
            return m, v, False
        m, v = self.pool.take(), self.pool.take()
        if b.state_ready:
            finish(self.tiers["optimizer"].read(self._key(b, "m"), m[:b.nbytes]))
            finish(self.tiers["optimizer"].read(self._key(b, "v"), v[:b.nbytes]))
        else:
            m.zero_()
            v.zero_()
        return m, v, True

    @torch.no_grad()
    def _step_block(self, b: Block, slots: list[Slot], params: torch.Tensor | None, grads: torch.Tensor,
                    coef: torch.Tensor | None, lr: float) -> None:
        """AdamW on block `b` (weights in `params`, or read here), then everything written back."""
        tier_w, tier_o = self.tiers["params"], self.tiers["optimizer"]
        if params is None and self.stream_params:
            params = self.pool.take()
            finish(tier_w.read(self._key(b), params[:b.nbytes]))
        elif params is None:
            params = b.buffer
        m, v, pooled = self._states(b)
        ps = [s.view(params) for s in slots]
        gs = [s.view(grads) for s in slots]
        if coef is not None:
            for g in gs:
                g.mul_(coef)
        o = self.cfg.optim
        adamw(ps, gs, [s.view(m) for s in slots], [s.view(v) for s in slots], [],
              [self.steps[s.param] for s in slots], foreach=False, amsgrad=False, beta1=o.betas[0],
              beta2=o.betas[1], lr=lr, weight_decay=o.weight_decay, eps=o.eps, maximize=False)
        writes = []
        if self.stream_params:
            writes.append(tier_w.write(self._key(b), params[:b.nbytes]))
        if pooled:
            writes += [tier_o.write(self._key(b, "m"), m[:b.nbytes]), tier_o.write(self._key(b, "v"), v[:b.nbytes])]
            b.state_ready = True
        for w in writes:
            finish(w)
        if self.stream_params:
            self.pool.give(params)
        if pooled:
            self.pool.give(m)
            self.pool.give(v)
        self.pool.give(grads)

    @torch.no_grad()
    def step(self) -> None:
        """The optimizer step of what backward left: every block when clipping, and the resident weights."""
        lr = self.optimizer.param_groups[0]["lr"]
        if self.last_step is not None:
            finish(self.last_step)
            self.last_step = None
        if self.clip_norm > 0:
            for b in self.blocks:
                slots = b.grad_slots
                if not slots:
                    continue
                tier = self.tiers["optimizer"]
                if tier is None:
                    grads = self.grads_in_memory.pop(b.index)
                else:
                    finish(b.grads_write)  # a file being written reads short
                    grads = self.pool.take()
                    finish(tier.read(self._key(b, "g"), grads[:b.nbytes]))
                self._step_block(b, slots, None, grads, self.coef, lr)
                b.grad_slots = []
        live = [p for p in self.resident if p.grad is not None]
        if live:
            if self.coef is not None:
                for p in live:
                    p.grad.mul_(self.coef)
            states = [self.resident_state.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p))) for p in live]
            o = self.cfg.optim
            adamw(live, [p.grad for p in live], [s[0] for s in states], [s[1] for s in states], [],
                  [self.steps[p] for p in live], foreach=False, amsgrad=False, beta1=o.betas[0], beta2=o.betas[1],
                  lr=lr, weight_decay=o.weight_decay, eps=o.eps, maximize=False)

    # ---- the engine interface -------------------------------------------------------------------------

    def make_optimizer(self) -> OffloadOptimizer:
        o = self.cfg.optim
        self.optimizer = OffloadOptimizer(self, self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                          weight_decay=o.weight_decay)
        return self.optimizer

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.steps_run += 1
        for b in self.blocks:
            b.grads_ready, b.done = 0, False
        self.norms, self.coef, self.phase = {}, None, "forward"
        if self.acts is not None:
            self.acts.reset()
        features = self._frozen_features(x) if self.n_ahead else None
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            with autocast(self.cfg, self.device):
                out = self.model(x) if features is None else self.model.trainable_forward(features)
                loss = self.loss_fn(out.float(), y)
            loss.backward()
        # Blocks whose parameters got no gradient this step (unused) still hand off what they have.
        for b in self.blocks:
            if b.trainable and not b.done and b.grads_ready:
                self._grads_done(b)
            if b.buffer is not None and self.stream_params:
                self._release(b)
        return loss.detach()

    # ---- the frozen part, one batch ahead (Note [frozen lookahead]) ----------------------------------------

    @property
    def wants_next_input(self) -> bool:
        """Whether the trainer should hand over the next step's input (`look_ahead`)."""
        return self.n_ahead > 0

    def look_ahead(self, x_next: torch.Tensor) -> None:
        """The input of the next step: its frozen features are computed while this step trains."""
        self.next_input = x_next

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), autocast(self.cfg, self.device):
            return self.model.frozen_forward(x)

    def _frozen_features(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen part's output for `x`: computed ahead during the last step, or now. Before waiting
        for it, the next input's features are queued behind it, to run while this step trains."""
        pending, self.pending_features = self.pending_features, None
        if pending is not None and pending[0] is x:
            future = pending[1]
            self.frozen_ahead_steps += 1
        else:
            if pending is not None:
                finish(pending[1])  # another input than announced: let it end, drop it
            future = self.ahead.submit(self._features, x)
        if self.next_input is not None:
            self.pending_features = (self.next_input, self.ahead.submit(self._features, self.next_input))
            self.next_input = None
        t0 = time.perf_counter()
        features = future.result()
        self.frozen_wait_s += time.perf_counter() - t0
        return features

    def _drain_ahead(self) -> None:
        if self.pending_features is not None:
            finish(self.pending_features[1])

    def _pack(self, t: torch.Tensor):
        if self.stream_params:
            b = self._bound_owner(t)
            if b is not None:
                return ("view", b, t.dtype, t.shape, t.stride(), t.storage_offset())
        if self.acts is not None:
            return self.acts.pack(t)
        return t

    def _unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 6 and packed[0] == "view":
            _, b, dtype, shape, stride, offset = packed
            self._ensure(b)
            return b.buffer.view(dtype).as_strided(shape, stride, offset)
        if self.acts is not None:
            return self.acts.unpack(packed)
        return packed

    def _bound_owner(self, t: torch.Tensor) -> Block | None:
        if t.device != self.device:
            return None
        return self.bound.get(id(t.untyped_storage()))

    def clip(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (every parameter's, in model order); sets the clip factor the step applies."""
        norms = [self.norms[p] for p in self.params if p in self.norms]
        # As parallel.optim.clip_grads computes it, to the last bit: the norm of the per-tensor norms, squared
        # and rooted again.
        total = (torch.linalg.vector_norm(torch.stack(norms)).float() ** 2).sqrt() if norms else torch.zeros(())
        if max_norm > 0:
            self.coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    def metrics(self) -> dict:
        """Per step since the last log: bytes moved to and from each kind's tier, seconds waited on transfers."""
        n = max(1, self.steps_run)
        out, wait = {}, self.waits.take()[2]
        for kind, c in self.counters.items():
            read, written, waited = c.take()
            out[f"offload_{kind}_bytes"] = (read + written) / n
            wait += waited
        out["offload_wait_s"] = wait / n
        if self.n_ahead:
            # Seconds the head waited for the frozen features, and the share of steps whose features were ready ahead.
            out["offload_frozen_wait_s"] = self.frozen_wait_s / n
            out["offload_frozen_ahead"] = self.frozen_ahead_steps / n
            self.frozen_wait_s, self.frozen_ahead_steps = 0.0, 0
        self.steps_run = 0
        return out

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Device tensors the engine holds besides the model's: pool buffers and resident optimizer state."""
        out = list(self.pool.all) + list(self.ahead_pool.all) + list(self.grads_in_memory.values())
        if self.pending_features is not None and self.pending_features[1].done():
            out.append(self.pending_features[1].result())  # made on the other thread, unseen by the watch
        for pair in self.state_in_memory.values():
            out += list(pair)
        for pair in self.resident_state.values():
            out += list(pair)
        return out

    def kept_tensors(self) -> list[torch.Tensor]:
        """All of what `optimizer_tensors` holds is kept between steps."""
        return self.optimizer_tensors()

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """Every parameter and buffer under its original name (CPU tensors)."""
        if self.last_step is not None:
            finish(self.last_step)
        self._drain_ahead()
        state = {}
        for b in self.blocks:
            was_bound = b.buffer is not None
            self._ensure(b)
            for s in b.slots:
                state[s.fqn] = s.view(b.buffer).detach().cpu().clone()
            if not was_bound:
                self._release(b)
        for fqn, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in self.block_of:
                state[fqn] = p.detach().cpu().clone()
        for fqn, buf in self.model.named_buffers():
            state[fqn] = buf.detach().cpu().clone()
        return state

    @torch.no_grad()
    def checkpoint_state(self, optimizer, canonical: dict[str, str]):
        """(weights and buffers, AdamW state, no copies) under the original names, as CPU copies read from the
        tiers (the state the first step has not made yet is zeros, as AdamW starts it); the engine keeps its
        own optimizer state, and a tied weight stays resident under its first name."""
        model = self.full_state_dict()  # also waits for the step in flight
        optim = {}

        def put(p: nn.Parameter, m: torch.Tensor, v: torch.Tensor) -> None:
            optim[self.fqns[p]] = {"step": self.steps[p].clone(), "exp_avg": m.detach().cpu().clone(),
                                   "exp_avg_sq": v.detach().cpu().clone()}

        for b in self.blocks:
            if b.trainable:
                m, v, pooled = self._states(b)
                for s in b.trainable:
                    put(s.param, s.view(m), s.view(v))
                if pooled:
                    self.pool.give(m)
                    self.pool.give(v)
        for p in self.resident:
            if p.requires_grad:
                put(p, *self.resident_state.get(p, (torch.zeros_like(p), torch.zeros_like(p))))
        return model, optim, []

    @torch.no_grad()
    def load_checkpoint_state(self, model: dict, optim: dict) -> None:
        """Write loaded weights, buffers and AdamW state (as `checkpoint_state` gives them) to their tiers."""
        if self.last_step is not None:
            finish(self.last_step)
            self.last_step = None
        tier_w, tier_o = self.tiers["params"], self.tiers["optimizer"]
        for b in self.blocks:
            flat = b.pool.take() if self.stream_params else b.buffer
            for s in b.slots:
                s.view(flat).copy_(model[s.fqn])
            if self.stream_params:
                finish(tier_w.write(self._key(b), flat[:b.nbytes]))
                b.pool.give(flat)
            if b.trainable:
                m, v, pooled = self._states(b)
                for s in b.trainable:
                    s.view(m).copy_(optim[s.fqn]["exp_avg"])
                    s.view(v).copy_(optim[s.fqn]["exp_avg_sq"])
                    self.steps[s.param].copy_(optim[s.fqn]["step"])
                if pooled:
                    finish(tier_o.write(self._key(b, "m"), m[:b.nbytes]))
                    finish(tier_o.write(self._key(b, "v"), v[:b.nbytes]))
                    b.state_ready = True
                    self.pool.give(m)
                    self.pool.give(v)
        for fqn, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in self.block_of:
                p.copy_(model[fqn])
        for p in self.resident:
            if p.requires_grad:
                s = optim[self.fqns[p]]
                self.resident_state[p] = (s["exp_avg"].to(self.device).clone(),
                                          s["exp_avg_sq"].to(self.device).clone())
                self.steps[p].copy_(s["step"])
        for fqn, buf in self.model.named_buffers():
            buf.copy_(model[fqn])

    def close(self) -> None:
        """Wait for transfers, then remove every offload file."""
        for ex in (self.ahead, self.stepper, self.io):
            ex.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers.values():
            if tier is not None:
                tier.close()
        if self.acts is not None:
            self.acts.close()
        if self.path.exists() and not any(self.path.iterdir()):
            self.path.rmdir()


def build_offload(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime, plan: InitPlan) -> Engine:
    """strategy=offload: this process's engine, the model streamed block by block (Note [offload engine])."""
    names, _ = candidates(model, example_input(cfg.data))
    engine = OffloadEngine(model, cfg, runtime, plan, names, cfg.run_dir, loss_fn(cfg.data.task))
    t = engine.tier_names
    if not engine.blocks:
        log.warning("offload: no blocks found (the model's children called by its forward, or a ModuleList's "
                    "children): every weight stays on the device")
    if engine.n_ahead:
        log.info("offload: the first %d blocks are frozen and run one batch ahead of the rest", engine.n_ahead)
    log.info("offload: %d blocks (largest %.1f MB), params on %s, optimizer state on %s, activations on %s%s",
             len(engine.blocks), engine.pool.nbytes / 1e6, t["params"], t["optimizer"], t["activations"],
             f" ({engine.path})" if "disk" in t.values() else "")
    return engine
