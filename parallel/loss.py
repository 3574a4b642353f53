"""The loss: a built-in by name or the user's function, normalized over the counted targets of the whole global
batch (Note [global loss]), and the figures an evaluation adds up (loss, counted targets, correct predictions).

# Note [global loss]
The loss of a step is a mean over the counted targets of the WHOLE global batch: for a token loss with
padding (integer targets equal to `loss.ignore_index`), the sum of the real tokens' losses divided by the
number of real tokens in the global batch, whatever the microbatching, the accumulation or the data-parallel
degree. A per-microbatch mean averaged over microbatches (or ranks) weighs a token of a short microbatch
more than one of a long one: accumulation and data parallelism would then train another model than one
process on the whole batch, as soon as microbatches hold different numbers of real tokens.

So every microbatch contributes `sum / N` to the step's loss, where `sum` is its summed loss and N the
count of counted targets over the global batch:

- N is counted once per step, before the first forward, from the targets every rank already has (a pipeline
  reads the batch on every stage): this rank's count, summed over the data-parallel ranks by one scalar
  all-reduce, started before the first forward and waited for where the first microbatch's loss divides by
  N, so that it runs beside that forward instead of before it. Float targets (regression) count every element, so their N is this rank's count x dp and needs
  no collective. N is at least 1 (a batch of padding only gives loss 0, not NaN).
- The data-parallel ranks here are all those holding the same dense weights, dp x ep x cp (Note [mesh
  dimensions] in parallel/dims.py): dp and ep ranks hold different samples, and cp ranks different tokens of
  the same samples (each its chunks of every sequence), so the count is summed over cp too, and DDP / FSDP
  average the gradients over all of them.
- A built-in returns the sum itself (`reduction="sum"` of PyTorch's functional losses, `ignore_index` for
  cross-entropy). A user function declares what it returns (`loss.reduction`): `sum` is used as is; a `mean`
  over its counted targets is multiplied back by its microbatch's count. That is exact for a mean over the
  counted targets (F.cross_entropy's own `ignore_index` mean), and for any mean over samples when the
  microbatches hold equal numbers of counted targets (no padding).
- DDP and FSDP average gradients over the data-parallel ranks (a mean, as their own loss would be per rank):
  each rank differentiates dp x its contributions (`scale`), so the average is the gradient of the global
  loss. Pipeline schedules run with `scale_grads=False` (they would otherwise divide by the microbatch
  count, the per-microbatch-mean convention), and gradient accumulation adds the contributions without
  dividing by the micro-steps.

The logged loss is the sum of the contributions over microbatches and data-parallel ranks: the same global
mean `single` computes over the whole batch in one piece. An evaluation adds up the unnormalized sums and
counts of all its batches and divides once (`Loss.score`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from parallel.config import LOSS_REDUCTIONS, LossConfig, fail, import_target


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


def _cross_entropy(logits, targets, ignore_index: int, **args):
    # Classification (N, C) and lm (N, T, V) alike: the class dimension last, everything else flattened.
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index,
                           reduction="sum", **args)


def _elementwise(fn):
    return lambda out, targets, ignore_index, **args: fn(out, targets.to(out.dtype), reduction="sum", **args)


# Built-ins, each returning the SUM over its counted targets of the output's logits in fp32 (Note [global loss]).
LOSSES = {
    "mse": _elementwise(F.mse_loss),
    "l1": _elementwise(F.l1_loss),
    "huber": _elementwise(F.huber_loss),
    "smooth_l1": _elementwise(F.smooth_l1_loss),
    "cross_entropy": _cross_entropy,
}
TASK_LOSSES = {"regression": "mse", "classification": "cross_entropy", "lm": "cross_entropy"}
# loss.name=output: the loss the model computes itself (`outputs.loss`, as the Hugging Face Trainer reads it, when
# its labels are among the inputs by name: Note [inputs by name] in parallel/tensors.py): a mean over the
# targets not equal to loss.ignore_index (-100, Hugging Face's), multiplied back by their count (Note [global
# loss]). Exact where the model's mean is over those targets (a seq2seq model's labels); a causal lm that shifts
# its labels inside counts one target fewer per row, exact without padding.
OUTPUT = "output"  # also the default when the targets are among the inputs by name (derive_output_loss)


def loss_of(out) -> torch.Tensor:
    """The loss a model's output holds (`out.loss` / `out["loss"]`); a ValueError naming what it holds."""
    found = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(found, torch.Tensor):
        return found
    raise ValueError(f"loss.name={OUTPUT} takes the loss the model computes, and its output "
                     f"({type(out).__name__}) holds none: pass the targets to the forward by name "
                     "(data.input_key=[..., labels]), or use a built-in loss")


