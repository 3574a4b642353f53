"""strategy=offload: one device; weights, gradients, optimizer state and activations streamed from the tiers below.

# Note [offload engine]
The model is cut into blocks (the same candidates the pipeline split uses: the
top-level children in forward order, ModuleList children one level down).
Each block's parameters are packed into one flat byte buffer whose home is the
params tier; every parameter object stays the same for the whole run, and its
`.data` points either into a bound buffer or at an empty placeholder.

  forward   a block's forward pre-hook binds its buffer (waiting for the read
            if needed) and starts reading the next `prefetch` blocks; its
            forward hook unbinds it, except for the last `prefetch + 1` blocks
            of a training forward: backward starts with them.
  backward  a block's backward pre-hook binds it again and starts reading the
            `prefetch` blocks before it (and their saved activations), and,
            without clipping, the optimizer state of this block and the one
            before it (while the pool keeps a whole step's buffers free). When
            every trainable parameter of the block has its gradient
            (post-accumulate-grad hooks), the gradients leave the device:
            - without clipping (trainer.clip_grad_norm=0) the block's
              optimizer step runs right then on a host thread, overlapping the rest of
              backward, and writes the new weights and state back; under a GPU it
              is queued on a stream of its own (moments read in, the update after
              its gradients, the writes) and a finisher thread waits for the writes
              before its buffers go back to the pool (`StepStream` in adamw.py), so
              one block's results go out while the next block's moments come in;
              the block stepped first in the next forward keeps its new weights
              bound (written to its tier all the same), so that forward starts
              without reading it;
              each block's gradients are checked first: a non-finite one
              steps neither it nor any later block (Note [non-finite steps]
              in parallel/nonfinite.py);
            - with clipping, the step needs the global norm first: gradients
              go to the optimizer tier, and `OffloadOptimizer.step` streams
              every block (weights, gradients, state) through the step after
              backward; so it does under trainer.nonfinite=skip, so that a
              dropped step leaves every block as it was.
  buffers   come from a pool of `4 x (prefetch + 1) + 2` buffers of the
            largest block's size, so device memory is bounded by block sizes
            and the prefetch depth, not by the model.

Saved tensors that are views of a bound buffer are rebuilt from the block's
buffer at unpack; other saved tensors go to the activations tier or stay
(parallel.strategies.offload.saved). Parameters held by several blocks (tied weights) and
those outside every block stay resident. The step is AdamW's or SGD's own
functional form, per parameter group, so every number matches `strategy=single`.

Each part is a small object the engine owns; a module imports only those
listed above it (and tiers.py, activations.py below them all):

    pool.py       BufferPool: the device buffers, all allocated at the start
    layout.py     Slot, Block, Layout: real parameters, blocks, their flat buffers' slots
    stream.py     WeightStream: a block's weights read from the params tier, bound, let go
    adamw.py      BlockAdamW, OffloadOptimizer, StepStream: the gradients' hand-off, the per-block step
                  (AdamW or SGD) and where it runs, the norm
    lookahead.py  FrozenLookahead: a frozen leading part one batch ahead (Note [frozen lookahead])
    saved.py      SavedTensors: the saved-tensors hooks
    hooks.py      BlockHooks: forward, backward and gradient hooks
    state.py      OffloadState: initial values, the full state dict, checkpoints in and out
    engine.py     OffloadEngine, which makes and composes them; build_offload; OffloadIO
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.aux_weight import AuxWeights
from parallel.blocks import candidates
from parallel.config import Config, OptimConfig, RunError, bf16_run
from parallel.data import example_input
from parallel.engine import Engine, LooksAhead, OwnOptimizer, autocast, evaluating
from parallel.init import InitPlan
from parallel.loss import Loss, build_loss
from parallel.memory.host import set_mmap_threshold, trim_host_heap
from parallel.metrics import log
from parallel.runtime import Runtime
from parallel.strategies.offload.activations import ActivationStore
from parallel.strategies.offload.adamw import BlockAdamW, OffloadOptimizer, state_keys
from parallel.strategies.offload.hooks import BlockHooks
from parallel.strategies.offload.layout import Layout
from parallel.strategies.offload.lookahead import THREAD, FrozenLookahead, frozen_prefix, splits_forward
from parallel.strategies.offload.pool import BufferPool
from parallel.strategies.offload.saved import SavedTensors
from parallel.strategies.offload.state import OffloadState
from parallel.strategies.offload.stream import WeightStream
from parallel.strategies.offload.tiers import ALIGN, Counters, DiskTier, HostTier, check_disk, effective
from parallel.tensors import as_call, call_model


def _return_freed_memory() -> None:
    """Have glibc give large freed blocks back to the system at once (Linux only), and what it already holds free.

    glibc raises its mmap threshold after the first large free, and every worker fixes it high, one that
    computes on the CPU taking every block from the heap (Note [host allocations] in parallel/memory/host.py),
    so tensors of that size come from the heap, where freed space stays in the process: the activations that
    went to disk would still count against the process's memory. A fixed 1 MiB threshold, blocks above it
    mappings of their own again, keeps large tensors in their own mappings, returned when freed. What the
    worker freed before this point stays in its heap whatever the thresholds now (under model.init=module, the
    whole model built to write the initial weights): the heap is trimmed (Note [host allocations]).
    """
    set_mmap_threshold(1 << 20, 128 << 10)  # the trim threshold back at glibc's default too
    trim_host_heap()  # Note [host allocations]: what was freed before, the whole model under model.init=module


class OffloadIO:
    """The classes that move offloaded bytes: the real disk and host tiers and activation store. The planner
    passes stand-ins that move nothing (Note [runtime])."""

    disk_tier = DiskTier
    host_tier = HostTier
    activation_store = ActivationStore


@dataclass(frozen=True)
class OffloadSettings:
    """What the offload engine reads of the run's config, taken from it once by `build_offload` (`of`)."""

    params: str  # strategy.params: where the blocks' weights live between uses (device, cpu, disk)
    optimizer: str  # strategy.optimizer: where their optimizer state and waiting gradients live
    activations: str  # strategy.activations: where the saved activations live, or checkpoint (recomputed)
    path: str | None  # strategy.path: the disk tier's home (None: the run directory's offload/)
    prefetch: int  # strategy.prefetch: the blocks read ahead of the one running
    lookahead: bool  # strategy.lookahead: a frozen leading part runs one batch ahead (Note [frozen lookahead])
    optim: OptimConfig  # the optimizer the engine steps block by block
    # Whether blocks step after backward (the global norm first) rather than during it: with clipping, and
    # under trainer.nonfinite=skip, so that a dropped step leaves every block as it was (Note [non-finite
    # steps] in parallel/nonfinite.py).
    deferred: bool
    bf16: bool  # bf16 autocast (parallel.engine.autocast)

    @classmethod
    def of(cls, cfg: Config) -> "OffloadSettings":
        s, t = cfg.strategy, cfg.trainer
        return cls(s.params, s.optimizer, s.activations, s.path, s.prefetch, s.lookahead, cfg.optim,
                   t.clip_grad_norm > 0 or t.nonfinite == "skip", bf16_run(cfg))


