"""Profiles of a run: torch.profiler over a range of steps, the framework's phases named in them, and CUDA
memory snapshots.

# Note [profiles]
`trainer.profile=[START,END]` runs torch.profiler on every rank from the start
of step START to the end of step END and writes its Chrome trace to
`<run_dir>/profile/rank<N>.json` (Perfetto and TensorBoard's profile plugin
read it). Outside that range no profiler runs; a run resumed inside it profiles
the rest. Each profiled step is marked `ProfilerStep#<step>`, the name
torch.profiler's own step markers have (tools that split a trace into steps
look for it), with the trainer's step number. Profiled steps run slower (the
profiler's own cost; writing the trace at the end of END): their step_time_s
shows it, and the pipeline timeline draws another step when it can.

The framework names its own phases with `phase(name)`: the trainer's (data,
forward_backward, clip, optimizer_step, evaluation, checkpoint_save and _load,
save_final: `run_phase`, which an out-of-memory line reads), each pipeline stage's
chunks (stage<i> forward|backward|backward_weight mb<k>), the offload engine's
transfers and waits. `phase` is a no-op unless this process is profiling: an
idle `record_function` still costs about 10 us, which a pipeline pays per chunk.
The profiler records every thread (torch's experimental `profile_all_threads`),
so the offload engine's I/O and step threads appear beside the main one.
PyTorch names the rest itself: the optimizer's step (`Optimizer.step#AdamW.step`),
collectives (`gloo:all_reduce`, `nccl:...`, FSDP's `FSDP::...`), the pipeline's
sends and receives, and every op.

`trainer.memory_snapshot=true` records the CUDA caching allocator's history
from the start of the training loop (`torch.cuda.memory._record_memory_history`)
and dumps it to `<run_dir>/memory_snapshot/rank<N>.pickle` when a step runs out
of memory (an evaluation or a checkpoint too: the out-of-memory line names it,
Note [out of memory] in parallel/memory/oom.py) and at the end;
https://pytorch.org/memory_viz reads it. What was
allocated before the loop (the weights) is in the snapshot's segments, without
the stack that allocated it. The CPU keeps no such history: a warning, and
nothing is recorded.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, record_function

from parallel.config import TrainerConfig, fail

log = logging.getLogger("parallel")

_profiling = False  # whether this process's profiler runs now (read by `phase`, set by StepProfiler)
_dumped_on_oom: Path | None = None  # the snapshot a step that ran out of memory dumped (`snapshot_after_oom`)


def active() -> bool:
    """Whether this process is recording a profile now (its steps run slower)."""
    return _profiling


def phase(name: str):
    """A context naming a phase of the run in the profile (Note [profiles]); does nothing when not profiling."""
    return record_function(name) if _profiling else contextlib.nullcontext()


@contextlib.contextmanager
def run_phase(name: str, step: int | None = None):
    """One of the run's own phases (a step's data, forward_backward, clip and optimizer_step; an evaluation;
    a checkpoint's save or load; the final weights' save), of training step `step` when it has one: named in
    a profile as `phase` names it, and in any exception raised inside it, innermost first (`raised_in`),
    which the out-of-memory line reads (Note [out of memory] in parallel/memory/oom.py). Nothing is kept
    while nothing is raised."""
    try:
        with phase(name):
            yield
    except BaseException as e:
        e.__dict__.setdefault("run_phases", []).append((name, step))
        raise


def raised_in(chain: list[BaseException]) -> tuple[list[str], int | None]:
    """The run phases an error was raised in (innermost first) and its training step (None: outside a step's
    phases), read from the first error of `chain` (an error and those it wraps) that `run_phase` marked."""
    marked = next((e.__dict__["run_phases"] for e in chain if "run_phases" in getattr(e, "__dict__", {})), [])
    return [name for name, _ in marked], next((step for _, step in marked if step is not None), None)


def phased(name: str):
    """Decorator: every call of the function is the phase `name`."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)
        return call
    return wrap


