"""A planned step's time: its work (Note [step work]) timed on this machine or priced with a machine's measured
rates (Note [calibration]).

# Note [cost model]
For each rank role the planner gives the work of one step; its time is

    compute    when the run computes on this machine (no plan.calibration,
               or one made here): each distinct op call of the step (the op,
               its arguments' shapes, strides and dtypes; a DTensor op as
               the rank runs it, on its local shards) run here on real
               tensors and timed (parallel.planning.replay), x how often the step
               makes it; on a CPU under the allocator settings a worker
               steps with (Note [host allocations]), its new outputs on
               memory in use as a worker's are (`_replay`). On a CPU each
               call is timed over operand sets that span the bytes a step
               passes over once (weights, gradients, optimizer state) times
               the machine's workers, rounded up to a power of two
               (parallel.planning.replay.Replay.copies), up to twice the last-level
               cache: a step that passes the cache finds its operands
               evicted, as a call repeated on one set does not.
               Activations are left out of the span: each is read soon after
               it is made (the calibration's reference steps are replayed so
               too; the gpt of benchmarks/auto.py, a worker's step and its
               calls timed in turn in one process here, two processes at
               once: 113-121 ms stepped, 116 ms replayed so, 119-151 ms with
               its 44 MB of activations in the span).
               Their sum x the replay scale, + the replay's time per op,
               both fitted to launch/calibrate.py's reference steps (1 and
               0 without such a file); a call that cannot run without real
               values is priced as below.
               Otherwise, priced with the calibration's rates: sum over the
               product size classes of FLOPs / the class's rate, plus the
               bytes other ops move x the seconds per byte of their class,
               each scaled by what the reference steps fitted, plus ops x the
               time per op. Both add the fixed time per step, and the time
               DTensor's dispatch adds to each op on DTensors (its sharding
               propagation: tensor parallelism's ops, measured as
               dtensor_op_s). Workers that
               outnumber the cores share them: x W x threads / cores, over
               the share the rates were measured with.
    bubble     a pipeline's idle time: b / (1 - b) x the forward and backward
               compute of the other stages' ranks (their mean), b the
               schedule's idle share for equal stages
               (parallel.strategies.pipeline.schedules.analytic_bubble). The
               slowest rank waits for the others' first microbatches, not for
               its own: with equal stages this is b / (1 - b) x its own
               forward and backward; with a slow stage (a language model's
               head) it is less.
               Clipping and the optimizer's step run after the schedule and
               make no bubble (Note [step work]: forward_backward). Measured,
               the 125M Llama of benchmarks/hf.py on 2 ranks here (stage
               compute 2.2 and 2.7 s, 2 microbatches): the slow stage idle
               10% of its schedule, where b is 33%.
    comm       per collective kind and group size: calls x one call's
               measured time at their mean size (the line through the two
               measured sizes around it; gloo's reduce-scatter, an
               all-reduce inside, is what was measured, not what a ring
               would do), x comm_scale for the calls that overlap compute
               (DDP's buckets, on GPUs also FSDP2's; 1 on a CPU, whose
               cores the workers fill), + a time per call by
               how the step makes it (Note [calibration]); DDP's buckets
               are calls of their own (1 MiB first, then 25 MiB)
    transfers  bytes offload moves to and from its disk tier / the disk
               bandwidth measured at start (0 when nothing goes to disk)
    step       compute + bubble + comm + transfers, of the slowest role

Timing the calls replaces a model of kernels (how fast a product of this
shape runs, what GELU costs) with the kernels themselves; what they cost
inside a step beyond that is the operands' place (in the cache or not: the
operand sets), and the allocator's and autograd's bookkeeping (the replay
scale and time per op). The reference steps of parallel.planning.calibration_runs took
1.2-2.4x the sum of their calls timed on one set of operands here (the most
where large weights meet small batches), 0.94-1.49x over sets that span
them; the 125M Llama of benchmarks/hf.py at batch 2, two processes stepping
at once, 2.5-3.1 s against 2.58 s of calls over such sets (2.38 s on one
set). On the CPU DDP's bucket all-reduces, issued from backward's hooks while
backward goes on, are priced at their time alone (comm_scale 1: the workers
fill the cores, and an all-reduce beside products cost 0.1-1.5x its time
alone here, by size and run; Note [calibration]): FSDP2 waits on each
all-gather and reduce-scatter where no streams run them, tensor parallelism
and ZeRO-1's broadcast wait at once.
On GPUs FSDP2's prefetch overlaps as well (comm_scale, fitted on the GPUs'
own runs); a pipeline's sends are priced as waited, an upper bound. It
leaves out: the first steps' warm-up, the Python of hooks (FSDP2's, DDP's)
and of a pipeline's schedule, the collectives DTensor makes inside an op's
dispatch (an operand redistributed before the op; those of the layers'
plans are counted), the data loader's time when it is the bottleneck, and
logging.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import platform
from pathlib import Path

import torch

from parallel.config import Config, ConfigError, cuda_run, pipelined, strategy_spec
from parallel.hardware import worker_threads
from parallel.memory.host import steady_host_allocations
from parallel.planning.calibration import OVERLAPPED, Calibration, call_seconds, cores, quick
from parallel.planning.replay import PROBE, Replay, probe_seconds
from parallel.strategies.pipeline.schedules import analytic_bubble

log = logging.getLogger("parallel")


def load(path: str, world: int, cuda: bool) -> Calibration:
    """calibration.json at `path`, checked against the planned run: another device kind is an error, another
    torch or worker count a warning that says what is done instead.

    Raises:
        ConfigError: missing, unreadable, or measured on another kind of device.
    """
    where = f"plan.calibration={path!r}"
    try:
        raw = json.loads(Path(path).read_text())
        cal = Calibration(**raw)
        if not cal.products or not cal.memory:
            raise ValueError("no product or memory rates")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file (make one with `python launch/calibrate.py nproc={world}`)") \
            from None
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{where}: not a calibration file ({type(e).__name__}: {e}); make one with "
                          f"`python launch/calibrate.py nproc={world}`") from None
    want = "cuda" if cuda else "cpu"
    if cal.kind != want:
        raise ConfigError(f"{where}: measured on {cal.device}, and this run is planned for {want}; make one on a "
                          f"node of the machine that will run it (`python launch/calibrate.py nproc={world}"
                          f"{' trainer.device=cuda' if cuda else ''}`)")
    if cal.torch.split("+")[0] != torch.__version__.split("+")[0]:
        log.warning("%s: made with torch %s, this is %s: its rates used as they are", where, cal.torch,
                    torch.__version__)
    if cal.world != world:
        log.warning("%s: measured with %d processes, the plan has %d: compute scaled by the cores' share, "
                    "collectives of a group size not measured priced as the nearest measured", where, cal.world,
                    world)
    return cal


@functools.lru_cache(maxsize=None)
def _measured(world: int, device_type: str) -> Calibration:
    """This process measured once (parallel.planning.calibration.quick): auto's candidates and the plan it picks are
    priced with the same rates. Under the workers' host allocator (`_replay`)."""
    steady_host_allocations(keep_large=device_type == "cpu")
    return quick(world, torch.device(device_type))


