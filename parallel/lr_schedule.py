"""The learning-rate schedule: optim.schedule (with its warmup) or a torch.optim.lr_scheduler class.

# Note [lr schedule]
The built-in schedules are one factor of the step, applied to every group's
lr by LambdaLR (`step` counts the optimizer steps taken so far, so step k of
the run trains with factor(k - 1)). With W = optim.warmup_steps, T =
trainer.steps and m = optim.min_lr_ratio:

    warmup    step < W: (step + 1) / W, for every schedule
    constant  1
    cosine    m + (1 - m) (1 + cos(pi p)) / 2,  p = (step - W) / (T - W) in [0, 1]
    linear    m + (1 - m) (1 - p)
    wsd       1 until the decay starts at T - D, then linear to m at T: D =
              optim.decay_steps, or optim.decay_fraction x T (at least 1 step)

The factor is a function of (step, T) only, and it is computed again on
resume: a run resumed with a larger trainer.steps (extending a run) follows
the schedule of the new length from the step it resumes at. For wsd a
checkpoint taken in the stable phase therefore stays at the peak and decays
over the last D steps of the new length (the point of the schedule); one taken
after its decay began goes back up to the new schedule's value at that step.
A `optim.scheduler._target_` class keeps its own state (its state_dict) and
its own idea of the length (e.g. CosineAnnealingLR's T_max in its args).
"""
from __future__ import annotations

import inspect
import math

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from parallel.config import Config, OptimConfig, fail, import_target


def decay_start(o: OptimConfig, steps: int) -> int:
    """The step at which wsd's decay begins."""
    length = o.decay_steps if o.decay_steps is not None else max(1, round(o.decay_fraction * steps))
    return max(o.warmup_steps, steps - length)


def lr_factor(o: OptimConfig, steps: int, step: int) -> float:
    """The built-in schedule's factor of lr after `step` optimizer steps of a run of `steps` (Note [lr schedule])."""
    w, m = o.warmup_steps, o.min_lr_ratio
    if step < w:
        return (step + 1) / w
    if o.schedule == "constant":
        return 1.0
    if o.schedule == "wsd":
        start = decay_start(o, steps)
        if step < start:
            return 1.0
        return m + (1 - m) * (1 - min(1.0, (step - start) / max(1, steps - start)))
    progress = min(1.0, (step - w) / max(1, steps - w))
    if o.schedule == "linear":
        return m + (1 - m) * (1 - progress)
    return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * progress))


def _factor(o: OptimConfig, steps: int):
    """The factor as LambdaLR calls it: a plain function, which LambdaLR's state dict leaves out, marked as the
    built-in schedule for `restore_scheduler`."""

    def factor(step: int) -> float:
        return lr_factor(o, steps, step)

    factor.built_in = True
    return factor


def scheduler_class(o: OptimConfig) -> type:
    """The class optim.scheduler._target_ names. Raises ConfigError."""
    target = o.scheduler._target_
    cls = import_target("optim.scheduler._target_", target)
    if not (isinstance(cls, type) and issubclass(cls, LRScheduler)) or cls is torch.optim.lr_scheduler.ReduceLROnPlateau:
        fail("optim.scheduler._target_", target, "must name a torch.optim.lr_scheduler.LRScheduler class stepped "
             "once per optimizer step (ReduceLROnPlateau, which needs a metric, is not one)",
             "e.g. torch.optim.lr_scheduler.StepLR, OneCycleLR, CosineAnnealingLR")
    return cls


def check_schedule(cfg: Config) -> None:
    """Before workers start: wsd's decay fits the run; a scheduler class takes its args."""
    o, steps = cfg.optim, cfg.trainer.steps
    if o.schedule == "wsd" and o.decay_steps is not None and o.decay_steps > steps - o.warmup_steps:
        fail("optim.decay_steps", o.decay_steps, f"wsd's decay must fit after the warmup ({o.warmup_steps} steps) "
             f"in trainer.steps={steps}", f"1..{max(1, steps - o.warmup_steps)}")
    if o.scheduler._target_ is None:
        return
    cls = scheduler_class(o)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=o.lr)
    try:
        inspect.signature(cls).bind(optimizer, **o.scheduler.args)
        cls(optimizer, **o.scheduler.args)
    except (TypeError, ValueError) as e:
        fail("optim.scheduler.args", dict(o.scheduler.args), f"{cls.__name__} refused them: {e}")


def build_scheduler(optimizer: torch.optim.Optimizer, o: OptimConfig, steps: int) -> LRScheduler:
    """optim.schedule over a run of `steps` (trainer.steps; Note [lr schedule]), or optim.scheduler._target_
    built as `cls(optimizer, **args)`."""
    if o.scheduler._target_ is None:
        return LambdaLR(optimizer, _factor(o, steps))
    return scheduler_class(o)(optimizer, **o.scheduler.args)


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every group's settings besides its parameters and lr (numbers, flags, lists of numbers), for a checkpoint:
    a scheduler class may change them as it goes (OneCycleLR's momentum or betas)."""
    def plain(v) -> bool:
        return isinstance(v, (bool, int, float, str)) or (isinstance(v, (list, tuple)) and all(map(plain, v)))

    return [{k: v for k, v in g.items() if k not in ("params", "lr") and plain(v)} for g in optimizer.param_groups]


def restore_scheduler(scheduler: LRScheduler, optimizer: torch.optim.Optimizer, state: dict,
                      settings: list[dict] | None = None) -> None:
    """Load a checkpoint's schedule state (rank 0's) and set every group's lr for the next step.

    The built-in schedule takes only the step from it and computes the lrs
    again, for this run's groups and trainer.steps (Note [lr schedule]). A
    class loads its own state; where this rank's groups are not those saved
    (a pipeline stage holds some of them; optim.lr_scale), each per-group list
    is rebuilt from the saved first group's factor times this rank's own lrs.
    Of the saved groups' other `settings` (`group_settings`), those every saved
    group had alike (a momentum the class cycles) are set on every group here.
    """
    if isinstance(scheduler, LambdaLR) and all(getattr(f, "built_in", False) for f in scheduler.lr_lambdas):
        scheduler.last_epoch, scheduler._step_count = state["last_epoch"], state["_step_count"]
        # The expression LambdaLR.get_lr uses, so a resume of the same length sets the same numbers.
        scheduler._last_lr = [base * f(scheduler.last_epoch)
                              for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    else:
        saved, mine = list(state.get("base_lrs", [])), list(scheduler.base_lrs)
        if saved and saved != mine:
            state = {k: [v[0] / saved[0] * b for b in mine] if _per_group(v, saved) else v for k, v in state.items()}
        scheduler.load_state_dict(state)
        for key, value in _shared(settings or []).items():
            for group in optimizer.param_groups:
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def _shared(settings: list[dict]) -> dict:
    """The settings every saved group had alike, but for initial_lr (each group's own)."""
    first = settings[0] if settings else {}
    return {k: v for k, v in first.items() if k != "initial_lr" and all(s.get(k) == v for s in settings)}


def _per_group(value, saved: list) -> bool:
    return isinstance(value, list) and len(value) == len(saved) and all(isinstance(v, (int, float)) for v in value)
