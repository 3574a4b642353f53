"""The loss of each built-in task: a mean over the samples (tokens, for lm) it is given, of the model's output
read for its logits (a tensor, a Hugging Face `ModelOutput`, a dict or a tuple)."""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F


def logits_of(out) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, `out.logits` / `out["logits"]` (Hugging Face
    `ModelOutput`s are both), or the first item of a tuple or list."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) or hasattr(out, "logits"):
        found = out.get("logits") if isinstance(out, Mapping) else out.logits
        if isinstance(found, torch.Tensor):
            return found
        keys = list(out.keys()) if isinstance(out, Mapping) else [k for k in vars(out) if not k.startswith("_")]
        raise TypeError(f"the model's output ({type(out).__name__}) has no 'logits' tensor; it holds {keys}")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"the model's output is a {type(out).__name__}, not a tensor, a tuple of tensors or an "
                    "output with 'logits'")


def _task_loss(task: str):
    if task == "regression":
        return F.mse_loss
    if task == "classification":
        return F.cross_entropy
    return lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_fn(task: str):
    """The loss of `task` (regression: MSE; classification and lm: cross-entropy) of the output's logits,
    computed in fp32."""
    base = _task_loss(task)
    return lambda out, targets: base(logits_of(out).float(), targets)
