"""A planned step's time on a GPU profile: its ops (Note [op times on a profile]) and collectives (Note [collective
model]) priced from the work the planner recorded, with what overlaps what; nothing is run or allocated.

# Note [step time on a profile]
With `hardware=NAME` a GPU profile (Note [hardware profiles] in
parallel/hardware.py), each rank role's step (Note [step work]) is priced:

    compute    its ops one after another on one stream (Note [op times on a
               profile]): products, attention, memory-bound ops. Blocks
               recomputed in backward (strategy.activations=checkpoint) are
               in it as the step makes them: their forward again, in backward.
    comm       each collective over its group's placement (Note [collective
               model]): calls x one call at their mean size, and what of
               that is exposed, not hidden by the compute:
                 FSDP2's all-gathers and reduce-scatters (process-group calls
                 from its hooks, on streams of their own): the next block's
                 all-gather is prefetched while this block computes, a
                 block's reduce-scatter runs while the one before it computes
                 backward. Exposed = max(0, comm - compute) per block, the
                 step's blocks taken alike (the plan holds the step's totals:
                 as many blocks as reduce-scatters, each with its share of
                 the forward and backward), plus the first all-gather, which
                 nothing hides, and the last reduce-scatter, which the
                 optimizer waits for.
                 DDP's buckets: all-reduced as backward goes on (2/3 of the
                 forward and backward: a product's backward is two products
                 of its size). Exposed = the last bucket + max(0, the others
                 - backward).
                 Every other call is waited where it is made, exposed whole:
                 tensor parallelism's all-reduces and gathers, context
                 parallelism's exchanges, expert parallelism's all-to-alls,
                 ZeRO-1's broadcast, a pipeline's sends, the loss's sums.
    bubble     a pipeline's idle time, as Note [cost model] prices it: b / (1 -
               b) x the other stages' forward and backward compute (their
               mean), b the schedule's idle share
               (parallel.strategies.pipeline.schedules.analytic_bubble)
    transfers  offload's copies: the bytes its tiers move (Note [planner]) /
               the host link's bandwidth (with a disk tier, the slower of it
               and the disk measured at start), on streams of their own and
               prefetched: exposed = max(0, copies - compute)
    step       compute + exposed comm + bubble + exposed transfers, of the
               slowest role (compute and exposed comm)

tokens_per_s_per_device: the global batch's tokens / step / world size (LM
tasks); mfu: the model FLOPs of a step (parallel.throughput.model_flops, as the
logged MFU counts them: the unpartitioned model's forward and backward) / the
world size / step / the profile's peak for the run's precision. Left out, and
printed so (LEFT_OUT): the gaps between kernels and the host's Python (hooks,
the schedule, the optimizer's loop), NCCL's fixed cost per call and its
contention with the compute (memory bandwidth, SMs), stragglers, clocks under
the power limit, the data loader, the first steps' warm-up.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.config import Config, HardwareConfig, bf16_run, pipelined, strategy_spec
from parallel.data import example_input
from parallel.dims import ParallelDims
from parallel.hardware import cuda_precision, profile_precision
from parallel.planning.kernels import class_seconds, compute_parts
from parallel.planning.network import Placement, call_seconds, canonical, group_ranks, placement
from parallel.planning.work import BUCKET
from parallel.strategies.pipeline.schedules import analytic_bubble
from parallel.tensors import main_field
from parallel.throughput import model_flops

# FSDP2's collectives: the process-group all-gathers and reduce-scatters its hooks issue (Note [step work])
FSDP_OPS = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allgather_into_tensor_coalesced",
            "c10d::reduce_scatter_tensor_coalesced")
BACKWARD_SHARE = 2 / 3  # of the forward and backward: what DDP's buckets run beside
DATA_DIMS = (0, 1, 3)  # dp, ep, cp: the mesh DDP replicates over (Note [mesh dimensions])
LEFT_OUT = ("the gaps between kernels and the host's Python (launches, hooks, the schedule)",
            "NCCL's fixed cost per call and its contention with the compute for memory and SMs",
            "stragglers (ranks that reach a waited collective apart)", "clocks under the power limit",
            "the data loader", "the first steps' warm-up")


@dataclass
class Collective:
    """One kind of call of a role's step on one group: calls, bytes in all, where the group lies, FSDP2's or not."""
    kind: str
    calls: float
    nbytes: float
    where: Placement
    fsdp: bool = False

    def seconds(self, hw: HardwareConfig) -> float:
        """All its calls' seconds, each at the mean size, alone."""
        return self.calls * call_seconds(hw, self.kind, self.nbytes / self.calls, self.where) if self.calls else 0.0


def collectives(work: dict, rank: int, dims: ParallelDims, hw: HardwareConfig) -> list[Collective]:
    """A role's collectives, each with its group's placement (Note [collective model])."""
    out = [Collective(g["kind"], g["calls"], g["bytes"], placement(g["ranks"], hw.devices_per_node, g["size"]),
                      g["op"] in FSDP_OPS) for g in work.get("comm_groups", []) if g["calls"]]
    for key, (calls, nbytes) in work["comm"].items():
        if key.startswith(f"{BUCKET}/") and calls:
            ranks = group_ranks(dims.shape, rank, DATA_DIMS)
            out.append(Collective(BUCKET, calls, nbytes, placement(ranks, hw.devices_per_node)))
    return out


