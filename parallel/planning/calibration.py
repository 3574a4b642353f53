"""What one machine does per unit of work, measured as a run's workers would see it: calibration.json.

# Note [calibration]
parallel.planning.cost prices a planned step's work (Note [step work]) with rates
measured on the machine that will run it. `python launch/calibrate.py
nproc=W` (parallel.planning.calibration_runs) starts W processes, as a run of W
workers does (each with the threads a worker gets,
parallel.hardware.worker_threads, all on the cores at once, so the cores
they share are in every figure), and each measures:

    products   FLOP/s of square matrix products of each size class, 16 up
               to 1024 on a CPU (4096 on a GPU); a larger class takes the
               largest measured rate
    memory     seconds per byte of an elementwise op (read two, write one, a
               new output each call) of each byte class, 4 KiB to 256 MiB by
               16x, less the time of the smallest such op (its dispatch)
    steps      9 reference training steps (plain torch MLPs and a small
               transformer; forward, backward, clipping, AdamW), all
               processes stepping together, three times (rounds=N: N)
               seconds apart (after the products, the memory-bound ops and the
               collectives: a few seconds of steps found the machine up to
               a fifth faster or slower than the next few here), and their
               work:
               products_scale, memory_scale (what ops cost in a step
               beyond what they cost alone: caches, new allocations,
               GELU's arithmetic), op_s (per op) and step_s (per step)
               fitted to them, least squares of the relative error,
               non-negative; and on a CPU the replay scale: each step's op
               calls timed one by one by one process alone, as
               launch/plan.py times a plan's (parallel.planning.replay, each call
               over operand sets that span the step's bytes times the
               processes, as the plan's are; each held to the speed of a
               probe product that process timed alone, probe_s, the
               median of nine bursts, which a plan's calls are then held
               to as well), their sum fitted to the
               steps' time less step_s as replay_scale (>= 1) x the calls +
               replay_op_s x the ops (autograd's and the optimizer's
               Python per call). The steps took 1.2-2.4x their calls timed
               on one set of operands, repeated alone; over such sets,
               0.94-1.49x for the six larger steps in three calibrations
               (0.94-1.00x in one), the three small ones 1.3-2.0x (their
               Python). replay_scale 1.057-1.104 in six calibrations one
               after another, 1.000-1.133 in nine with the steps measured
               once and no probe of their own (docs/step-time-history.md)
    dtensor    what DTensor's own dispatch adds to an op (sharding
               propagation, unwrapping, wrapping): a few small ops and
               AdamW's step on sharded DTensors less the same on their
               local tensors, per op (dtensor_op_s)
    comm       for each collective kind (all-reduce, all-gather,
               reduce-scatter, all-to-all, broadcast, send) and each group
               size dividing W: the time of one call at 4 KiB ... 64 MiB
               (each the median of its repeats, the mean over the ranks; a
               send's, its receivers'; no longer than a larger size's),
               priced between sizes by the line
               through the two around (`call_seconds`); gloo on a CPU, NCCL
               on GPUs. A call's output is new each call where the
               framework's is (FSDP2's gathers and reduce-scatters, ZeRO-1's
               broadcast, an all-to-all): on a CPU its pages are first
               touched there (a 250 MB broadcast into a new buffer took
               410 ms on the receiver here, into a used one 110-120). On a
               CPU each call follows a short computation, as in a step, not
               a barrier: the backend's threads then wake on cores the
               computation holds, and the peers arrive a little apart

    in a step  runs of the framework itself on W workers (the built-in
               MLP, depth 6, 64 samples a worker, 54 steps, its step the
               median of the means of steps 7-12, ..., 49-54; zero 3,
               model, pipeline of 8 microbatches at hidden 512, whose calls
               are small; on GPUs also data zero 0 at hidden 1536, whose
               gradients' all-reduces are large beside its compute; those
               the world size cannot take are left out; their workers
               started from launch/calibrate.py's own process) against
               their plans priced with the rates above: each run's step is
               fitted as its predicted compute and bubble + its waited
               collectives timed alone + comm_scale x its overlapped ones
               (OVERLAPPED: DDP's bucket all-reduces, which backward's hooks
               issue while backward goes on; on GPUs also FSDP2's, on their
               own streams; FSDP2 on a CPU waits on each) + call_s x its
               calls issued from hooks (FSDP2's all-gathers and
               reduce-scatters, DDP's buckets) + send_s x a pipeline's
               sends (its schedule's work around them) + sync_s x every
               other collective call (waited at once: tensor parallelism's,
               ZeRO-1's broadcast), least squares of the steps' relative
               error, non-negative: each term mostly fixed by one run. On a
               CPU comm_scale is 1, not fitted: the workers fill the cores,
               and a collective's copies and sums take core time from the
               computation beside it (an async all-reduce beside products
               here: 0.65-0.93x its time alone at 64 MiB, 1.04-1.51x at 16
               MiB); fitted to the data zero 0 run it came to 0.00-1.44
               (0.20-1.19 in four calibrations within an hour), its
               all-reduces a fifth of that step and within the noise of its
               predicted compute.

Rates are the mean over the W processes. The file records what it was made
with (torch's version, the device, W, threads per process, cores), and a plan
that differs is told which (parallel.planning.cost.load). Without a file, strategy=auto
and launch/plan.py measure the process they run in (`quick`): products and
memory-bound ops on the threads a worker will have, op_s and step_s from a
tiny step (its ops do almost no work), DTensor's dispatch, scaled by how
many workers share each core, and the loopback bandwidth for every collective
(no latency, no time per call). Its replay scale stays 1: fitted to three
small reference steps (mlp 64x8 at batch 16, 256x4 at 64, transformer 64x2)
it came out 1.71-1.84 here, where the eight of launch/calibrate.py gave
1.18-1.37: small steps are more than their calls by their Python and
autograd's bookkeeping, which the scale would then charge every call of a
large step. On the
machine that runs it, parallel.planning.cost times the plan's own op calls instead of
pricing them by class (Note [cost model]).
"""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from parallel.flops import Flops  # the per-op count the planner makes
from parallel.hardware import worker_threads
from parallel.planning.replay import probe_time
from parallel.planning.work import BUCKET, MEMORY_SIZES, SIZES, Work

