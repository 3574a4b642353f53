"""What one machine does per unit of work, measured as a run's workers would see it: calibration.json.

# Note [calibration]
parallel.cost prices a planned step's work (Note [step work]) with rates
measured on the machine that will run it. `python launch/calibrate.py
nproc=W` starts W processes, as a run of W workers does (each with the
threads a worker gets, parallel.hardware.worker_threads, all on the cores at
once, so the cores they share are in every figure), and each measures:

    products   FLOP/s of square matrix products of each size class, 16 up
               to 1024 on a CPU (4096 on a GPU); a larger class takes the
               largest measured rate
    memory     seconds per byte of an elementwise op (read two, write one, a
               new output each call) of each byte class, 4 KiB to 256 MiB by
               16x, less the time of the smallest such op (its dispatch)
    steps      8 reference training steps (plain torch MLPs and a small
               transformer; forward, backward, clipping, AdamW) and their
               work: products_scale, memory_scale (what ops cost in a step
               beyond what they cost alone: caches, new allocations,
               GELU's arithmetic), op_s (per op) and step_s (per step) fitted
               to them, least squares of the relative error, non-negative
    comm       for each collective kind (all-reduce, all-gather,
               reduce-scatter, all-to-all, broadcast, send) and each group
               size dividing W: the time of one call at 4 KiB ... 16 MiB,
               fitted as latency + bytes / bandwidth (least squares of the
               relative error over the sizes, each the median of its
               repeats); gloo on a CPU, NCCL on GPUs

    in a step  two runs of the framework itself on W workers (the built-in
               MLP, hidden 512, depth 6, 64 samples a worker, data zero 0
               and zero 3) against their plans priced with the rates above:
               their excess over the predicted compute is fitted as
               comm_scale x the predicted collectives + call_s x the
               all-gathers and reduce-scatters (the calls FSDP2 issues
               asynchronously from its hooks), least squares, non-negative.
               On a CPU the workers' threads take every core, and a
               collective's own thread waits for one.

Rates are the mean over the W processes. The file records what it was made
with (torch's version, the device, W, threads per process, cores), and a plan
that differs is told which (parallel.cost.load). Without a file, strategy=auto
and launch/plan.py measure the process they run in (`quick`): products and
memory-bound ops on the threads a worker will have, op_s and step_s from a
tiny step (its ops do almost no work), scaled by how many workers share each
core, and the loopback bandwidth for every collective (no latency). On the
machine that runs it, parallel.cost times the plan's own op calls instead of
pricing them by class (Note [cost model]).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from parallel.flops import Flops  # the per-op count the planner makes
from parallel.hardware import worker_threads
from parallel.plan_work import MEMORY_SIZES, SIZES, Work

COMM_KINDS = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "send")
COMM_SIZES = (4096, 64 << 10, 1 << 20, 16 << 20)
# The kinds a sharded data-parallel step issues asynchronously from hooks (FSDP2's gathers and reduce-scatters):
# each call costs call_s besides its transfer (Note [calibration]).
HOOKED_KINDS = ("allgather", "reducescatter")


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
    # Multipliers of the products' and memory-bound ops' microbenchmark times, fitted with op_s and step_s to
    # whole training steps (Note [calibration]): what ops cost in a step beyond what they cost alone.
    products_scale: float = 1.0
    memory_scale: float = 1.0
    fit_error: float = 0.0  # the fit's largest relative error over the reference steps
    # Collectives inside a training step, fitted to the framework's own runs (launch/calibrate.py, Note
    # [calibration]): a factor on their measured time (the workers' threads take the cores the collectives'
    # own threads need) and a time per all-gather and reduce-scatter (FSDP2's: async hand-offs, its hooks).
    comm_scale: float = 1.0
    call_s: float = 0.0
    comm: dict[str, list[float]] = field(default_factory=dict)  # "kind/group size" -> [latency s, bytes/s]
    made: str = ""  # how: "launch/calibrate.py" (with the date and host), or "measured at start"
    host: str = field(default_factory=platform.node)  # the machine measured

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
        """Seconds of `calls` calls of a collective handed `nbytes` in all, over groups of `group` ranks: the
        fit for that kind and size, else the nearest group size measured, else the all-reduce's."""
        fits = {k: v for k, v in self.comm.items() if k.split("/")[0] == kind} or \
            {k: v for k, v in self.comm.items() if k.startswith("allreduce/")}
        if not fits:
            return 0.0
        key = min(fits, key=lambda k: (abs(int(k.split("/")[1]) - group), -int(k.split("/")[1])))
        latency, bandwidth = fits[key]
        hooked = calls if kind in HOOKED_KINDS else 0
        return (calls * latency + nbytes / bandwidth) * self.comm_scale + hooked * self.call_s

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
        return _timed(lambda: torch.add(a, b), device, seconds, least=10)

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
    # The two depths in alternation, the fastest batch of each: a stretch in which another process takes the
    # core then slows both or neither. Timed one after the other, a slow stretch over the shallow step alone
    # made the slope 0 (the suite's other test process, once).
    times = {1: float("inf"), 8: float("inf")}
    for _ in range(rounds):
        for depth in (1, 8):
            times[depth] = min(times[depth], _timed(lambda d=depth: step(d), device, seconds / (2 * rounds),
                                                    least=least, batches=1))
    per_op = max((times[8] - times[1]) / (ops[8] - ops[1]), 0.0)
    return per_op, max(times[1] - per_op * ops[1], 0.0)