def exposed_comm(hw: HardwareConfig, colls: list[Collective], fb: float) -> dict[str, dict]:
    """Per kind: calls, bytes, seconds alone and exposed beside a forward and backward of `fb` seconds (Note [step
    time on a profile]), and the groups' placements."""
    out: dict[str, dict] = {}

    def add(c: Collective, alone: float, exposed: float) -> None:
        row = out.setdefault(canonical(c.kind) if c.kind != BUCKET else BUCKET,
                             {"calls": 0.0, "bytes": 0.0, "alone_s": 0.0, "exposed_s": 0.0, "groups": []})
        row["calls"] += c.calls
        row["bytes"] += c.nbytes
        row["alone_s"] += alone
        row["exposed_s"] += exposed
        where = f"{c.where.size} ranks on {c.where.nodes} node{'s' if c.where.nodes > 1 else ''}"
        if where not in row["groups"]:
            row["groups"].append(where)

    fsdp = [c for c in colls if c.fsdp]
    buckets = [c for c in colls if c.kind == BUCKET]
    for c in colls:
        if not c.fsdp and c.kind != BUCKET:
            add(c, t := c.seconds(hw), t)
    if fsdp:
        alone = [c.seconds(hw) for c in fsdp]
        first = _per_call(fsdp, alone, "allgather")
        last = _per_call(fsdp, alone, "reducescatter")
        hideable = max(0.0, sum(alone) - first - last)
        rest = max(0.0, hideable - fb)
        for c, t in zip(fsdp, alone):  # the first gather and last reduce-scatter, and a share of the rest
            edge = first if c.kind == "allgather" else last
            own = edge * c.calls / _calls(fsdp, c.kind)
            add(c, t, min(t, own + rest * max(0.0, t - own) / hideable if hideable else own))
    if buckets:
        alone = [c.seconds(hw) for c in buckets]
        last = sum(alone) / sum(c.calls for c in buckets)
        rest = max(0.0, sum(alone) - last - BACKWARD_SHARE * fb)
        for c, t in zip(buckets, alone):
            share = t / sum(alone) if sum(alone) else 0.0
            add(c, t, min(t, (last + rest) * share))
    return out


def _calls(colls: list[Collective], kind: str) -> float:
    return sum(c.calls for c in colls if c.kind == kind) or 1.0


def _per_call(colls: list[Collective], alone: list[float], kind: str) -> float:
    """The mean seconds of one call of `kind` among `colls` (0 when there is none)."""
    calls = sum(c.calls for c in colls if c.kind == kind)
    return sum(t for c, t in zip(colls, alone) if c.kind == kind) / calls if calls else 0.0


def _fb_share(hw: HardwareConfig, work: dict, fp32: str, bf16: bool) -> float:
    """The share of a role's compute in its forward and backward (Note [step work]), priced by class."""
    if "forward_backward" not in work:
        return 1.0
    whole = sum(class_seconds(hw, work, part, fp32, bf16) for part in ("products", "memory"))
    fb = sum(class_seconds(hw, work["forward_backward"], part, fp32, bf16) for part in ("products", "memory"))
    return min(1.0, fb / whole) if whole > 0 else 1.0


def _transfers(cfg: Config, io_bytes: int, hw: HardwareConfig, disk: float | None) -> float:
    """Seconds of offload's copies over the host link (a disk tier: no faster than the disk)."""
    s = cfg.strategy
    if not strategy_spec(s.name).offloads or not io_bytes:
        return 0.0
    bandwidth = hw.host_link.bandwidth or hw.memory_bandwidth
    if disk and "disk" in (s.params, s.optimizer, s.activations):
        bandwidth = min(bandwidth, disk)
    return io_bytes / bandwidth


