"""Where pipeline stages begin: candidate blocks, their measured cost, and a balanced split.

# Note [pipeline partitioning]
Candidates (parallel.blocks.candidates) are the model's top-level children in the order its forward calls
them, with ModuleList / Sequential children expanded one level (the repeated
blocks), and a child that holds the repeated blocks deeper (a Hugging Face
model's `model.layers`) replaced by its own children (Note [nested blocks] in
parallel/blocks.py). A stage is a contiguous run of candidates; the split itself
is traced from the forward (Note [tracing for the pipeline] in trace.py), so
values that skip over stages and non-Sequential control flow are carried
correctly. Costs:
  params  trainable parameter count;
  memory  bytes of weights + gradients + optimizer state (the shares one rank
          holds under ZeRO) + activations saved for backward for the
          microbatches a stage holds at once (what autograd saves in one
          forward, counted on fake tensors; under strategy.activations=checkpoint
          each block's input alone, which is what a block recomputed whole keeps);
  time    forward + backward time of one microbatch, measured on a real copy of
          the block on the CPU, or estimated from its FLOPs (counted on meta
          tensors) at the rate measured on the other blocks when the block is
          larger than `measure_limit_bytes`.
The balancer minimizes the costliest stage, subject to each stage's memory
fitting the budget when one is given.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from parallel.blocks import repeated_blocks
from parallel.tensors import faking


@dataclass
class BlockCost:
    """What one candidate block costs for one microbatch (see the Note)."""

    name: str
    params: int
    param_bytes: int
    act_bytes: int = 0
    input_bytes: int = 0  # its floating-point inputs: what it keeps when recomputed whole
    repeated: bool = False  # one of the model's repeated blocks (those strategy.activations recomputes)
    time_s: float = 0.0
    flops: int = 0
    measured: bool = False


def _real(t):
    if not isinstance(t, torch.Tensor):
        return t
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, dtype=t.dtype).requires_grad_()
    return torch.zeros(t.shape, dtype=t.dtype)  # token ids: 0 is valid for any vocabulary


def _fwd_bwd(module: nn.Module, args, kwargs) -> None:
    out = module(*args, **kwargs)
    floats = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if floats:
        torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])


def _saved_bytes(module: nn.Module, args, kwargs, backward: bool = False) -> int:
    """Bytes of the tensors autograd saves for backward during one forward (each storage once, told by its
    StorageImpl: fake tensors' storages have no data pointer), then the backward when `backward`."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if backward:
            _fwd_bwd(module, args, kwargs)
        else:
            module(*args, **kwargs)
    return sum(seen.values())


def measure(model: nn.Module, names: list[str], inputs: dict, measure_limit_bytes: int = 256 << 20,
            repeats: int = 5) -> list[BlockCost]:
    """Cost of each candidate block for one microbatch (see Note [pipeline partitioning])."""
    blocks, repeated = [], set(repeated_blocks(model))
    for name in names:
        mod = model.get_submodule(name)
        params = [p for p in mod.parameters() if p.requires_grad]
        b = BlockCost(name, sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
                      repeated=name in repeated)
        args, kwargs = inputs[name]
        b.input_bytes = sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs))[0]
                            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point)
        # On fake tensors (parallel.tensors.faking): a Hugging Face block may read values of its inputs.
        with faking(), FlopCounterMode(display=False) as fc:
            fake_saved = _saved_bytes(mod, *tree_map(lambda t: t.detach().requires_grad_(t.dtype.is_floating_point)
                                                     if isinstance(t, torch.Tensor) else t, (args, kwargs)),
                                      backward=True)
        b.flops, b.act_bytes = fc.get_total_flops(), fake_saved
        for p in mod.parameters():
            p.grad = None  # the meta backward above must leave nothing behind in the model
        if b.param_bytes <= measure_limit_bytes:
            real = copy.deepcopy(mod).to_empty(device="cpu")
            with torch.no_grad():
                for t in list(real.parameters()) + list(real.buffers()):
                    if t.dtype.is_floating_point:
                        t.normal_(0, 0.02)
                    else:  # integer buffers index (BERT's position and token type ids): 0 is always valid
                        t.zero_()
            rargs, rkwargs = tree_map(_real, (args, kwargs))
            b.act_bytes = _saved_bytes(real, rargs, rkwargs)
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                _fwd_bwd(real, rargs, rkwargs)
                times.append(time.perf_counter() - t0)
            # The fastest run after a warm-up: other work on the machine only
            # ever adds time, so the minimum is the block's own cost.
            b.time_s, b.measured = min(times[1:]), True
            del real
        blocks.append(b)
    _estimate_unmeasured(blocks)
    return blocks