def resolve_loss_fn(c: LossConfig):
    """The user's `loss._target_` function (None for a built-in); a path that does not import is a
    ConfigError."""
    if not c._target_:
        return None
    fn = import_target("loss._target_", c._target_)
    if not callable(fn):
        fail("loss._target_", c._target_, "is not callable")
    return fn


class Loss:
    """The run's loss (Note [global loss]).

    Args:
        c: the loss config.
        task: data.task (the default built-in; accuracy for classification and lm).
        split_logits: the logits come split by the vocabulary over the tp ranks (strategy.loss_parallel, Note
            [loss parallelism] in parallel/strategies/tensor/sequence.py).
    """

    def __init__(self, c: LossConfig, task: str, split_logits: bool = False):
        self.split_logits = split_logits
        self.ignore_index, self.reduction = c.ignore_index, c.reduction
        self.user = resolve_loss_fn(c)
        self.name = c.name or TASK_LOSSES.get(task, "mse")
        self.args = dict(c.args)
        self.classifies = task in ("classification", "lm")
        self.scale = 1  # what each contribution is multiplied by in backward: the gradient-averaging degree
        self._total: torch.Tensor | None = None  # N of the step being trained (`total`)
        self._summing = None  # the all-reduce of this step's count, while it runs beside the forward
        # One sequence's auxiliary term's weight in this step, which the engine hands to the layers that add one
        # (Note [auxiliary weight] in parallel/aux_weight.py); None before the first step.
        self.aux_weight: float | None = None

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """Counted targets in `targets` (int64): integer ones not equal to ignore_index; float ones all."""
        if targets.is_floating_point():
            return torch.tensor(targets.numel(), device=targets.device)
        return (targets != self.ignore_index).sum()

    def summed(self, out, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed loss over the counted targets, their count) of one microbatch."""
        count = self.count(targets)
        if self.name == OUTPUT:
            return loss_of(out).float() * count, count
        if self.user is None:
            value = LOSSES[self.name](logits_of(out).float(), targets, self.ignore_index, **self.args)
            # on logits split by the vocabulary: a DTensor replicated over the tp ranks, whole on each
            return (value.to_local() if isinstance(value, DTensor) else value), count
        value = self.user(out, targets, **self.args)
        return (value if self.reduction == "sum" else value * count), count

    def over_pieces(self):
        """The context a microbatch's forward, loss and backward run in: PyTorch's `loss_parallel()` on logits
        split by the vocabulary (its backward needs it too), else nothing."""
        return loss_parallel() if self.split_logits else contextlib.nullcontext()

    def start_step(self, targets: torch.Tensor, group, scale: int) -> None:
        """Count N for the step whose (this rank's) targets are `targets`, over the ranks of `group`; `scale`:
        the degree the gradients are averaged over (Note [global loss])."""
        self.scale = scale
        size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        self._wait()  # a stage that never used the last step's count: its all-reduce ends before the next one
        total = self.count(targets)
        if size > 1:
            if targets.is_floating_point():
                total = total * size
            else:
                # Summed while the first microbatch's forward runs; `total` waits for it where the loss needs
                # it, so the count costs a step no more than the forward's time does.
                self._summing = dist.all_reduce(total, group=group, async_op=True)
        self._total = total if self._summing is not None else total.clamp(min=1)
        self.aux_weight = scale / (targets.shape[0] * size)  # the gradient-averaging scale over the samples

    @property
    def total(self) -> torch.Tensor | None:
        """N, the counted targets of the step's whole global batch (at least 1); None before the first step."""
        self._wait()
        return self._total

    def _wait(self) -> None:
        if self._summing is not None:
            self._summing.wait()
            self._summing = None
            self._total = self._total.clamp(min=1)

    def __call__(self, out, targets: torch.Tensor) -> torch.Tensor:
        """A microbatch's contribution to the step's loss, times `scale`: what backward differentiates."""
        return self.summed(out, targets)[0] * (self.scale / self.total)

    def score(self, out, targets: torch.Tensor) -> torch.Tensor:
        """[summed loss, counted targets, correct predictions] of an evaluation microbatch (float64), to be
        added up over batches and ranks; correct: the logits' argmax equal to a counted target (0 when
        the task does not classify or the shapes do not match)."""
        value, count = self.summed(out, targets)
        correct = torch.zeros((), device=targets.device)
        if self.classifies:
            logits = logits_of(out)
            if logits.shape[:-1] == targets.shape:
                guess = logits.argmax(-1)
                guess = guess.full_tensor() if isinstance(guess, DTensor) else guess  # split logits: gathered
                correct = ((guess == targets) & (targets != self.ignore_index)).sum()
        return torch.stack([value.detach().double(), count.double(), correct.double()])


def build_loss(c: LossConfig, task: str, split_logits: bool = False) -> Loss:
    """The run's loss (checked before the workers start: `check_loss`); `split_logits`: as Loss takes it."""
    return Loss(c, task, split_logits)


def derive_output_loss(c: LossConfig, named: list | None, target_key) -> None:
    """loss.name=output when nothing names a loss and the targets go to the forward by name (the model
    computes its loss from them, as the Hugging Face Trainer takes it); in place."""
    if c.name is None and not c._target_ and named and target_key in named:
        c.name = OUTPUT


def check_loss_config(c: LossConfig) -> None:
    """The loss's own keys: the name, the reduction, the user function's import path."""
    if c.reduction not in LOSS_REDUCTIONS:
        fail("loss.reduction", c.reduction, "unknown reduction", list(LOSS_REDUCTIONS))
    if c._target_:
        resolve_loss_fn(c)
    elif c.name is not None and c.name not in LOSSES and c.name != OUTPUT:
        fail("loss.name", c.name, "unknown loss; use a built-in or set loss._target_", [*sorted(LOSSES), OUTPUT])


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1e-12)