def profile_times(cfg: Config, plans: list, world: int, hw: HardwareConfig, disk: float | None = None) -> dict:
    """The step's terms on profile `hw` (Note [step time on a profile]), seconds, of its slowest role: compute
    (products, attention, memory), comm (exposed; comm_alone: all of it), bubble, transfers (exposed;
    transfers_alone), step; comm_by_kind: per kind, its calls, bytes, seconds alone and exposed, groups."""
    fp32, bf16 = cuda_precision(False), bf16_run(cfg)  # fp32 products run as tf32 when torch lets them
    dims = ParallelDims.of(cfg.strategy, world)
    rows = []
    for p in plans:
        parts = compute_parts(hw, p.calls, p.work, fp32, bf16)
        compute = sum(parts.values())
        fb = compute * _fb_share(hw, p.work, fp32, bf16)
        comm = exposed_comm(hw, collectives(p.work, p.rank, dims, hw), fb)
        rows.append((parts, compute, fb, comm, p))
    parts, compute, fb, comm, worst = max(rows, key=lambda r: r[1] + sum(k["exposed_s"] for k in r[3].values()))
    bubble = 0.0
    s = cfg.strategy
    if pipelined(s):
        idle = analytic_bubble(s.schedule, s.pp, s.stages_per_rank, s.microbatches)
        others = [r[2] for r in rows if r[4] is not worst] or [fb]
        bubble = sum(others) / len(others) * idle / (1 - idle)
    copies = _transfers(cfg, worst.io_bytes, hw, disk)
    transfers = max(0.0, copies - compute)
    exposed = sum((k["exposed_s"] for k in comm.values()), 0.0)
    return {**parts, "ops": 0.0, "compute": compute, "bubble": bubble, "comm": exposed,
            "comm_alone": sum((k["alone_s"] for k in comm.values()), 0.0), "transfers": transfers,
            "transfers_alone": copies, "step": compute + exposed + bubble + transfers,
            "comm_exposed": {k: v["exposed_s"] for k, v in comm.items()}, "comm_by_kind": comm}


def describe_profile(hw: HardwareConfig) -> str:
    """One line naming the profile a prediction used."""
    peaks = ", ".join(f"{k} {v / 1e12:.4g}" for k, v in hw.peak_flops.items() if v)
    return (f"hardware={hw.name}: {hw.gpu or hw.name}, peak TFLOP/s {peaks}; memory {hw.memory_bandwidth / 1e12:.3g} "
            f"TB/s; {hw.devices_per_node} a node, {hw.node_link.kind or 'node link'} "
            f"{(hw.node_link.bandwidth or 0) / 1e9:.0f} GB/s, network {(hw.network.bandwidth or 0) / 1e9:.0f} GB/s, "
            f"host {(hw.host_link.bandwidth or 0) / 1e9:.0f} GB/s per direction"
            + (f"; products measured ({hw.measured})" if hw.gemm else ""))


def throughput(cfg: Config, step: float, world: int, hw: HardwareConfig) -> dict:
    """tokens_per_s_per_device (LM tasks, else None) and mfu of a step of `step` seconds on `hw`, with the peak
    and model FLOPs they used (Note [step time on a profile])."""
    column = profile_precision(cfg)
    peak = hw.peak_flops[column]
    flops = model_flops(cfg)
    tokens = main_field(example_input(cfg.data, cfg.trainer.batch_size)).numel() if cfg.data.task == "lm" else None
    return {"tokens_per_s_per_device": tokens / step / world if tokens and step else None,
            "mfu": flops / world / step / peak if flops and step else None,
            "model_flops": flops, "peak_flops": peak, "precision": column}


def report_profile(cfg: Config, plans: list, world: int, hw: HardwareConfig, disk: float | None = None) -> dict:
    """Print the step time on profile `hw`, where it goes and what the model leaves out; the same for plan.json's
    step_time (Note [step time on a profile])."""
    t = profile_times(cfg, plans, world, hw, disk)
    rates = throughput(cfg, t["step"], world, hw)
    kinds = ", ".join(f"{k} {_ms(v['exposed_s'])} of {_ms(v['alone_s'])} ({v['calls']:.0f} call{'s' if v['calls'] >= 1.5 else ''}; groups of "
                      f"{', '.join(v['groups'])})" for k, v in sorted(t["comm_by_kind"].items()))
    print(f"step time on hardware={hw.name}: predicted {_ms(t['step'])} ms: compute {_ms(t['compute'])} (matrix "
          f"products {_ms(t['products'])}, attention {_ms(t['attention'])}, memory-bound ops {_ms(t['memory'])}), "
          f"exposed comm {_ms(t['comm'])} of {_ms(t['comm_alone'])}, bubble {_ms(t['bubble'])}, offload copies "
          f"{_ms(t['transfers'])} exposed of {_ms(t['transfers_alone'])} ms")
    if kinds:
        print(f"step time: comm, ms exposed of alone: {kinds}")
    tokens = rates["tokens_per_s_per_device"]
    print("step time: " + (f"{tokens:,.0f} tokens/s per device, " if tokens else "")
          + (f"MFU {100 * rates['mfu']:.1f}% of {rates['peak_flops'] / 1e12:.4g} TFLOP/s ({rates['precision']})"
             if rates["mfu"] else "MFU not counted (the model's FLOPs could not be counted)")
          + f"; {describe_profile(hw)}")
    print(f"step time: left out: {'; '.join(LEFT_OUT)}")
    return {"hardware": hw.name, "predicted_s": {k: v for k, v in t.items() if k != "comm_by_kind"},
            "comm_by_kind": t["comm_by_kind"], **rates, "rates": describe_profile(hw), "left_out": list(LEFT_OUT),
            "calibration": None, "calls_timed_here": False}


def _ms(seconds: float) -> str:
    """Milliseconds to a tenth, or to three figures below one."""
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 1 or ms == 0 else f"{ms:.3g}"
