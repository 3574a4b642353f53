"""What "trains to the same numbers" means in this suite: two runs' losses per step and final weights, compared with
the tolerances of Note [parity tolerances]. Every parity test compares through `assert_same_losses` and
`assert_same_weights` (tests/cli.py `assert_same_training`, tests/hf_models.py `assert_as`, the resume tests).

# Note [parity tolerances]
Two runs of the same training that sum in different orders (a sharded matmul, a
reduce over ranks, another CPU's kernels) differ by rounding. The losses differ
by rounding only: LOSS_RTOL (1e-4 relative per step). Most weights too:
WEIGHT_RTOL and WEIGHT_ATOL (1e-4 relative, 1e-5 absolute). But Adam and AdamW
divide each gradient by its own running size, m / (sqrt(v) + eps): an element
whose gradient is near zero, rounding noise (attention's key bias has an exact
gradient of zero: the softmax ignores a shift shared by a query's scores), takes
a step of up to about lr in the direction of that noise, and the two runs' noise
may point either way. So such an element may legitimately end up to `reach` apart:

    reach = 2 * sum over steps t of lr_t * c(t),
    c(t) = (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2) * sum_{k<t} (b1^2 / b2)^k)

c(t) bounds |m_hat / sqrt(v_hat)| at step t for any gradients (Cauchy-Schwarz
over the moving averages, with Adam's bias corrections): 1.0 at t=1, 1.016 at
t=6, 1.04 at t=10 for the default betas (0.9, 0.999), so reach is ~2 * lr * steps
(0.06 for the default lr 5e-3 over cli.FAST's 6 steps). AdamW's weight decay
only draws two runs together (Adam's is part of the gradient, which c(t) bounds
whatever it is, clipped or not), a schedule stays under its peak lr, eps only
shortens a step. Adagrad's step is at most lr (reach = 2 * lr * steps). Other optimizers' steps scale with the gradient, so a rounding difference
stays one: their reach is 0.

reach is not the tolerance of every element: every element of any AdamW run lies
within lr * steps of its initial value, so two runs from the same initial
weights are always within reach of each other, and a run that skipped its last
update, which no logged loss sees, would pass. The rule: every element within
reach (+ the rounding tolerance); and in each tensor all but AMPLIFIED_SHARE (1%,
at least one element) within the rounding tolerance, so that a small tensor
trained wrong (a norm's 8 weights) fails as a large one does. Gradients that are
rounding noise are a small share of a model (GPT-2's key biases: 64 of the test
model's 30 000 elements; measured, 1 beyond 1e-5 on one CPU and none on another),
while an error of the code moves most elements of what it touches. The measured
case it is made for: one of the 96 elements of `transformer.h.1.attn.c_attn.bias`
1.27e-5 from the user's loop (a key bias of 4.4e-6) on an AMD EPYC, 9.6e-6 on the
CPU the suite was written on (tests/unit/test_parity.py).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

LOSS_RTOL = 1e-4
WEIGHT_RTOL, WEIGHT_ATOL = 1e-4, 1e-5  # rounding
AMPLIFIED_SHARE = 0.01  # of a tensor's elements, beyond rounding but within reach


def adam_step_bound(t: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """c(t) of Note [parity tolerances]: the most |m_hat / sqrt(v_hat)| can be at Adam's step t (1-based),
    whatever the gradients; a step moves an element by at most lr * c(t)."""
    b1, b2 = betas
    if b2 <= 0:
        return math.inf
    ratio = b1 * b1 / b2
    series = t if ratio == 1 else (1 - ratio ** t) / (1 - ratio)
    return (1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2) * series)


def adam_reach(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """How far apart two Adam(W) runs of `steps` steps at learning rates up to `lr` may put one element whose
    gradients differ only by rounding (Note [parity tolerances])."""
    return 2 * lr * sum(adam_step_bound(t, betas) for t in range(1, steps + 1))


def reach(target: str | None, lr: float, steps: int, betas=(0.9, 0.999)) -> float:
    """`adam_reach` for Adam and AdamW (optim._target_ None is AdamW), 2 * lr * steps for Adagrad, else 0."""
    name = (target or "torch.optim.AdamW").rpartition(".")[2]
    if name in ("Adam", "AdamW"):
        return adam_reach(lr, steps, tuple(betas))
    if name == "Adagrad":
        return 2 * lr * steps
    return 0.0


def run_reach(run_dir: Path | str) -> float:
    """`reach` of the run in `run_dir`, from its .hydra/config.yaml: its optimizer, peak lr (times the largest
    optim.lr_scale factor above 1) and trainer.steps."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml")
    o = cfg.optim
    scale = max([1.0] + [float(str(e).rpartition(":")[2]) for e in o.get("lr_scale", None) or []])
    return reach(o.get("_target_"), float(o.lr) * scale, int(cfg.trainer.steps), tuple(o.get("betas", (0.9, 0.999))))


def assert_same_losses(got: torch.Tensor, want: torch.Tensor) -> None:
    """The loss per step within LOSS_RTOL relative."""
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0)


def assert_same_weights(got: dict, want: dict, reach: float) -> None:
    """Final weights equal as Note [parity tolerances] says: every element within `reach` (+ rounding), and in
    each tensor all but AMPLIFIED_SHARE of them (at least one; none when `reach` is 0) within the rounding
    tolerance.

    Args:
        got, want: name -> tensor (state dicts).
        reach: how far an element whose gradient is rounding noise may move (`reach`, `run_reach`).
    """
    assert sorted(got) == sorted(want), f"names differ: {sorted(set(got) ^ set(want))}"
    beyond = []
    for name, w in want.items():
        g = got[name]
        if not w.is_floating_point():
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
            continue
        torch.testing.assert_close(g, w, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL + reach,
                                   msg=lambda m, n=name: f"{n}: {m} (beyond the reach {reach:.3g} of a "
                                                         f"rounding difference: Note [parity tolerances])")
        diff, w64 = (g.double() - w.double()).abs(), w.double().abs()
        n = int((diff > WEIGHT_ATOL + WEIGHT_RTOL * w64).sum())
        allowed = max(1, int(AMPLIFIED_SHARE * w.numel())) if reach > 0 else 0
        if n > allowed:
            beyond.append((name, n, w.numel(), allowed, float(diff.max())))
    assert not beyond, (
        f"elements differ beyond rounding (rtol {WEIGHT_RTOL:g}, atol {WEIGHT_ATOL:g}) in more than "
        f"{AMPLIFIED_SHARE:.0%} (at least one) of a tensor (Note [parity tolerances] in tests/parity.py): "
        + ", ".join(f"{name}: {n} of {numel} (at most {a}; up to {d:.3g})" for name, n, numel, a, d in beyond))