def calibration_for(cfg: Config, world: int) -> Calibration:
    """plan.calibration, else this process measured (parallel.planning.calibration.quick, once a process): on its GPU
    for a CUDA run, and on the CPU for a CUDA run planned on a host without one (with a warning: such times
    rank the candidates, they are not a GPU's)."""
    if cfg.plan.calibration:
        return load(cfg.plan.calibration, world, cuda_run(cfg.trainer.device))
    if cuda_run(cfg.trainer.device):
        if torch.cuda.is_available():
            return _measured(world, "cuda")
        log.warning("plan.calibration: none given, and this host has no GPU: the CUDA run's step times are priced "
                    "with this CPU's rates (they rank the candidates; for a GPU's times make a calibration on one: "
                    "`python launch/calibrate.py nproc=N` on a GPU node, then plan.calibration=PATH)")
        cal = _measured(world, "cpu")
        return dataclasses.replace(cal, made=cal.made + ", for a CUDA run on a host without a GPU")
    return _measured(world, "cpu")


@functools.lru_cache(maxsize=None)
def _replay(device_type: str, threads: int | None, probe_s: float | None) -> Replay:
    """One Replay a process for each device, thread count and calibrated speed: a call shape is timed once,
    whichever plan has it.

    This process's allocator is set as each worker sets its own before it steps (Note [host allocations]):
    otherwise a call's new output may be mapped and faulted in afresh on every call, or not, by what this
    process freed before. The same plan's calls (an MLP's data-parallel step) were priced 9.6-24.1 ms of
    memory-bound ops in processes one after another here, an out-of-place op on 1 MB paying 256 page faults
    a call in some of them (a sqrt 680-910 us, against 140-180 us and none), where the workers' steps fault
    about 4 times a step.
    Only planning processes replay (launch/plan.py and calibrate.py, train.py's strategy=auto before it
    starts the workers, which set the same)."""
    steady_host_allocations(keep_large=device_type == "cpu")
    return Replay(torch.device(device_type), threads, probe_s)