def _reference(kind: str, width: int, depth: int, batch: int, device: torch.device):
    """A reference training step (forward, backward, clipping, AdamW, gradient reset) of a plain torch model:
    an MLP (matrix products, GELU) or a small pre-norm transformer (attention, layer norms, softmax)."""
    torch.manual_seed(0)
    if kind == "mlp":
        layers = [nn.Linear(32, width), nn.GELU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        model = nn.Sequential(*layers, nn.Linear(width, 4)).to(device)
        x, y = torch.randn(batch, 32, device=device), torch.randn(batch, 4, device=device)
    else:
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, depth, enable_nested_tensor=False),
                              nn.Linear(width, 4)).to(device)
        x, y = torch.randn(batch, 32, width, device=device), torch.randn(batch, 32, 4, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


# The reference steps the compute terms are fitted to: (kind, width, depth, batch), from dispatch-bound to
# product-bound and memory-bound (the optimizer's step over many weights).
REFERENCES = (("mlp", 16, 2, 4), ("mlp", 64, 8, 16), ("mlp", 256, 4, 64), ("mlp", 512, 4, 16),
              ("mlp", 512, 2, 512), ("mlp", 1024, 2, 32), ("transformer", 64, 2, 8), ("transformer", 128, 2, 16))


def measure_steps(device: torch.device, references=REFERENCES, seconds: float = 0.3) -> list[tuple[dict, float]]:
    """(the work of one step, Note [step work]; its measured seconds) for each reference step."""
    out = []
    for ref in references:
        step = _reference(*ref, device)
        step()
        with Work() as work:
            step()
        out.append((work.as_dict(), _timed(step, device, seconds, least=3, batches=3)))
    return out


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


def fit_steps(cal: "Calibration", samples: list[tuple[dict, float]]) -> None:
    """Fit cal's products_scale, memory_scale, op_s and step_s to whole steps (relative errors, least squares,
    all non-negative); the microbenchmarks' rates stay as measured."""
    rows, target = [], []
    for work, seconds in samples:
        p = sum(f / cal.product_rate(int(s)) for s, (_, f) in work["products"].items())
        m = sum(b * cal.memory_time(int(s)) for s, (_, b) in work["memory"].items())
        rows.append([p / seconds, m / seconds, work["ops"] / seconds, 1 / seconds])
        target.append(1.0)
    cal.products_scale, cal.memory_scale, cal.op_s, cal.step_s = nnls(rows, target)
    cal.fit_error = max(abs(sum(c * x for c, x in zip((cal.products_scale, cal.memory_scale, cal.op_s, cal.step_s),
                                                       r)) - 1) for r in rows)


def _fit(points: list[tuple[int, float]]) -> list[float]:
    """[latency s, bytes/s] of t = latency + bytes / bandwidth over (bytes, seconds) points, by least squares of
    the relative error (a small call's latency counts as much as a large one's bandwidth), both >= 0."""
    latency, per_byte = nnls([[1 / t, n / t] for n, t in points], [1.0] * len(points))
    return [latency, 1.0 / max(per_byte, 1e-15)]


def measure_comm(rank: int, world: int, device: torch.device, repeats: int = 5) -> dict[str, list[float]]:
    """Every collective kind on groups of each size dividing `world` (consecutive ranks), fitted per kind and
    size (Note [calibration]); called by every rank of an initialized process group, rank 0's result is
    the one kept (all ranks take part in every call)."""
    import torch.distributed as dist

    out = {}
    for size in (s for s in range(2, world + 1) if world % s == 0):
        groups = [dist.new_group(list(range(g, g + size))) for g in range(0, world, size)]
        group = groups[rank // size]
        me = rank % size
        points: dict[str, list[tuple[int, float]]] = {k: [] for k in COMM_KINDS}
        for nbytes in COMM_SIZES:
            n = nbytes // 4
            x = torch.ones(n, device=device)
            gathered = torch.empty(n * size, device=device)
            scattered = torch.empty(max(1, n // size), device=device)
            calls = {
                "allreduce": lambda: dist.all_reduce(x, group=group),
                "allgather": lambda: dist.all_gather_into_tensor(gathered, x, group=group),
                "reducescatter": lambda: dist.reduce_scatter_tensor(scattered, x[:scattered.numel() * size],
                                                                    group=group),
                "alltoall": lambda: dist.all_to_all_single(torch.empty_like(x[:n - n % size]),
                                                           x[:n - n % size], group=group),
                "broadcast": lambda: dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group),
                "send": lambda: _send_pair(x, me, group),
            }
            for kind in COMM_KINDS:
                dist.barrier()
                samples = []
                for _ in range(repeats + 1):
                    dist.barrier(group=group)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    calls[kind]()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    samples.append(time.perf_counter() - t0)
                points[kind].append((nbytes, statistics.median(samples[1:])))
        for kind, pts in points.items():
            out[f"{kind}/{size}"] = _fit(pts)
    return out


def _send_pair(x: torch.Tensor, me: int, group) -> None:
    """Rank 2i sends to 2i+1 in the group (a pipeline's hop); the time is the receiver's."""
    import torch.distributed as dist

    peer = me + 1 if me % 2 == 0 else me - 1
    if peer >= group.size():
        return
    if me % 2 == 0:
        dist.send(x, group_dst=peer, group=group)
    else:
        dist.recv(x, group_src=peer, group=group)


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
                          op_s=per_op,
                          step_s=per_step, made="measured at start (one process)")
    finally:
        torch.set_num_threads(before)
    alone = cal.share()
    cal.world = world
    factor = cal.share() / alone  # threads per core with `world` such processes, over this one's alone
    cal.products = {k: v / factor for k, v in cal.products.items()}
    cal.memory = {k: v * factor for k, v in cal.memory.items()}
    cal.op_s *= factor
    cal.step_s *= factor
    bandwidth = loopback_bandwidth()
    cal.comm = {f"{k}/{world}": [0.0, bandwidth] for k in COMM_KINDS}
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


def _worker(rank: int, world: int, store_path: str, out_dir: str, use_cuda: bool) -> None:
    """One measuring process of launch/calibrate.py: compute first (all processes at once), then the
    collectives; each writes its figures to `out_dir`/rank<R>.json."""
    import torch.distributed as dist

    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    elif threads := worker_threads(world):  # as a run's workers (parallel.launcher)
        torch.set_num_threads(threads)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, device_id=device if use_cuda else None)
    try:
        dist.barrier()
        products = measure_products(device)
        memory = measure_memory(device)
        steps = measure_steps(device)
        dist.barrier()
        comm = measure_comm(rank, world, device) if world > 1 else {}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"products": products, "memory": memory, "steps": steps, "comm": comm,
                       "threads": torch.get_num_threads(), "device": device_name(device)}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def calibrate(world: int, use_cuda: bool) -> Calibration:
    """Measure this machine with `world` processes at once (launch/calibrate.py, Note [calibration])."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, use_cuda), nprocs=world,
                           start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))

    def mean(key: str) -> dict[str, float]:
        return {k: statistics.fmean(r[key][k] for r in ranks) for k in ranks[0][key]}

    cal = Calibration(torch=torch.__version__, device=ranks[0]["device"], world=world, threads=ranks[0]["threads"],
                      cores=cores(), products=mean("products"), memory=mean("memory"), comm=ranks[0]["comm"],
                      made=f"launch/calibrate.py on {platform.node()}, "
                           f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    # every rank's reference steps, each step's time the mean over the ranks (they ran at once)
    fit_steps(cal, [(work, statistics.fmean(r["steps"][i][1] for r in ranks))
                    for i, (work, _) in enumerate(ranks[0]["steps"])])
    return cal
