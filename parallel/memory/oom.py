"""A CUDA out-of-memory in a run, said in one line instead of a traceback.

# Note [out of memory]
A rank that runs out of GPU memory ends the run with one line, and each rank
that ran out says its own (exit status 1, no traceback):

    error: out of GPU memory on rank R at step S in PHASE (MODULE): X allocated of Y (memory.fraction F);
    PLAN; try CHANGE, then CHANGE, ... [; memory snapshot: PATH]

Where: read from the exception, once, when it is reported; nothing is tracked
while the run goes well. Forward pre-hooks on every module would cost every
call of every module (and a hook more in each compiled block) for a report
most runs never make. The trainer names its phases with
`parallel.profiling.run_phase`, which marks an exception raised inside one
with the phase and its step as it passes (`raised_in`): the step, and the
phase it failed in (data, forward or backward, gradient clipping, optimizer
step, evaluation, checkpoint save or load, saving the final weights), come from
there, the innermost phase first; the traceback holds each Python frame from
the trainer's loop down to the failed allocation for the rest. Forward and backward are
told apart by autograd's engine frame (`_engine_run_backward`: Tensor.backward,
autograd.backward and autograd.grad all go through it, a pipeline stage's
backward included); the module is the innermost `nn.Module.__call__` frame's,
named as in the model. An error PyTorch wraps in its own (a pipeline stage's,
a checkpoint writer's) is followed down to the out-of-memory, frames and all.
Backward runs the modules' gradients in C++: an OOM there names a module only
when one's Python code is on the stack (a block recomputed in backward, a
hook), else the line has no module.

Figures: on CUDA torch.cuda.memory_allocated (the tensors the failed step still
holds: the traceback keeps them alive until the line is written) and the
device's memory times memory.fraction. A run not on CUDA (a test raising the
error on the CPU) has no such figures: "unknown".

PLAN: the plan's prediction when one was made for this run. strategy=auto plans
every candidate before the workers start and leaves auto.json in the run
directory: the chosen candidate's peak (its largest rank's). Any other run was
not planned; the line says so and names the command that plans it. It never
makes a number up.

The changes: those that lower the peak and that the run has not applied yet,
cheapest first: those that keep the training's numbers and cost compute
(activations recomputed per block, then the global batch in twice the
micro-steps), then those that cost communication or transfers (ZeRO 3 over
the data-parallel ranks; offload on one process), then a smaller batch, which
changes the training. For an OOM in the optimizer step or a checkpoint, where
the activations are gone, sharding and offload come first. Planning each change (as strategy=auto does)
would take longer than many steps, on every failing rank, after the failure:
the line lists them, and `launch/plan.py` says which fits.

With trainer.memory_snapshot=true the snapshot of the failed step (Note
[profiles] in parallel/profiling.py), or one written at once for an OOM outside
a step.

A worker started by a launcher (ours, torchrun, a SLURM job) prints its line
and exits with OUT_OF_MEMORY (3); the launcher of `nproc=N` workers, seeing
it, adds nothing of its own and exits 1 (parallel.launcher; torchrun exits 1
after its summary, which has no traceback: none was recorded). A
single-process run prints the line through the entry wrapper
(parallel/entry.py: a RunError) and exits 1.
"""
from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from parallel.config import Config, RunError, strategy_spec
from parallel.profiling import raised_in, snapshot_after_oom
from parallel.units import human_bytes

# A worker's exit status when it ran out of GPU memory and said so (its line is on stderr).
OUT_OF_MEMORY = 3


class OutOfMemory(RunError):
    """A rank ran out of GPU memory; the message is its one line (Note [out of memory])."""


@dataclass
class Where:
    """Where in the run an exception was raised (Note [out of memory])."""

    step: int | None
    phase: str
    module: str | None


# Every `module(...)` runs through these two (nn.Module.__call__ is _wrapped_call_impl; a compiled module's
# call skips _call_impl): their frames' `self` is the module called. Read, never replaced.
_MODULE_CALLS = (nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__)
# The run's phases (parallel.profiling.run_phase) -> the line's words; forward_backward is forward or backward.
_PHASES = {"data": "data", "clip": "gradient clipping", "optimizer_step": "optimizer step",
           "evaluation": "evaluation", "checkpoint_save": "checkpoint save", "checkpoint_load": "checkpoint load",
           "save_final": "saving the final weights"}


