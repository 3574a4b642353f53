"""strategy=auto over a cluster, before any plan: a lower bound on each layout's memory per rank, and a cheap
estimate of its memory and step time to order the rest (Note [auto over a cluster] in
parallel/planning/cluster.py). Arithmetic on the model's shape (parallel.planning.layouts.ModelShape) and the
GPU profile; nothing is built or traced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from parallel.config import Config, HardwareConfig
from parallel.planning.layouts import Layout, ModelShape
from parallel.planning.network import Placement, call_seconds, group_ranks, placement
from parallel.strategies.pipeline.schedules import analytic_bubble

ACT_BYTES = 2  # the fewest bytes an activation element takes (bf16): what the bound counts
EFFICIENCY = 0.6  # of the profile's peak that a step's compute reaches, for the estimate only
RECOMPUTE = {"device": 1.0, "selective": 1.05, "checkpoint": 4 / 3}  # compute, of the step without recomputation
REDUCE_BYTES = 4  # gradients reduced in fp32 (trainer.reduce_precision's default)


@dataclass(frozen=True)
class Estimate:
    bound: int  # bytes no rank can do with less (Note [auto over a cluster])
    peak: float  # bytes the largest rank is estimated to hold
    step: float  # seconds of a step, estimated


def _adam_states(cfg: Config) -> int:
    """Optimizer state tensors per parameter: Adam's two moments, else none counted."""
    name = (cfg.optim._target_ or cfg.optim.name or "").lower()
    return 2 if "adam" in name else 0