def check_loss(c: LossConfig, task: str, out, targets: torch.Tensor) -> None:
    """The loss on real outputs (random, shaped as the model's) and real targets of two samples: a scalar,
    and a mean or a sum as `loss.reduction` says: on a batch of one sample duplicated a mean gives that
    sample's value, a sum twice it.

    Args:
        out: the model's output for two samples (fake or meta tensors: only their shapes are read).
        targets: two samples' targets.
    """
    from torch.utils._pytree import tree_map_only

    loss = Loss(c, task)
    out, targets = _few_positions(out, targets)
    g = torch.Generator().manual_seed(1)  # not the targets' seed (example_target): outputs equal to them lose 0
    out = tree_map_only(torch.Tensor, lambda t: torch.randn(t.shape, generator=g) if t.is_floating_point()
                        else torch.zeros(t.shape, dtype=t.dtype), out)
    key, value = ("loss._target_", c._target_) if c._target_ else ("loss.name", loss.name)
    one = _tree_map(lambda t: t[:1], out)
    two = _tree_map(lambda t: torch.cat([t[:1], t[:1]]), out)
    got = []
    for o, y in ((one, targets[:1]), (two, torch.cat([targets[:1], targets[:1]]))):
        try:
            with torch.no_grad():
                result = loss.user(o, y, **loss.args) if loss.user else loss.summed(o, y)[0]
        except Exception as e:  # noqa: BLE001 - any failure is the loss not taking this output
            fail(key, value, f"fails on the model's output and the data's targets: {type(e).__name__}: "
                 f"{str(e).splitlines()[0] if str(e) else ''}")
        if not isinstance(result, torch.Tensor) or result.ndim != 0:
            shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            fail(key, value, f"must return a scalar tensor (a mean or a sum over its samples); it returned {shape}")
        got.append(float(result))
    if loss.user is None:
        return
    mean, total = _close(got[1], got[0]), _close(got[1], 2 * got[0])
    if c.reduction == "mean" and not mean:
        what = "a sum" if total else "neither a mean nor a sum"
        fail(key, value, f"returns {what} over its samples (a batch of one sample duplicated gives {got[1]:.6g}, "
             f"the sample alone {got[0]:.6g}); loss.reduction=mean needs a mean over the samples",
             ["a mean", "loss.reduction=sum for a sum"])
    if c.reduction == "sum" and not total:
        what = "a mean" if mean else "neither a mean nor a sum"
        fail(key, value, f"returns {what} over its samples (a batch of one sample duplicated gives {got[1]:.6g}, "
             f"the sample alone {got[0]:.6g}); loss.reduction=sum needs a sum over the counted targets",
             ["a sum", "loss.reduction=mean for a mean"])


CHECKED_POSITIONS = 64


def _few_positions(out, targets: torch.Tensor):
    """A sequence's first CHECKED_POSITIONS positions, in the targets and in every output tensor whose second
    dimension is the sequence: what the check reads of a loss over positions, at a size that does not grow
    with the sequence (two samples of Llama 3's logits at sequence 8192 are 8.4 GB of floats)."""
    if targets.ndim < 2 or targets.shape[1] <= CHECKED_POSITIONS:
        return out, targets
    seq = targets.shape[1]
    return (_tree_map(lambda t: t[:, :CHECKED_POSITIONS] if t.ndim >= 2 and t.shape[1] == seq else t, out),
            targets[:, :CHECKED_POSITIONS])


def _tree_map(fn, out):
    """`fn` applied to every tensor in a model's output with a batch dimension (tensors, tuples, dicts and
    Hugging Face ModelOutputs, which torch's pytree knows)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: fn(t) if t.ndim and t.shape[0] == 2 else t, out)