COMM_KINDS = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "send")
COMM_SIZES = (4096, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
# The kinds whose calls overlap the step's compute, by device kind: their time alone x comm_scale in a step;
# every other call is waited on where it is made (Note [calibration]).
OVERLAPPED = {"cpu": (BUCKET,), "cuda": (BUCKET, "allgather", "reducescatter")}
# The kinds issued asynchronously from hooks (FSDP2's, DDP's buckets): call_s a call (Note [calibration]).
HOOKED_KINDS = ("allgather", "reducescatter", BUCKET)
CALL_CLASSES = ("hooked", "send", "other")  # the per-call terms: call_s, send_s, sync_s


def call_seconds(points: list, nbytes: float) -> float:
    """One call's seconds at `nbytes` from measured [bytes, seconds] points: the line through the two sizes
    around it; below the smallest, the smallest's time; above the largest, that line's rate carried on."""
    points = sorted(points)
    if nbytes <= points[0][0] or len(points) == 1:
        return points[0][1]
    (n0, t0), (n1, t1) = next((pair for pair in zip(points, points[1:]) if nbytes <= pair[1][0]), points[-2:])
    return t0 + (nbytes - n0) * max(0.0, (t1 - t0) / (n1 - n0))


def call_class(kind: str) -> str:
    """Which time per call a collective kind pays in a step (Note [calibration]): one of CALL_CLASSES."""
    return "hooked" if kind in HOOKED_KINDS else "send" if kind == "send" else "other"


@dataclass
class Calibration:
    """A machine's measured rates (Note [calibration]); JSON as calibration.json."""
    torch: str
    device: str  # "cpu", or the GPU's name
    world: int  # processes measured at once
    threads: int  # torch threads per process
    cores: int
    products: dict[str, float] = field(default_factory=dict)  # size class -> FLOP/s
    memory: dict[str, float] = field(default_factory=dict)  # byte class -> seconds per byte
    op_s: float = 0.0
    step_s: float = 0.0
    dtensor_op_s: float = 0.0  # what DTensor's dispatch adds to an op on DTensors (measure_dtensor_op)
    # Multipliers of the products' and memory-bound ops' microbenchmark times, fitted with op_s and step_s to
    # whole training steps (Note [calibration]): what ops cost in a step beyond what they cost alone.
    products_scale: float = 1.0
    memory_scale: float = 1.0
    fit_error: float = 0.0  # the fit's largest relative error over the reference steps
    # The multiplier of a step's op calls timed one by one (parallel.planning.replay, what prices a step on the machine
    # that measured them), fitted to the same reference steps (Note [calibration]): a step's operands are not in
    # the caches the way a call repeated alone finds them.
    replay_scale: float = 1.0
    replay_op_s: float = 0.0  # and a time per op call beyond it: autograd's and the optimizer's Python
    # The probe product's time in the process that replayed the reference steps, alone (parallel.planning.replay.probe_time):
    # the speed a plan's replayed calls are held to. 0 (a file made before it was kept): the rate of products of
    # its size class, measured with the processes all at once.
    probe_s: float = 0.0
    # Collectives inside a training step, fitted to the framework's own runs (launch/calibrate.py, Note
    # [calibration]): a factor on the measured time of those that overlap compute (OVERLAPPED) and a time per
    # call issued from hooks (FSDP2's all-gathers and reduce-scatters, DDP's bucket all-reduces).
    comm_scale: float = 1.0
    call_s: float = 0.0
    # A time per send (a pipeline's, with its schedule's work around it) and per call of every other collective
    # (waited at once: tensor parallelism's all-reduces, ZeRO-1's broadcast), fitted with them.
    send_s: float = 0.0
    sync_s: float = 0.0
    # The runs they were fitted to, as measured: [{"run", "measured_s", "predicted_s", "compute_s", "bubble_s",
    # "comm_s", "hooked", "sends", "other"}, ...] (launch/calibrate.py; none with runs=false)
    runs: list = field(default_factory=list)
    # "kind/group size" -> [[bytes, seconds of one call], ...] by size (a file with [latency s, bytes/s] loads)
    comm: dict[str, list] = field(default_factory=dict)
    made: str = ""  # how: "launch/calibrate.py" (with the date and host), or "measured at start"
    host: str = field(default_factory=platform.node)  # the machine measured

    def __post_init__(self):  # a file's [latency, bandwidth] fit: the same line, as points
        self.comm = {k: [[0, v[0]], [1 << 24, v[0] + (1 << 24) / v[1]]] if len(v) == 2 and not isinstance(v[0], list)
                     else v for k, v in self.comm.items()}

    @property
    def kind(self) -> str:
        return "cpu" if self.device == "cpu" else "cuda"

    def share(self) -> float:
        """How many threads each core runs when the measured processes all compute (1 on a GPU)."""
        return 1.0 if self.kind == "cuda" else max(1.0, self.world * self.threads / self.cores)

    def product_rate(self, size: int) -> float:
        """FLOP/s of a product of this size class: the nearest measured class (the largest above it)."""
        known = sorted((int(k), v) for k, v in self.products.items())
        below = [v for k, v in known if k <= size]
        return below[-1] if below else known[0][1]

    def memory_time(self, nbytes: int) -> float:
        """Seconds per byte of an op moving `nbytes`: the nearest measured class."""
        known = sorted((int(k), v) for k, v in self.memory.items())
        return min(known, key=lambda kv: abs(kv[0] - nbytes) / kv[0])[1]

    def comm_time(self, kind: str, group: int, calls: int, nbytes: int) -> float:
        """Seconds of `calls` calls of a collective handed `nbytes` in all, over groups of `group` ranks: each
        call's measured time at the mean size for that kind (else, a kind not measured, as DDP's buckets, the
        all-reduce's), at the nearest group size measured; in a step (Note [calibration])."""
        fits = {k: v for k, v in self.comm.items() if k.split("/")[0] == kind} or \
            {k: v for k, v in self.comm.items() if k.startswith("allreduce/")}
        if not fits or not calls:
            return 0.0
        key = min(fits, key=lambda k: (abs(int(k.split("/")[1]) - group), -int(k.split("/")[1])))
        scale = self.comm_scale if kind in OVERLAPPED[self.kind] else 1.0
        per_call = {"hooked": self.call_s, "send": self.send_s, "other": self.sync_s}[call_class(kind)]
        return calls * (call_seconds(fits[key], nbytes / calls) * scale + per_call)

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _timed(fn, device: torch.device, seconds: float, least: int = 3, batches: int = 5) -> float:
    """Seconds per call of `fn`: the median over `batches` batches, each about `seconds` / `batches` long (at
    least `least` calls), after one warm-up call; a median, so that a moment when another process takes the
    core does not move the figure."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    per_call = []
    for _ in range(batches):
        n, t0 = 0, time.perf_counter()
        while n < least or time.perf_counter() - t0 < seconds / batches:
            fn()
            n += 1
        sync()
        per_call.append((time.perf_counter() - t0) / n)
    return statistics.median(per_call)


def _fastest_alternating(fns: dict, device: torch.device, batch_s: float, rounds: int = 5,
                         least: int = 3) -> dict:
    """Seconds per call of each of `fns`, timed in turn for `rounds` rounds (batches of about `batch_s`), the
    fastest batch of each: a stretch in which another process takes the core then slows all or none, where
    timed one after the other it could slow one alone (a difference of two is what the callers take)."""
    best = {key: float("inf") for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            best[key] = min(best[key], _timed(fn, device, batch_s, least=least, batches=1))
    return best


def measure_products(device: torch.device, seconds: float = 0.1, top: int | None = None) -> dict[str, float]:
    """FLOP/s of square float32 products (bf16 on a GPU) per size class up to `top` (Note [calibration])."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    top = top or (4096 if device.type == "cuda" else 1024)
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for n in (s for s in SIZES if s <= top):
        a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        c = torch.empty(n, n, device=device, dtype=dtype)
        out[str(n)] = 2 * n ** 3 / _timed(lambda: torch.mm(a, b, out=c), device, seconds)
    return out


def measure_memory(device: torch.device, seconds: float = 0.05, top: int = MEMORY_SIZES[-1]) -> dict[str, float]:
    """Seconds per byte moved by an elementwise op of each byte class, dispatch left out (Note [calibration]):
    new outputs each time, as a step's ops make them."""
    def add_time(nbytes: int) -> float:
        n = max(1, nbytes // 12)  # two float32 inputs read, one output written
        a, b = torch.ones(n, device=device), torch.ones(n, device=device)
        # 10 calls a batch at least where a call is microseconds; 3 where it is milliseconds (the 256 MiB class:
        # about 60 ms a call here, 2.5 s of the calibration at 10)
        return _timed(lambda: torch.add(a, b), device, seconds, least=10 if nbytes <= 1 << 20 else 3)

    base = add_time(12)
    return {str(s): max(add_time(s) - base, 1e-12) / s for s in MEMORY_SIZES if s <= top}


def measure_ops(device: torch.device, seconds: float = 0.1, least: int = 3, rounds: int = 5) -> tuple[float, float]:
    """(seconds per op, seconds per step besides its ops) of a tiny training step (forward, backward, AdamW,
    gradient reset) whose ops do almost no work: the same step with 8x the ops gives the slope."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16, device=device)

    def step(depth: int):
        out = x
        for _ in range(depth):
            out = model(out)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ops = {}
    for depth in (1, 8):
        step(depth)
        with Flops() as counted:
            step(depth)
        ops[depth] = counted.ops
    # Timed one after the other, a slow stretch over the shallow step alone made the slope 0 (the suite's other
    # test process, once); alternated, a slow stretch over the shallow step's batches still did (once in a
    # suite run): an op costs something, so such a slope is measured again, up to three times.
    for _ in range(3):
        times = _fastest_alternating({d: (lambda d=d: step(d)) for d in (1, 8)}, device, seconds / (2 * rounds),
                                     rounds, least)
        if times[8] > times[1]:
            break
    per_op = max((times[8] - times[1]) / (ops[8] - ops[1]), 0.0)
    return per_op, max(times[1] - per_op * ops[1], 0.0)


def measure_dtensor_op(device: torch.device, seconds: float = 0.05) -> float:
    """Seconds DTensor's own dispatch (sharding propagation, unwrapping and wrapping) adds to an op, per op: a
    few ops a tensor-parallel step makes (an elementwise product, an addition, a matrix product, a sum) on
    sharded DTensors of 16 x 16, and AdamW's step over such a weight (the CPU's one-weight-at-a-time form,
    FSDP2's and tensor parallelism's optimizer; in-place ops with scalars, about 10 a weight), less the
    same on their local tensors. The optimizer's ops cost more than the others (13.3 us an op here, 7.6 us
    for the four alone): FSDP2's steps make mostly those. Over a mesh of every rank of the process group
    when one is initialized (every rank must call it), else of this process alone (a fake group, taken down
    after)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    own = not dist.is_initialized()
    if own:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        world = dist.get_world_size()
        x = distribute_tensor(torch.ones(16 * world, 16, device=device), mesh, [Shard(0)])
        y = distribute_tensor(torch.ones(16 * world, 16, device=device), mesh, [Shard(0)])
        w = distribute_tensor(torch.ones(16, 16, device=device), mesh, [Replicate()])

        def ops(a, b, m, opt) -> None:
            (a * b + a).mm(m).sum(dim=1)
            opt.step()

        def optimizer(weight):
            weight = torch.nn.Parameter(weight.clone())
            weight.grad = torch.ones_like(weight)
            return torch.optim.AdamW([weight], lr=1e-3, foreach=False)

        lx, ly, lw = x.to_local(), y.to_local(), w.to_local()
        opt, local_opt = optimizer(x), optimizer(lx)
        with Work() as counted:  # the ops on DTensors, as the planner counts them
            ops(x, y, w, opt)
        best = _fastest_alternating({"distributed": lambda: ops(x, y, w, opt),
                                     "local": lambda: ops(lx, ly, lw, local_opt)}, device, seconds / 5)
        return max(best["distributed"] - best["local"], 0.0) / max(1, counted.dtensor_ops)
    finally:
        if own:
            dist.destroy_process_group()