def _estimate_unmeasured(blocks: list[BlockCost]) -> None:
    measured = [b for b in blocks if b.measured and b.flops > 0]
    rate = sum(b.flops for b in measured) / max(1e-9, sum(b.time_s for b in measured)) if measured else 1e10
    for b in blocks:
        if not b.measured:
            b.time_s = b.flops / rate  # its saved bytes: those counted on fake tensors

def stage_memory(blocks: list[BlockCost], in_flight: int, state: float = 2.0,
                 shares: tuple[float, float, float] = (1.0, 1.0, 1.0), recomputed: bool = False) -> int:
    """Weights + grads + the optimizer's state (`state` x the weights: AdamW's two moments 2, SGD with momentum
    1) + saved activations of `in_flight` microbatches; `shares`: the part of the weights, gradients and state
    one rank holds (ZeRO's shards over the data-parallel ranks, `held_shares`); `recomputed`: each repeated
    block recomputed whole in backward, keeping its input alone."""
    w, g, o = shares
    return sum(int((w + g + state * o) * b.param_bytes) +
               in_flight * (b.input_bytes if recomputed and b.repeated else b.act_bytes) for b in blocks)


def held_shares(zero: int, shard_ranks: int) -> tuple[float, float, float]:
    """The part of a stage's weights, gradients and optimizer state one rank holds at ZeRO level `zero` over a
    shard group of `shard_ranks` ranks: the state from zero 1, the gradients from 2, the weights at 3."""
    n = max(shard_ranks, 1)
    return (1 / n if zero >= 3 else 1.0, 1 / n if zero >= 2 else 1.0, 1 / n if zero >= 1 else 1.0)


def cost_of(block: BlockCost, balance: str, in_flight: int = 1, state: float = 2.0) -> float:
    if balance == "params":
        return float(block.params)
    if balance == "memory":
        return float(stage_memory([block], in_flight, state))
    return block.time_s


def balance(costs: list[float], stages: int, memory: list[int] | None = None,
            budget: int | None = None, allowed: set[int] | None = None) -> list[int]:
    """Start index of each stage for contiguous groups minimizing the largest group cost.

    Args:
        costs: cost of each block, in order.
        stages: number of groups (<= len(costs)).
        memory: bytes of each block (when a budget is given).
        budget: the largest memory one stage may need; None for no limit.
        allowed: block indices a stage may start at (0 always may); None: all.
    Raises:
        ValueError: when no split fits the budget.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    mprefix = [0]
    for m in memory or [0] * n:
        mprefix.append(mprefix[-1] + m)
    inf = float("inf")
    # best[s][i]: the lowest possible max-cost of splitting blocks[:i] into s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                if budget is not None and mprefix[i] - mprefix[j] > budget:
                    continue
                if j > 0 and allowed is not None and j not in allowed:
                    continue
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    if best[stages][n] == inf:
        why = f"fits {budget} bytes per stage" if budget is not None else "has only floating-point values crossing its boundaries"
        raise ValueError(f"no split into {stages} stages {why}")
    starts, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def equal_split(n: int, stages: int) -> list[int]:
    """Start indices that give each stage the same number of blocks (earlier ones one more)."""
    size, extra = divmod(n, stages)
    starts, i = [], 0
    for s in range(stages):
        starts.append(i)
        i += size + (1 if s < extra else 0)
    return starts
