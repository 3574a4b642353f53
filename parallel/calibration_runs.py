"""launch/calibrate.py's measurements: W processes at once, as a run's workers (Note [calibration] in
parallel/calibration.py): each measures compute and every collective, and their figures make calibration.json."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import tempfile
import time

import torch

from parallel.calibration import (
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
    measure_steps,
    nnls,
)
from parallel.hardware import worker_threads


def _fit(points: list[tuple[int, float]]) -> list[float]:
    """[latency s, bytes/s] of t = latency + bytes / bandwidth over (bytes, seconds) points, by least squares of
    the relative error (a small call's latency counts as much as a large one's bandwidth), both >= 0."""
    latency, per_byte = nnls([[1 / t, n / t] for n, t in points], [1.0] * len(points))
    return [latency, 1.0 / max(per_byte, 1e-15)]


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
                 repeats: int = 7) -> dict[str, list[tuple[int, float]]]:
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


def fit_comm(ranks: list[dict[str, list[tuple[int, float]]]]) -> dict[str, list[float]]:
    """[latency s, bytes/s] per "kind/size" from every rank's `measure_comm` points: each size's time the mean
    over the ranks, a send's over the receiving ranks (a pipeline waits on the receive; the sender hands its
    tensor off)."""
    out = {}
    for key, first in ranks[0].items():
        kind, size = key.split("/")
        timed = [r[key] for i, r in enumerate(ranks) if kind != "send" or i % int(size) % 2 == 1] or [first]
        out[key] = _fit([(n, statistics.fmean(pts[j][1] for pts in timed)) for j, (n, _) in enumerate(first)])
    return out


def fit_in_step(runs: list[tuple[float, float, float, int, int, int]]) -> tuple[float, float, float, float]:
    """(comm_scale, call_s, send_s, sync_s) of runs given as (measured step, its predicted compute and bubble,
    its collectives as measured alone, in seconds; its calls from hooks, its sends, its other calls): least
    squares of the steps' relative error, non-negative (Note [calibration]); (1, 0, 0, 0) without runs."""
    if not runs:
        return 1.0, 0.0, 0.0, 0.0
    scale, call, send, sync = nnls([[comm / step, hooked / step, sends / step, other / step]
                                    for step, _, comm, hooked, sends, other in runs],
                                   [(step - rest) / step for step, rest, *_ in runs])
    return scale, call, send, sync


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
        steps = measure_steps(device, products=products, together=dist.barrier, replay=rank == 0,
                              share=max(1.0, world * torch.get_num_threads() / cores()) if not use_cuda else 1.0,
                              workers=world)
        dtensor_op = measure_dtensor_op(device)
        dist.barrier()
        comm = measure_comm(rank, world, device) if world > 1 else {}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"products": products, "memory": memory, "steps": steps, "comm": comm,
                       "dtensor_op_s": dtensor_op,
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
                      cores=cores(), products=mean("products"), memory=mean("memory"),
                      comm=fit_comm([r["comm"] for r in ranks]),
                      dtensor_op_s=statistics.fmean(r["dtensor_op_s"] for r in ranks),
                      made=f"launch/calibrate.py on {platform.node()}, "
                           f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    # every rank's reference steps, each step's time the mean over the ranks (they ran at once); the calls
    # as rank 0 replayed them alone
    fit_steps(cal, [(work, statistics.fmean(r["steps"][i][1] for r in ranks), timed)
                    for i, (work, _, timed) in enumerate(ranks[0]["steps"])])
    return cal