def nnls(rows: list[list[float]], target: list[float]) -> list[float]:
    """Non-negative least squares for a few unknowns: the best of the unconstrained fits over every subset
    of the unknowns whose solution is non-negative."""
    import itertools

    a, b = torch.tensor(rows, dtype=torch.float64), torch.tensor(target, dtype=torch.float64).unsqueeze(1)
    n, best, best_err = a.shape[1], [0.0] * a.shape[1], float("inf")
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sol = torch.linalg.lstsq(a[:, cols], b).solution.squeeze(1)
            if (sol < 0).any():
                continue
            err = float(((a[:, cols] @ sol.unsqueeze(1)) - b).square().sum())
            if err < best_err:
                best_err, best = err, [0.0] * n
                for c, v in zip(cols, sol.tolist()):
                    best[c] = v
    return best


def fit_steps(cal: "Calibration", samples: list[tuple[dict, float, dict]]) -> None:
    """Fit cal's products_scale, memory_scale, op_s and step_s to whole steps (relative errors, least squares,
    all non-negative), then its replay scale to what the steps take beyond step_s; the microbenchmarks'
    rates stay as measured."""
    rows, target = [], []
    for work, seconds, _ in samples:
        p = sum(f / cal.product_rate(int(s)) for s, (_, f) in work["products"].items())
        m = sum(b * cal.memory_time(int(s)) for s, (_, b) in work["memory"].items())
        rows.append([p / seconds, m / seconds, work["ops"] / seconds, 1 / seconds])
        target.append(1.0)
    cal.products_scale, cal.memory_scale, cal.op_s, cal.step_s = nnls(rows, target)
    cal.fit_error = max(abs(sum(c * x for c, x in zip((cal.products_scale, cal.memory_scale, cal.op_s, cal.step_s),
                                                       r)) - 1) for r in rows)
    if cal.kind == "cpu":  # on a GPU the reference steps are a few kernel launches each: not fitted there
        fit_replay(cal, samples)