class OffloadEngine(Engine, OwnOptimizer, LooksAhead):
    """The whole model on one device, its blocks streamed (Note [offload engine]).

    Args:
        model: the model on the meta device (its parameters are replaced by the engine's).
        settings: what it reads of the run's config (`OffloadSettings.of`).
        runtime: the device, the executors and the offload I/O (Note [runtime]).
        plan: the initialization plan (Note [initialization by name]).
        blocks: the blocks' module names, in forward order.
        run_dir: the run directory (the disk tier's default home).
        loss: the run's loss (Note [global loss] in parallel/loss.py).
    """

    def __init__(self, model: nn.Module, settings: OffloadSettings, runtime: Runtime, plan: InitPlan,
                 blocks: list[str], run_dir: Path, loss: Loss):
        s, device = settings, runtime.device
        self.settings, self.device, self.loss, self.model = settings, device, loss, model
        self.aux = AuxWeights([model])  # Note [auxiliary weight] in parallel/aux_weight.py
        _return_freed_memory()
        self.counters = {kind: Counters() for kind in ("params", "optimizer", "activations")}
        self.waits = Counters()
        self.steps_run = 0
        target = runtime.target or device  # the tiers below a GPU when planning its run on the CPU
        self.tier_names = {"params": effective(s.params, target), "optimizer": effective(s.optimizer, target),
                           "activations": s.activations if s.activations == "checkpoint"
                           else effective(s.activations, target)}
        self.path = Path(s.path) if s.path else Path(run_dir) / "offload"
        self.io = runtime.executor(2, "offload-io")
        self.layout = Layout(model, blocks, device)
        self.blocks = self.layout.blocks
        disk_bytes = self._disk_bytes()
        if disk_bytes and runtime.check_disk:
            why = check_disk(self.path, disk_bytes)
            if why:
                raise RunError(f"strategy.path={str(self.path)!r}: {why}")
        self._make_tiers(runtime.offload_io or OffloadIO())
        n_frozen = frozen_prefix(self.blocks)
        self.n_ahead = n_frozen if s.lookahead and splits_forward(model) else 0
        self._make_pools(s.prefetch)
        self.stream = WeightStream(self.tiers["params"], device, self.waits)
        self.adamw = BlockAdamW(s.optim, s.deferred, self.layout, self.stream, self.tiers["optimizer"], self.pool,
                                runtime.executor(1, "offload-step"), runtime.executor(1, "offload-step-done"), device)
        self.lookahead = FrozenLookahead(model, s.bf16, device, runtime.executor(1, THREAD))
        self.hooks = BlockHooks(self.layout, self.stream, self.adamw, self.acts, s.prefetch, n_frozen,
                                recompute=self.tier_names["activations"] == "checkpoint")
        self.saved = SavedTensors(self.stream, self.acts, device)
        self.state = OffloadState(model, self.layout, self.stream, self.adamw, device)
        try:
            self.state.write_initial(plan, runtime.values)
        except BaseException:
            self.close()  # no files left behind
            raise
        self.hooks.install()

    # ---- building -------------------------------------------------------------------------------

    def _disk_bytes(self) -> int:
        """Bytes the disk tier needs (activations not included: they depend on the batch)."""
        total = sum(b.nbytes for b in self.blocks)
        need = 0
        if self.tier_names["params"] == "disk":
            need += total
        if self.tier_names["optimizer"] == "disk":
            need += (len(state_keys(self.settings.optim)) + 1) * total  # the state (AdamW: two moments), gradients
        return need

    def _make_tiers(self, io: OffloadIO) -> None:
        """The params and optimizer tiers (None: on the device) and the activation store (None: none)."""
        self.tiers = {}
        for kind in ("params", "optimizer"):
            t = self.tier_names[kind]
            self.tiers[kind] = (io.disk_tier(self.path / kind, self.counters[kind], self.io) if t == "disk"
                                else io.host_tier(self.device, self.counters[kind]) if t == "cpu" else None)
        act = self.tier_names["activations"]
        self.acts = None
        if act in ("disk", "cpu"):
            self.acts = io.activation_store(self.path if act == "disk" else None, self.device,
                                            self.counters["activations"], self.io)

    def _make_pools(self, prefetch: int) -> None:
        """One pool for the blocks run one batch ahead, one for the rest (Note [frozen lookahead])."""
        ahead, rest = self.blocks[:self.n_ahead], self.blocks[self.n_ahead:]
        # Bound + prefetched blocks, and one block in its step (weights, gradients, two moments).
        self.pool = BufferPool(max((b.nbytes for b in rest), default=ALIGN), self.device, 4 * (prefetch + 1) + 2)
        # The frozen part only runs forward: the bound block and those read ahead of it.
        self.ahead_pool = BufferPool(max((b.nbytes for b in ahead), default=ALIGN), self.device, prefetch + 2)
        for b in self.blocks:
            b.pool, b.group, b.ahead = (self.ahead_pool, (0, len(ahead)), True) if b.index < len(ahead) else \
                (self.pool, (len(ahead), len(self.blocks)), False)

    # ---- the engine interface -------------------------------------------------------------------------

    def make_optimizer(self, names: dict[int, str]) -> OffloadOptimizer:
        return self.adamw.make_optimizer(names)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.steps_run += 1
        self.hooks.start_step()
        self.adamw.start_step()
        if self.acts is not None:
            self.acts.reset()
        features = self.lookahead.features(x) if self.n_ahead else None
        self.loss.start_step(y, None, 1)  # one process: the whole global batch, no accumulation
        self.aux.set(self.loss.aux_weight)
        with torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack):
            with autocast(self.settings.bf16, self.device):
                out = call_model(self.model, x) if features is None else self.model.trainable_forward(features)
                loss = self.loss(out, y)
            loss.backward()
        self.hooks.end_step()
        return loss.detach()

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only: each block's weights streamed in and let go as in a training forward, nothing saved.
        The step in flight (writing new weights) and the frozen part's work ahead (on the same buffers) end
        first; the features made ahead stay for the next step."""
        self.adamw.wait()
        self.lookahead.drain()
        self.hooks.phase = "forward"  # prefetch forward, release after each block
        with evaluating([self.model]), autocast(self.settings.bf16, self.device):
            return self.loss.score(call_model(self.model, x), y)

    @property
    def looking_ahead(self) -> bool:
        """Whether the trainer should hand over the next step's input (`look_ahead`)."""
        return self.n_ahead > 0

    def look_ahead(self, x_next: torch.Tensor) -> None:
        """The input of the next step: its frozen features are computed while this step trains."""
        self.lookahead.look_ahead(x_next)

    def clip(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (every parameter's, in model order); sets the clip factor the step applies."""
        return self.adamw.clip(max_norm)

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
            out |= self.lookahead.metrics(n)
        self.steps_run = 0
        return out

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Device tensors the engine holds besides the model's: pool buffers, gradients waiting for the step,
        optimizer state kept on the device, and features made ahead."""
        return list(self.pool.all) + list(self.ahead_pool.all) + self.adamw.tensors() + self.lookahead.tensors()

    def kept_tensors(self) -> list[torch.Tensor]:
        """All of what `optimizer_tensors` holds is kept between steps."""
        return self.optimizer_tensors()

    def full_state_dict(self) -> dict:
        """Every parameter and buffer under its original name (CPU tensors)."""
        self.adamw.wait()
        self.lookahead.drain()
        return self.state.full_state_dict()

    def checkpoint_state(self, optimizer, canonical: dict[str, str]):
        """(weights and buffers, optimizer state, no copies) under the original names, as CPU copies read from
        the tiers (the state the first step has not made yet is zeros); the engine keeps its
        own optimizer state, and a tied weight stays resident under its first name."""
        model = self.full_state_dict()  # also waits for the step in flight
        return model, self.state.optimizer_state(), []

    def load_checkpoint_state(self, model: dict, optim: dict) -> None:
        """Write loaded weights, buffers and optimizer state (as `checkpoint_state` gives them) to their tiers."""
        self.adamw.wait()
        for b in self.blocks:  # a bound block's weights would be the old ones
            self.stream.release(b)
        self.state.load(model, optim)

    def close(self) -> None:
        """Wait for transfers, then remove every offload file."""
        for ex in (self.lookahead.executor, self.adamw.stepper, self.adamw.finisher, self.io):
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
    names, _ = candidates(model, *as_call(example_input(cfg.data, spec=runtime.data)))
    if runtime.run_dir is None and cfg.strategy.path is None:
        raise ValueError("strategy=offload keeps its disk tier in the run directory (Runtime.run_dir) or in "
                         "strategy.path; this build has neither")
    engine = OffloadEngine(model, OffloadSettings.of(cfg), runtime, plan, names, runtime.run_dir,
                           build_loss(cfg.loss, cfg.data.task))
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