def check_profile(t: TrainerConfig) -> None:
    """`trainer.profile`: None, or two steps [START, END] with 1 <= START <= END <= trainer.steps."""
    r = t.profile
    if r is None:
        return
    valid = f"[START, END] with 1 <= START <= END <= trainer.steps ({t.steps}), or null"
    if len(r) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in r):
        fail("trainer.profile", list(r), "must be two steps [START, END]", valid)
    if r[0] > r[1]:
        fail("trainer.profile", list(r), "the range is reversed (START > END)", valid)
    if r[0] < 1 or r[1] > t.steps:
        fail("trainer.profile", list(r), f"outside the run's steps 1..{t.steps}", valid)


class StepProfiler:
    """torch.profiler over steps `first`..`last` of this rank, its Chrome trace written to `path`."""

    def __init__(self, first: int, last: int, path: Path, device: torch.device):
        self.first, self.last, self.path, self.device = first, last, path, device
        self.prof: torch.profiler.profile | None = None
        self.done = False  # the trace is written

    @contextlib.contextmanager
    def step(self, step: int):
        if self.prof is None and not self.done and self.first <= step <= self.last:  # a resumed run may start inside
            self._start()
        if self.prof is None:
            yield
            return
        try:
            with record_function(f"ProfilerStep#{step}"):
                yield
        except BaseException:
            self.stop()  # what was recorded up to the failure
            raise
        if step == self.last:
            self.stop()

    def _start(self) -> None:
        global _profiling
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
        self.prof = torch.profiler.profile(activities=activities, experimental_config=config)
        self.prof.start()
        _profiling = True

    def stop(self) -> None:
        """Stop and write the trace (also when the run ends inside the range)."""
        global _profiling
        if self.prof is None:
            return
        _profiling = False
        prof, self.prof, self.done = self.prof, None, True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels, finished before the trace is taken
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        log.info("profile of steps %d..%d: %s", self.first, self.last, self.path)


def snapshot_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "memory_snapshot" / f"rank{rank}.pickle"


class MemorySnapshot:
    """The CUDA caching allocator's history, dumped to `path` (CUDA only: Note [profiles])."""

    def __init__(self, path: Path):
        self.path = path
        # Up to this many allocation events are kept (the newest); each carries its Python and C++ stack.
        torch.cuda.memory._record_memory_history(max_entries=100_000)

    def dump(self) -> None:
        _dump_snapshot(self.path)

    def close(self) -> None:
        self.dump()
        torch.cuda.memory._record_memory_history(enabled=None)


class Profiling:
    """What `trainer.profile` and `trainer.memory_snapshot` ask of a run; the trainer enters `step(k)` around
    each step and calls `close()` at the end."""

    def __init__(self, t: TrainerConfig, run_dir: Path, device: torch.device):
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.profiler = StepProfiler(*t.profile, run_dir / "profile" / f"rank{rank}.json", device) \
            if t.profile else None
        self.snapshot = None
        if t.memory_snapshot and device.type == "cuda":
            self.snapshot = MemorySnapshot(snapshot_path(run_dir, rank))
        elif t.memory_snapshot:
            log.warning("trainer.memory_snapshot=true: the CUDA allocator's history; this run is on the %s, "
                        "nothing is recorded", device.type)

    @contextlib.contextmanager
    def step(self, step: int):
        try:
            with self.profiler.step(step) if self.profiler else contextlib.nullcontext():
                yield
        except torch.cuda.OutOfMemoryError:
            if self.snapshot is not None:
                self.snapshot.close()  # the history up to the failed allocation
                global _dumped_on_oom
                _dumped_on_oom, self.snapshot = self.snapshot.path, None
            raise

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        if self.snapshot is not None:
            self.snapshot.close()


def _dump_snapshot(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    log.info("memory snapshot: %s", path)


def snapshot_after_oom(t: TrainerConfig, run_dir: Path, device: torch.device, rank: int) -> Path | None:
    """The memory snapshot of an out-of-memory (Note [out of memory] in parallel/memory/oom.py): the one the
    failed step dumped (`Profiling.step`), else one dumped now (an OOM outside a step: an evaluation, a
    checkpoint); None without trainer.memory_snapshot=true on CUDA."""
    if not (t.memory_snapshot and device.type == "cuda"):
        return None
    if _dumped_on_oom is not None:
        return _dumped_on_oom
    path = snapshot_path(run_dir, rank)
    _dump_snapshot(path)
    return path