def fit_replay(cal: "Calibration", samples: list[tuple[dict, float, dict]]) -> None:
    """cal.replay_scale and cal.replay_op_s: a step's time less step_s = replay_scale x its op calls timed one
    by one + replay_op_s x its ops (what autograd and the optimizer's Python add to each call), least squares
    of the relative error over the steps, replay_scale >= 1 and replay_op_s >= 0; left at 1 and 0 where no step
    took longer than step_s. A step's calls take at least what they take timed alone (its workers share what
    one replaying process has to itself; a free factor, 0.87-0.90 in four of five calibrations, priced the
    125M Llama's calls 10% below their own time). One factor for products and other calls alike: two came out
    1.0-1.6 and 0.6-2.0 over eight calibrations made here within an hour."""
    usable = [(seconds - cal.step_s, timed["products"] + timed["memory"], work["ops"])
              for work, seconds, timed in samples if seconds > cal.step_s and timed["products"] + timed["memory"] > 0]
    if usable:
        excess, per_op = nnls([[timed / t, ops / t] for t, timed, ops in usable],
                              [(t - timed) / t for t, timed, _ in usable])
        cal.replay_scale, cal.replay_op_s = 1.0 + excess, per_op


def _group_up() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def quick(world: int, device: torch.device | None = None) -> Calibration:
    """A calibration from this one process (Note [calibration]): what strategy=auto and launch/plan.py use
    without plan.calibration. Measured on the threads each of `world` workers will have, and scaled as if
    the workers shared the cores when they outnumber them; every collective gets the loopback bandwidth and
    no latency."""
    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    before = torch.get_num_threads()
    threads = (worker_threads(world) if device.type == "cpu" else None) or before
    torch.set_num_threads(threads)
    try:
        per_op, per_step = measure_ops(device)
        cal = Calibration(torch=torch.__version__, device=device_name(device), world=1, threads=threads,
                          # A GPU measures every class in milliseconds; with its small classes alone, its
                          # large products and copies would be priced at the launch cost of small ones.
                          cores=cores(), products=measure_products(device, seconds=0.01, top=None if cuda else 512),
                          memory=measure_memory(device, seconds=0.005, top=MEMORY_SIZES[-1] if cuda else 16 << 20),
                          op_s=per_op, step_s=per_step,
                          # in a process of a group (not where plans are made), left out: it would need the group
                          dtensor_op_s=0.0 if _group_up() else measure_dtensor_op(device, seconds=0.01),
                          made="measured at start (one process)", probe_s=probe_time(device, bursts=9) or 0.0)
    finally:
        torch.set_num_threads(before)
    alone = cal.share()
    cal.world = world
    factor = cal.share() / alone  # threads per core with `world` such processes, over this one's alone
    cal.products = {k: v / factor for k, v in cal.products.items()}
    cal.memory = {k: v * factor for k, v in cal.memory.items()}
    cal.op_s *= factor
    cal.step_s *= factor
    cal.dtensor_op_s *= factor
    bandwidth = loopback_bandwidth()
    cal.comm = {f"{k}/{world}": [[0, 0.0], [1 << 20, (1 << 20) / bandwidth]] for k in COMM_KINDS}
    return cal


def loopback_bandwidth(nbytes: int = 32 << 20) -> float:
    """Bytes/s through a local socket pair: what gloo between processes of one machine rides on."""
    left, right = socket.socketpair()
    payload, got = b"\0" * (1 << 20), [0]

    def receive():
        while got[0] < nbytes:
            chunk = right.recv(1 << 20)
            if not chunk:
                break
            got[0] += len(chunk)

    reader = threading.Thread(target=receive)
    t0 = time.perf_counter()
    reader.start()
    for _ in range(nbytes // len(payload)):
        left.sendall(payload)
    reader.join()
    elapsed = time.perf_counter() - t0
    left.close()
    right.close()
    return nbytes / elapsed