def oom_chain(e: BaseException) -> list[BaseException] | None:
    """`e` and the exceptions it wraps, down to a CUDA out-of-memory; None when it wraps none. PyTorch wraps
    some errors in its own: a pipeline stage's forward in a RuntimeError, a checkpoint write in a
    CheckpointException."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        if isinstance(e, torch.cuda.OutOfMemoryError):
            return chain
        e = e.__cause__ or e.__context__
    return None


def where(chain: list[BaseException], model: nn.Module | None = None) -> Where:
    """The step, phase and module of an error, read from the tracebacks of `chain` (an error and those it
    wraps, outermost first: `oom_chain`): Note [out of memory].

    Args:
        model: the model whose module names the line uses (the engine's); None: class names only.
    """
    frames = [frame for e in chain for frame, _ in traceback.walk_tb(e.__traceback__)]
    phases, step = raised_in(chain)
    named = next((_PHASES.get(p) for p in phases if p in _PHASES or p == "forward_backward"), None)
    backward = any(f.f_code.co_name == "_engine_run_backward" for f in frames)
    phase = named or ("backward" if backward else "forward")
    modules = [f.f_locals.get("self") for f in frames if f.f_code in _MODULE_CALLS]
    return Where(step, phase, _module_name([m for m in modules if isinstance(m, nn.Module)], model))


def _module_name(called: list[nn.Module], model: nn.Module | None) -> str | None:
    """The innermost module called, by its name in `model` and its class (the root: its class alone)."""
    if not called:
        return None
    root = getattr(model, "module", model)  # DDP holds the model as .module; its names are the model's
    names = {id(m): name for name, m in root.named_modules()} if isinstance(root, nn.Module) else {}
    for module in reversed(called):
        name = names.get(id(module))
        if name:
            return f"{name}: {type(module).__name__}"
        if name == "":
            return type(module).__name__
    return type(called[-1]).__name__


def figures(device: torch.device, fraction: float | None) -> str:
    """'X allocated of Y (memory.fraction F)': this rank's allocated bytes and its limit."""
    cap = "memory.fraction unset" if fraction is None else f"memory.fraction {fraction:g}"
    if device.type != "cuda":
        return f"allocated and limit unknown on the {device.type} ({cap})"
    total = torch.cuda.get_device_properties(device).total_memory
    limit = total * fraction if fraction is not None else total
    return f"{human_bytes(torch.cuda.memory_allocated(device))} allocated of {human_bytes(limit)} ({cap})"


def planned_peak(cfg: Config, run_dir: Path) -> int | None:
    """The peak strategy=auto's plan predicted for this run (its chosen candidate's largest rank), from the run
    directory's auto.json; None when no plan was made for the strategy the run has."""
    try:
        record = json.loads((run_dir / "auto.json").read_text())
        chosen = record["chosen"]
        peak = next(c["peak"] for c in record["candidates"] if c["overrides"] == chosen and c["dropped"] is None)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    for override in chosen:  # the run resumed in this directory may have been started with another strategy
        key, _, value = override.partition("=")
        have = cfg.strategy.name if key == "strategy" else getattr(cfg.strategy, key.split(".", 1)[-1], None)
        if str(have) != value:
            return None
    return peak


def changes(cfg: Config, world: int, phase: str) -> list[str]:
    """The config changes that lower a rank's peak and that the run has not applied, cheapest first (Note [out
    of memory])."""
    s, t = cfg.strategy, cfg.trainer
    replicas = (s.dp or 1) * (s.ep or 1)  # the ranks the global batch is split over
    activations, state = [], []
    if s.activations in ("device", "selective"):  # selective keeps more (Note [selective recomputation])
        activations.append("strategy.activations=checkpoint")
    if (t.batch_size // replicas) % (2 * t.grad_accum) == 0:
        activations.append(f"trainer.grad_accum={2 * t.grad_accum}")  # the same global batch, half at a time
    if replicas * (s.cp or 1) > 1 and s.zero < 3:
        state.append("strategy.zero=3")  # the weights, gradients and optimizer state sharded over them
    if world == 1 and not strategy_spec(s.name).offloads:
        state.append("strategy=offload")
    smaller = t.batch_size // 2
    batch = [f"trainer.batch_size={smaller}"] if smaller and smaller % (replicas * t.grad_accum) == 0 else []
    if phase in ("optimizer step", "checkpoint save", "checkpoint load", "saving the final weights"):
        return state + activations + batch
    return activations + state + batch


def out_of_memory(e: BaseException, cfg: Config, model: nn.Module | None, device: torch.device,
                  run_dir: Path) -> OutOfMemory | None:
    """The one line of a CUDA out-of-memory on this rank (Note [out of memory]) as an error to raise instead of
    `e`; None when `e` is not one (and wraps none).

    Args:
        e: the error the run raised, with its traceback.
        cfg: the run's resolved config.
        model: the engine's model (module names); None: class names only.
        device: this rank's device.
        run_dir: the run directory (auto.json's plan; the memory snapshot).
    """
    chain = oom_chain(e)
    if chain is None:
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    at = where(chain, model)
    place = f"on rank {rank}" + (f" at step {at.step}" if at.step is not None else "") + f" in {at.phase}"
    place += f" ({at.module})" if at.module else ""
    peak = planned_peak(cfg, run_dir)
    plan = f"the plan predicts {human_bytes(peak)} at its largest rank (strategy=auto, auto.json)" \
        if peak is not None else \
        f"no plan was made for this run (python launch/plan.py <its overrides> nproc={world} predicts each " \
        f"rank's peak)"
    tries = changes(cfg, world, at.phase)
    advice = f"try {', then '.join(tries)}" if tries else "no config change of the run's lowers its peak further"
    line = f"out of GPU memory {place}: {figures(device, cfg.memory.fraction)}; {plan}; {advice}"
    snapshot = snapshot_after_oom(cfg.trainer, run_dir, device, rank)
    return OutOfMemory(line + (f"; memory snapshot: {snapshot}" if snapshot else ""))
