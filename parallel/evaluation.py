"""Evaluation: the eval data through the engine's forward-only path, every `trainer.eval_every` steps and at
the last step.

# Note [evaluation]
Each rank reads its slice of eval batches 1 .. `trainer.eval_batches` (the same batches at every evaluation
and on any world size: `build_eval_data`) and its engine runs them forward only (`Engine.evaluate`: eval
mode, no gradients; a pipeline through its schedule's `eval`, offload streaming weights forward). The
engines return unnormalized sums, [summed loss, counted targets, correct predictions]; one all-reduce over
the loss group adds them up and the figures are divided once, so they are means over the counted targets of
all the eval batches, as `single` computes them (Note [global loss] in parallel/loss.py):

    eval_loss        summed loss / counted targets
    eval_accuracy    correct / counted targets (classification and lm: the logits' argmax)
    eval_perplexity  exp(eval_loss) (lm)

Evaluation leaves training as it was: every module gets its own training mode back, and this process's random
generators their state (a model that draws in eval mode would otherwise shift training's dropout masks), so a
run trains the same with and without evaluation.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel.config import Config
from parallel.data import DataSource
from parallel.engine import Engine
from parallel.seeding import rng_state, set_rng_state


def due(cfg: Config, step: int) -> bool:
    """Whether the run evaluates after `step`: every trainer.eval_every steps and at the last one."""
    every = cfg.trainer.eval_every
    return every > 0 and (step % every == 0 or step == cfg.trainer.steps)


def batches(cfg: Config, data: DataSource) -> int:
    """Eval batches per evaluation: trainer.eval_batches, or fewer when the eval data holds fewer."""
    n = getattr(data, "num_batches", None)
    return cfg.trainer.eval_batches if n is None else min(n, cfg.trainer.eval_batches)


def evaluate(cfg: Config, engine: Engine, data: DataSource, device: torch.device) -> dict:
    """The eval figures of the model as it is now (collective over every rank; Note [evaluation])."""
    state = rng_state()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    try:
        for i in range(1, batches(cfg, data) + 1):
            x, y = data.batch(i, device)
            totals += engine.evaluate(x, y)
    finally:
        set_rng_state(state)
    if dist.is_initialized() and engine.loss_group is not None and dist.get_world_size(engine.loss_group) > 1:
        dist.all_reduce(totals, group=engine.loss_group)
    loss, count, correct = totals.tolist()
    count = max(count, 1.0)
    record = {"eval_loss": loss / count}
    if cfg.data.task in ("classification", "lm"):
        record["eval_accuracy"] = correct / count
    if cfg.data.task == "lm":
        record["eval_perplexity"] = math.exp(min(loss / count, 700.0))  # past e^700 a float overflows
    return record