def replay_for(cfg: Config, cal: Calibration, world: int) -> Replay | None:
    """A Replay when the run computes on this machine's kind of device and the rates are this machine's (no
    plan.calibration, or one made here): its op calls are then timed here (Note [cost model])."""
    cuda = cuda_run(cfg.trainer.device)
    if cuda and not torch.cuda.is_available() or cal.host != platform.node():
        return None
    if cuda:
        return _replay("cuda", None, None)
    # the replay runs in this one process: its calls are held to the probe's time in the process that replayed
    # the calibration's reference steps, alone; a file without one, to its rate of products of the probe's size
    # as one process alone would have measured it (rates measured with the cores shared are that share slower)
    probe = cal.probe_s or probe_seconds(cal.product_rate(PROBE) * cal.share())
    return _replay("cpu", worker_threads(world), probe)


def _contention(cal: Calibration, world: int) -> float:
    """Compute time x this factor for a run of `world` workers priced with rates measured with cal.world."""
    if cal.kind == "cuda":
        return 1.0
    planned = max(1.0, world * cal.threads / (cal.cores or cores()))
    return planned / cal.share()


def compute_parts(work: dict, cal: Calibration, factor: float = 1.0) -> dict[str, float]:
    """Seconds of a role's ops (Note [cost model]): products by size class, memory-bound ops by their bytes,
    and the fixed cost of the ops and of the step ("ops")."""
    products = sum(flops / cal.product_rate(int(size)) for size, (_, flops) in work["products"].items())
    memory = sum(nbytes * cal.memory_time(int(size)) for size, (_, nbytes) in work["memory"].items())
    return {"products": products * cal.products_scale * factor, "memory": memory * cal.memory_scale * factor,
            "ops": (work["ops"] * cal.op_s + dtensor_time(work, cal) + cal.step_s) * factor}


def dtensor_time(work: dict, cal: Calibration) -> float:
    """Seconds DTensor's dispatch adds to a role's ops on DTensors (Note [cost model])."""
    return work.get("dtensor_ops", 0) * cal.dtensor_op_s


def forward_backward_share(work: dict, cal: Calibration) -> float:
    """The share of a role's compute in its forward and backward (Note [step work]), priced by class: 1 for a
    work without that part recorded."""
    def priced(w: dict) -> float:
        parts = compute_parts({**w, "dtensor_ops": 0}, cal)
        return parts["products"] + parts["memory"] + w["ops"] * cal.op_s

    whole = priced(work)
    return min(1.0, priced(work["forward_backward"]) / whole) if "forward_backward" in work and whole > 0 else 1.0


