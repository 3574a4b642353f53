"""launch/calibrate.py's measurements: W processes at once, as a run's workers (Note [calibration] in
parallel/planning/calibration.py): each measures compute and every collective, and their figures make calibration.json."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import tempfile
import time

import torch
from torch import nn

from parallel.hardware import worker_threads
from parallel.memory.host import steady_host_allocations
from parallel.planning.calibration import (
    COMM_KINDS,
    COMM_SIZES,
    Calibration,
    _timed,
    cores,
    device_name,
    fit_steps,
    measure_dtensor_op,
    measure_memory,
    measure_products,
    nnls,
)
from parallel.planning.replay import Replay, probe_time
from parallel.planning.work import Work


def _burst(device: torch.device, seconds: float = 3e-4):
    """A computation of about `seconds` (products of 128 x 128): what a step does between two collectives."""
    a = torch.ones(128, 128, device=device)
    one = _timed(lambda: a @ a, device, 0.01, batches=3)
    repeats = max(1, round(seconds / one))

    def burst() -> None:
        for _ in range(repeats):
            a @ a

    return burst


def measure_comm(rank: int, world: int, device: torch.device,
                 repeats: int = 15) -> dict[str, list[tuple[int, float]]]:
    """Every collective kind on groups of each size dividing `world` (consecutive ranks): "kind/size" ->
    [(bytes, seconds of one call: the median of `repeats`)] at each of COMM_SIZES, as this rank saw them
    (`fit_comm` fits them over the ranks); called by every rank of an initialized process group.

    On a CPU each call follows a short computation on every rank, as in a step, and its time is what the
    rank spends in it: the hand-off to the backend's threads, their wake-ups on cores the computation
    holds, and the peers arriving a little apart are in it (two processes here: a 4 KiB gloo all-reduce
    0.46-0.52 ms after a barrier, 0.47-0.87 ms after a computation; 224 KB ones each after 1.4 ms of
    products, 1.9-2.3 ms). On a GPU each call starts after a barrier, the device synchronized around it."""
    import torch.distributed as dist

    cuda = device.type == "cuda"
    # the names of torch 2.13 on (the older ones warn there), else those before
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    burst = None if cuda else _burst(device)
    out = {}
    for size in (s for s in range(2, world + 1) if world % s == 0):
        groups = [dist.new_group(list(range(g, g + size))) for g in range(0, world, size)]
        group = groups[rank // size]
        me = rank % size
        points: dict[str, list[tuple[int, float]]] = {k: [] for k in COMM_KINDS}
        for nbytes in COMM_SIZES:
            n = nbytes // 4
            x = torch.ones(n, device=device)
            # each output new, as the framework's are (FSDP2's, ZeRO-1's receivers', an all-to-all's): on a CPU
            # its pages are touched first by the call (Note [calibration]); an all-reduce works in place
            calls = {
                "allreduce": lambda: dist.all_reduce(x, group=group),
                "allgather": lambda: gather(torch.empty(n * size, device=device), x, group=group),
                "reducescatter": lambda: scatter(torch.empty(max(1, n // size), device=device),
                                                      x[:max(1, n // size) * size], group=group),
                "alltoall": lambda: dist.all_to_all_single(torch.empty_like(x[:n - n % size]),
                                                           x[:n - n % size], group=group),
                "broadcast": lambda: dist.broadcast(x if me == 0 else torch.empty_like(x),
                                                    src=dist.get_global_rank(group, 0), group=group),
                "send": lambda: _send_pair(x, me, group),
            }
            for kind in COMM_KINDS:
                dist.barrier()
                samples = []
                # calls of 16 MiB and more take tens of milliseconds and move less from call to call: 3 of them
                for _ in range((repeats if nbytes < 16 << 20 else min(repeats, 3)) + 1):
                    if cuda:
                        dist.barrier(group=group)
                        torch.cuda.synchronize(device)
                    else:
                        burst()
                    t0 = time.perf_counter()
                    calls[kind]()
                    if cuda:
                        torch.cuda.synchronize(device)
                    samples.append(time.perf_counter() - t0)
                points[kind].append((nbytes, statistics.median(samples[1:])))
        out |= {f"{kind}/{size}": pts for kind, pts in points.items()}
    return out


def fit_comm(ranks: list[dict[str, list[tuple[int, float]]]]) -> dict[str, list[list[float]]]:
    """[[bytes, seconds of one call], ...] per "kind/size" from every rank's `measure_comm` points: each size's
    time the mean over the ranks, a send's over the receiving ranks (a pipeline waits on the receive; the
    sender hands its tensor off), and no longer than any larger size's: a call of fewer bytes does no more,
    and a slow stretch at one small size (the backend's threads woken late on cores the computation holds)
    would be charged to every call of a step near that size (two processes here: an all-reduce of 64 KiB
    at 3.35 ms where 1 MiB took 0.95 ms, in one of three calibrations made within two minutes; 0.48 and
    0.78 ms in the other two)."""
    out = {}
    for key, first in ranks[0].items():
        kind, size = key.split("/")
        timed = [r[key] for i, r in enumerate(ranks) if kind != "send" or i % int(size) % 2 == 1] or [first]
        points = sorted([n, statistics.fmean(pts[j][1] for pts in timed)] for j, (n, _) in enumerate(first))
        for j in range(len(points) - 2, -1, -1):
            points[j][1] = min(points[j][1], points[j + 1][1])
        out[key] = points
    return out


def fit_in_step(runs: list[tuple[float, float, float, float, int, int, int]],
                overlap: bool = True) -> tuple[float, float, float, float]:
    """(comm_scale, call_s, send_s, sync_s) of runs given as (measured step, its predicted compute and bubble,
    its overlapped collectives as measured alone, its waited ones so, in seconds; its calls from hooks, its
    sends, its other calls): least squares of the steps' relative error, non-negative (Note [calibration]);
    (1, 0, 0, 0) without runs. `overlap` false (a CPU the workers fill): comm_scale 1, not fitted."""
    if not runs:
        return 1.0, 0.0, 0.0, 0.0
    if not overlap:
        call, send, sync = nnls([[hooked / step, sends / step, other / step]
                                 for step, _, _, _, hooked, sends, other in runs],
                                [(step - rest - waited - overlapped) / step
                                 for step, rest, overlapped, waited, *_ in runs])
        return 1.0, call, send, sync
    scale, call, send, sync = nnls([[overlapped / step, hooked / step, sends / step, other / step]
                                    for step, _, overlapped, _, hooked, sends, other in runs],
                                   [(step - rest - waited) / step for step, rest, _, waited, *_ in runs])
    return scale, call, send, sync


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

    def resident() -> int:  # the bytes a step keeps touching: weights, their gradients, AdamW's state, the batch
        weights = sum(p.nbytes for p in model.parameters())
        state = sum(t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        return 2 * weights + state + x.nbytes + y.nbytes

    step.resident = resident
    return step


# The reference steps the compute terms are fitted to: (kind, width, depth, batch), from dispatch-bound to
# product-bound and memory-bound (the optimizer's step over many weights), the last beyond a 32 MiB cache.
REFERENCES = (("mlp", 16, 2, 4), ("mlp", 64, 8, 16), ("mlp", 256, 4, 64), ("mlp", 512, 4, 16),
              ("mlp", 512, 2, 512), ("mlp", 1024, 2, 32), ("transformer", 64, 2, 8), ("transformer", 128, 2, 16),
              ("mlp", 1024, 6, 64))


def measure_steps(device: torch.device, references=REFERENCES, seconds: float = 0.3, together=lambda: None,
                  replay: bool = True, workers: int = 1,
                  probe_s: float | None = None) -> tuple[list[tuple[dict, float, dict | None]], float | None]:
    """(the work of one step, Note [step work]; its measured seconds; its op calls timed one by one,
    parallel.planning.replay: {"products", "memory"} seconds, None where `replay` is false) for each reference step, and
    the probe product's time the calls were held to (`probe_s`, else measured now; None where not replayed or
    off the CPU). `together`: called before each step is timed and around the replays (launch/calibrate.py's
    processes: a barrier, so that each times its steps while the others time theirs, as a run's workers step
    together; then one process times the probe and replays the steps alone, as launch/plan.py replays a plan's
    calls, while the others wait); `workers`: the processes whose steps share this machine's caches (each call
    replayed over operands spanning their bytes, as parallel.planning.cost replays a plan's).

    The probe is this process's own, alone: the rate of products measured with every process at once (what held
    the calls before) came out 80.0 GFLOP/s at 128 in one of ten calibrations here and 94-96 in the others; the
    calls held to it were priced about 1.19x slow, and the gpt of benchmarks/auto.py up to 18% above its runs."""
    out = []
    for ref in references:
        step = _reference(*ref, device)
        step()
        with Work() as work:
            step()
        together()
        out.append((work, _timed(step, device, seconds, least=3, batches=3), step.resident() * workers))
    together()
    probe = (probe_s or probe_time(device, bursts=9)) if replay else None
    player = Replay(device, probe_s=probe) if replay else None
    timed = [player.price(work.calls, None, span=span) if player else None for work, _, span in out]
    together()
    return [(work.as_dict(), measured, t) for (work, measured, _), t in zip(out, timed)], probe


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


def _worker(rank: int, world: int, store_path: str, out_dir: str, use_cuda: bool, rounds: int = 3) -> None:
    """One measuring process of launch/calibrate.py: compute first (all processes at once), then the
    collectives; each writes its figures to `out_dir`/rank<R>.json."""
    import torch.distributed as dist

    # as a run's workers step (Note [host allocations]), before anything is allocated
    steady_host_allocations(keep_large=not use_cuda)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    elif threads := worker_threads(world):  # as a run's workers (parallel.launcher)
        torch.set_num_threads(threads)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, device_id=device if use_cuda else None)
    try:
        dist.barrier()
        # the reference steps `rounds` times (3 by default), seconds apart, between the other measurements (a
        # few seconds of steps can find the machine a fifth faster or slower than the next few; Note
        # [calibration])
        def again() -> list:
            return measure_steps(device, together=dist.barrier, replay=rank == 0, workers=world, probe_s=probe)[0]

        products = measure_products(device)
        steps, probe = measure_steps(device, together=dist.barrier, replay=rank == 0, workers=world)
        memory = measure_memory(device)
        steps += again() if rounds > 1 else []
        dtensor_op = measure_dtensor_op(device)
        dist.barrier()
        comm = measure_comm(rank, world, device) if world > 1 else {}
        for _ in range(rounds - 2):
            steps += again()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"products": products, "memory": memory, "steps": steps, "probe_s": probe, "comm": comm,
                       "dtensor_op_s": dtensor_op,
                       "threads": torch.get_num_threads(), "device": device_name(device)}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def calibrate(world: int, use_cuda: bool, rounds: int = 3) -> Calibration:
    """Measure this machine with `world` processes at once (launch/calibrate.py, Note [calibration]), the
    reference steps `rounds` times."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, use_cuda, rounds), nprocs=world,
                           start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))

    def mean(key: str) -> dict[str, float]:
        return {k: statistics.fmean(r[key][k] for r in ranks) for k in ranks[0][key]}

    cal = Calibration(torch=torch.__version__, device=ranks[0]["device"], world=world, threads=ranks[0]["threads"],
                      cores=cores(), products=mean("products"), memory=mean("memory"),
                      comm=fit_comm([r["comm"] for r in ranks]),
                      dtensor_op_s=statistics.fmean(r["dtensor_op_s"] for r in ranks),
                      probe_s=ranks[0]["probe_s"] or 0.0,
                      made=f"launch/calibrate.py on {platform.node()}, "
                           f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    # every rank's reference steps, each step's time the mean over the ranks (they ran at once); the calls
    # as rank 0 replayed them alone
    fit_steps(cal, [(work, statistics.fmean(r["steps"][i][1] for r in ranks), timed)
                    for i, (work, _, timed) in enumerate(ranks[0]["steps"])])
    return cal