def _states(lay: Layout, held: float, pb: int, adam: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes a rank keeps of `held` parameters under the layout's zero."""
    n = lay.dp * lay.cp  # the dense weights' data-parallel ranks (Note [mesh dimensions])
    group = n / lay.replicate
    w, g, o = held * pb, held * pb, held * pb * adam
    if lay.zero == 1:
        return w, g, o / n
    if lay.zero == 2:
        return w, g / group, o / group
    if lay.zero == 3:
        return w / group, g / group, o / group
    return w, g, o


def _tokens(lay: Layout, cfg: Config) -> float:
    """Tokens of one microbatch (micro-step) on a rank."""
    micro = lay.microbatches if lay.pp > 1 else cfg.trainer.grad_accum
    return cfg.trainer.batch_size / lay.dp / micro * cfg.data.seq_len / lay.cp


def lower_bound(lay: Layout, shape: ModelShape, cfg: Config) -> int:
    """Bytes some rank must hold, whatever the planner finds: at the optimizer's step its weights, gradients and
    optimizer state (sharded as the layout shards them, over tp and pp at best evenly), and at the end of a
    forward its weights, optimizer state and what one microbatch saved (each block's input under any
    policy, two such under none; on the last stage the logits in bf16)."""
    pb, adam = shape.param_bytes, _adam_states(cfg)
    spread = _states(lay, shape.params / (lay.tp * lay.pp), pb, adam)
    most = math.ceil(shape.blocks / lay.pp) if shape.blocks else 0  # the blocks of the rank holding most
    w, g, o = _states(lay, most * shape.block_params / lay.tp, pb, adam)
    tokens = _tokens(lay, cfg)
    saved = 0.0
    if shape.hidden:
        per_block = 2 if lay.activations == "device" and shape.heads else 1
        saved = most * per_block * tokens * shape.hidden * ACT_BYTES / (lay.tp if lay.sequence else 1)
    logits = tokens * shape.vocab * ACT_BYTES / lay.tp if cfg.data.task == "lm" and shape.vocab else 0.0
    if lay.pp == 1:  # one stage: every parameter's share, and the logits on the same rank
        return int(max(sum(spread), spread[0] + spread[2] + saved + logits))
    return int(max(sum(spread), w + g + o, w + o + saved, logits))


def estimate(lay: Layout, shape: ModelShape, cfg: Config, hw: HardwareConfig, flops: float | None) -> Estimate:
    """The lower bound, and an estimate of the peak and the step (`flops`: the model's FLOPs of a step over the
    global batch, forward and backward, parallel.throughput.model_flops)."""
    return Estimate(lower_bound(lay, shape, cfg), _peak(lay, shape, cfg), _step(lay, shape, cfg, hw, flops))


def _peak(lay: Layout, shape: ModelShape, cfg: Config) -> float:
    """An estimate of the largest rank's peak: its states, a gathered block under zero 3, and the activations of
    the microbatches a pipeline keeps in flight (per block and token: the products' inputs and the norms',
    fewer under selective recomputation, the block's input under checkpoint), the logits in fp32 with their
    gradient."""
    pb, adam, h = shape.param_bytes, _adam_states(cfg), shape.hidden or 0
    held = shape.params / (lay.tp * lay.pp)
    w, g, o = _states(lay, held, pb, adam)
    widths = shape.block_params / h if h else 0.0  # the block's matrices' widths, summed
    stream = h / lay.tp if lay.sequence else h  # the residual stream and the norms, cut by the sequence or whole
    per_token = {"device": 4 * stream + widths / lay.tp, "selective": 2 * stream + widths / (2 * lay.tp),
                 "checkpoint": stream}[lay.activations] * pb
    blocks = shape.blocks / lay.pp
    flight = 1 if lay.pp == 1 else (lay.microbatches if lay.schedule == "GPipe" else min(lay.microbatches, lay.pp))
    tokens = _tokens(lay, cfg)
    acts = blocks * per_token * tokens * flight
    logits = tokens * shape.vocab * 10 / (lay.tp if lay.sequence else 1) if cfg.data.task == "lm" and shape.vocab \
        else 0.0  # split by the vocabulary under loss parallelism
    gathered = 2 * shape.block_params / lay.tp * 2 if lay.zero == 3 else 0.0
    return max(w + g + o, w + o + acts + logits + gathered)


@lru_cache(maxsize=4096)
def _where(shape: tuple[int, ...], dims: tuple[int, ...], per_node: int) -> Placement:
    """Where rank 0's group over `dims` of a mesh of `shape` lies (one group stands for all: they are alike)."""
    return placement(group_ranks(shape, 0, dims), per_node)


def _step(lay: Layout, shape: ModelShape, cfg: Config, hw: HardwareConfig, flops: float | None) -> float:
    """Seconds of a step, estimated: the compute (the model's FLOPs over the world at EFFICIENCY of the peak,
    recomputation added), a pipeline's bubble, and the communication as Note [step time on a profile] exposes
    it (tp's and cp's waited whole, FSDP's and DDP's beside the compute)."""
    h, tokens, per_node = shape.hidden or 0, _tokens(lay, cfg), hw.devices_per_node
    if not flops:
        flops = 6 * shape.params * cfg.trainer.batch_size * cfg.data.seq_len
    peak = hw.peak_flops.get("bf16") or max(v for v in hw.peak_flops.values() if v)
    compute = flops / lay.world / (peak * EFFICIENCY) * RECOMPUTE[lay.activations]
    mesh = (lay.dp, 1, lay.pp, lay.cp, lay.tp)  # Note [mesh dimensions]
    micro = lay.microbatches if lay.pp > 1 else cfg.trainer.grad_accum
    blocks = shape.blocks / lay.pp
    waited = 0.0
    if lay.tp > 1:  # two all-reduces a block in forward, two in backward, two more when recomputed
        calls = blocks * micro * (6 if lay.activations == "checkpoint" else 4)
        waited += calls * call_seconds(hw, "allreduce", tokens * h * 2, _where(mesh, (4,), per_node))
    if lay.cp > 1:  # the keys and values gathered in forward and backward, their gradients reduce-scattered
        kv = tokens * h * 2 * 2 * (min(shape.heads) / max(shape.heads) if shape.heads else 1)
        where = _where(mesh, (3,), per_node)
        waited += blocks * micro * (2 * call_seconds(hw, "allgather", kv, where)
                                    + call_seconds(hw, "reducescatter", kv * lay.cp, where))
    bubble = 0.0
    if lay.pp > 1:
        idle = analytic_bubble(lay.schedule, lay.pp, lay.stages, lay.microbatches)
        bubble = compute * idle / (1 - idle)
        waited += 2 * micro * lay.stages * call_seconds(hw, "send", tokens * h * 2, _where(mesh, (2,), per_node))
    return compute + bubble + waited + _data_parallel(lay, shape, hw, mesh, compute)


def _data_parallel(lay: Layout, shape: ModelShape, hw: HardwareConfig, mesh: tuple, compute: float) -> float:
    """The exposed seconds of the gradients' reduction (and zero 3's gathers, zero 1's parameters) over the
    dp x cp ranks: what runs beside the compute hidden (Note [step time on a profile])."""
    n = lay.dp * lay.cp
    if n == 1:
        return 0.0
    held, per_node = shape.params / (lay.tp * lay.pp), hw.devices_per_node
    if lay.zero < 2:
        comm = call_seconds(hw, "allreduce", held * REDUCE_BYTES, _where(mesh, (0, 3), per_node))
        if lay.zero == 1:
            comm += call_seconds(hw, "allgather", held * shape.param_bytes / n, _where(mesh, (0, 3), per_node))
        return max(0.0, comm - 2 / 3 * compute)
    r = lay.replicate
    split = (r, lay.dp // r, 1, lay.pp, lay.cp, lay.tp)  # HSDP: replicate outermost (Note [hybrid sharding])
    group = _where(split, (1, 4), per_node)
    comm = call_seconds(hw, "reducescatter", held * REDUCE_BYTES, group)
    if r > 1:
        comm += call_seconds(hw, "allreduce", held * REDUCE_BYTES * r / n, _where(split, (0,), per_node))
    if lay.zero == 3:
        comm += 2 * call_seconds(hw, "allgather", held * 2 * r / n, group)
    blocks = max(shape.blocks, 1)
    return max(0.0, comm - compute) + comm / blocks  # the first gather and the last reduce-scatter are exposed