def compute_time(work: dict, cal: Calibration, factor: float = 1.0) -> float:
    """Seconds of a role's ops: the sum of `compute_parts`."""
    return sum(compute_parts(work, cal, factor).values())


def comm_time(work: dict, cal: Calibration) -> float:
    """Seconds of a role's collectives and sends."""
    total = 0.0
    for key, (calls, nbytes) in work["comm"].items():
        kind, group = key.rsplit("/", 1)
        total += cal.comm_time(kind, int(group), calls, nbytes)
    return total


def step_times(cfg: Config, plans: list, cal: Calibration, world: int, disk: float | None = None,
               replay: Replay | None = None) -> dict:
    """The cost model's terms for a planned step (Note [cost model]), in seconds, of its slowest role: compute
    (and its parts: products, memory, ops), bubble, comm, transfers and their sum, step. `replay`: the op
    calls are timed on this machine instead of priced by class."""
    s = cfg.strategy
    factor = _contention(cal, world)

    def compute(p) -> dict[str, float]:
        if replay is None or not p.calls:
            return compute_parts(p.work, cal, factor)
        # the workers of this machine share its caches: their steps' bytes together (Note [cost model])
        timed = replay.price(p.calls, cal, span=(p.params + p.grads + p.optimizer) * world)
        return {"products": timed["products"] * cal.replay_scale * factor,
                "memory": timed["memory"] * cal.replay_scale * factor,
                "ops": (p.work["ops"] * cal.replay_op_s + dtensor_time(p.work, cal) + cal.step_s) * factor}

    rows = [(compute(p), comm_time(p.work, cal), p) for p in plans]
    parts, comm, worst = max(rows, key=lambda r: sum(r[0].values()) + r[1])
    compute = sum(parts.values())
    bubble = 0.0
    if pipelined(s):  # b / (1 - b) x the other stages' forward and backward (Note [cost model])
        idle = analytic_bubble(s.schedule, s.pp, s.stages_per_rank, s.microbatches)
        scheduled = [sum(c.values()) * forward_backward_share(p.work, cal) for c, _, p in rows if p is not worst] \
            or [compute * forward_backward_share(worst.work, cal)]
        bubble = sum(scheduled) / len(scheduled) * idle / (1 - idle)
    transfers = worst.io_bytes / disk if disk and strategy_spec(s.name).offloads else 0.0
    return {**parts, "compute": compute, "bubble": bubble, "comm": comm, "transfers": transfers,
            "step": compute + bubble + comm + transfers}


def describe(cal: Calibration) -> str:
    """One line naming the rates a prediction used."""
    big = max(cal.products, key=int)
    return (f"{cal.made}: {cal.device}, {cal.world} process(es) x {cal.threads} thread(s) on {cal.cores} cores; "
            f"products {cal.products[big] / 1e9:.1f} GFLOP/s at {big}, {cal.op_s * 1e6:.1f} us per op, "
            f"{cal.dtensor_op_s * 1e6:.1f} us more on DTensors, op calls timed alone x {cal.replay_scale:.2f} + "
            f"{cal.replay_op_s * 1e6:.1f} us in a step"
            + (f", all-reduce {(n := max(cal.comm[k])[0]) / max(call_seconds(cal.comm[k], n), 1e-12) / 1e9:.2f} "
               f"GB/s at {n >> 20} MiB" if (k := next((k for k in cal.comm if k.startswith("allreduce/")), None))
               else "")
            + (f", overlapped collectives in a step ({', '.join(OVERLAPPED[cal.kind])}) x {cal.comm_scale:.2f}"
               f"{' (a CPU: as timed alone)' if cal.kind == 'cpu' and cal.comm_scale == 1.0 else ''}, "
               f"+ {cal.call_s * 1e3:.2f} ms a call from hooks "
               f"(FSDP2's, DDP's buckets) + {cal.send_s * 1e3:.2f} ms a send + {cal.sync_s * 1e3:.2f} ms any "
               f"other call" if cal.comm_scale != 1.0 or cal.call_s or cal.send_s or cal.sync_s else ""))
