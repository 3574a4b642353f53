"""What a run takes from the world outside its configuration, passed down from `build_run` to the strategies.

# Note [runtime]
A strategy builds this rank's engine from the model, the mesh and the config;
everything else it needs from outside (the device; how ranks agree on a value;
whether stage shapes are known up front; threads; how a model is replicated by
DDP; the offload tiers' I/O; what validation read from the data) comes in through one `Runtime`. A worker uses the
defaults, which are the real things. The planner (parallel.planning.planner) runs the
same code on fake tensors and a fake process group, where values cannot be read,
exchanged or written to disk, and passes stand-ins instead: nothing of the
project is patched at run time, so a rename cannot silently break planning.
Fields that default to None mean "the real one", chosen by the code that uses it
(this module sits at the bottom and imports none of it).
"""
from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


def agree_with_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (a no-op on one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Runtime:
    """See Note [runtime].

    Attributes:
        device: this rank's compute device.
        agree: returns rank 0's value on every rank (a pipeline split chosen by rank 0).
        static_shapes: pipeline stages are given their boundary shapes up front instead of
            inferring them at the first step (which exchanges values between ranks).
        time_blocks: the pipeline balancer may time blocks on real copies; False weighs them by FLOPs.
        executor: makes the thread pools a strategy runs work on (`executor(max_workers, name)`).
        replicate: DDP's `replicate(model, device_mesh=...)`; None: torch's.
        check_disk: check that the offload directory has room before writing to it.
        offload_io: stand-ins for offload's disk tier and activation store (see
            parallel.strategies.offload.engine); None: the real ones.
        values: where every tensor's initial value comes from (a parallel.init.values.Values; Note
            [initial values]); None: by name from trainer.seed (parallel.init.values.ByName).
        compile: trainer.compile may compile the blocks; the planner plans the eager run (Note [regional
            compilation] in parallel/strategies/compile.py).
        target: the device the run is for, when the step runs on another: the planner's CPU plan of a CUDA
            run (Note [planning for CUDA] in parallel/planning/cuda.py), whose offload tiers are chosen as under a
            GPU; None: `device`.
        run_dir: the run directory, the same on every rank: rank 0 hands the model's own initial values over
            in a file there (Note [initial values]) and offload keeps its disk tier there unless strategy.path
            says otherwise; None: no directory (values by name; a strategy that needs one says so).
        data: what validation read from the data (a parallel.data.spec.DataSpec: data=custom's fields, Note
            [data spec]), which the data source and the example inputs are shaped by; None: nothing read
            (synthetic data, shards).
        reuse_traces: a pipeline split traced before in this process, of the same model cut at the same blocks,
            is handed out again as a copy (the planner's roles: Note [a traced split, once] in
            parallel/strategies/pipeline/split.py); False: traced anew.
    """

    device: torch.device = torch.device("cpu")
    agree: Callable[[Any], Any] = agree_with_rank0
    static_shapes: bool = False
    time_blocks: bool = True
    executor: Callable[[int, str], Executor] = lambda workers, name: ThreadPoolExecutor(  # noqa: E731
        max_workers=workers, thread_name_prefix=name)
    replicate: Callable[..., Any] | None = None
    check_disk: bool = True
    offload_io: Any = None
    values: Any = None
    compile: bool = True
    target: torch.device | None = None
    run_dir: Path | None = None
    data: Any = None
    reuse_traces: bool = False
