"""What a run reports: TensorBoard events, metrics.jsonl, peak memory, a progress bar.

Only the rank that holds the loss writes TensorBoard and metrics.jsonl; every
rank's peak memory is gathered to it at each logged step. Other ranks write
their messages to logs/rank<N>.log in the run directory.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import resource
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from parallel.memory.tracker import LiveTensorBytes, state_tensors

log = logging.getLogger("parallel")
PICTURE_EVERY_S = 60.0  # Note [pictures]


def setup_logging(run_dir: Path, rank: int) -> None:
    """Rank 0 logs to the console and logs/rank0.log; other ranks to their own file only."""
    # tqdm's default lock holds a multiprocessing semaphore; a worker started by spawn (a GPU run, torchrun)
    # that a signal ends leaves it behind: "resource_tracker: ... leaked semaphore objects" at shutdown. A
    # worker's bar and lines are its own, so a thread lock serves.
    tqdm.set_lock(threading.RLock())
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(message)s"))
    log.addHandler(handler)
    console_on(rank == 0)


def console_on(enabled: bool) -> None:
    """Give the console to the rank that logs the loss (it may not be rank 0, e.g. a last pipeline stage)."""
    consoles = [h for h in log.handlers if isinstance(h, _TqdmHandler)]
    if enabled and not consoles:
        console = _TqdmHandler()
        console.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(console)
    if not enabled:
        for h in consoles:
            log.removeHandler(h)


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    """The training steps' progress bar, shown on a terminal only: where the console is captured (a log file,
    SLURM, a pipe) its carriage-return frames would fill the log, and the line each logged step writes
    (trainer.log_every) is the progress instead."""
    shown = enabled and sys.stdout.isatty() and sys.stderr.isatty()
    return tqdm(total=total, initial=initial, disable=not shown, desc="train", leave=False)


class _TqdmHandler(logging.Handler):
    """Console lines written through tqdm so they do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stdout)


def process_peak_rss() -> int:
    """Peak resident set size of this process, in bytes.

    Linux's VmHWM: getrusage's ru_maxrss keeps the peak from before the
    process's exec, which for a worker started by another process (the
    launcher, an elastic agent) is that process's RSS at the fork.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Peak memory of this rank's compute device since the run began.

    On CUDA: the caching allocator's peak. On the CPU, which keeps no such
    statistic: the peak of live tensor bytes (parallel.memory.tracker), the same
    quantity the planner predicts. Counting costs a dispatch per op, so the
    trainer watches the first step (where optimizer state appears) and each
    logged step, not every step.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    @contextlib.contextmanager
    def watch(self, engine, optimizer):
        """Track live tensor bytes during the enclosed step (CPU only)."""
        if self.device.type == "cuda":
            yield
            return
        tracker = LiveTensorBytes(self.device.type)
        tracker.track(state_tensors(engine.model, optimizer))
        tracker.track(engine.kept_tensors())
        with tracker:
            yield
        self.peak = max(self.peak, tracker.peak)

    def value(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak


@dataclass
class Picture:
    """A picture a record carries: to TensorBoard's images under `tag` and to `<run_dir>/<file>`, not to
    metrics.jsonl. `draw(step)` makes its PNG bytes; only the logging rank calls it, and only when
    `Metrics` writes the picture (Note [pictures])."""

    tag: str
    file: str
    draw: Callable[[int], bytes]


class Metrics:
    """Writes one record per logged step to metrics.jsonl and TensorBoard (logging rank only).

    # Note [pictures]
    Drawing a picture costs about a tenth of a second or more (matplotlib), too
    much for every logged step of a fast run. A record's pictures are written
    when PICTURE_EVERY_S seconds have passed since the last was, and the
    latest at the end of the run (`close`), each at the step whose record
    carried it; the file in the run directory is overwritten each time.
    """

    def __init__(self, run_dir: Path, is_logger: bool, hparams_text: str = "", start: int = 0):
        """`start`: the step a resumed run continues after; what the run logged past it (before it
        stopped) is dropped from both sinks, so they read as one run."""
        self.is_logger = is_logger
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if is_logger:
            from torch.utils.tensorboard import SummaryWriter  # heavy (tensorboard): only on the logging rank

            if start and self.path.exists():
                kept = [line for line in self.path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= start]
                self.path.write_text("".join(line + "\n" for line in kept))
            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start + 1 if start else None)
            if hparams_text and not start:
                self.writer.add_text("config", "```\n" + hparams_text + "\n```", 0)
            self._file = open(self.path, "a", buffering=1)
        self.pending: dict[str, tuple[int, Picture]] = {}  # tag -> (step, picture) not written yet
        self.pictures_at = time.monotonic()  # when pictures were last written (Note [pictures])

    def log(self, record: dict) -> None:
        """Append `record` (must hold `step`) to both sinks; its pictures as Note [pictures] says."""
        if not self.is_logger:
            return
        step = record["step"]
        pictures = {k: v for k, v in record.items() if isinstance(v, Picture)}
        # Strict JSON: a value that is not finite (a skipped step's loss: Note [non-finite steps]) is null.
        line = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
                if k not in pictures}
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        for picture in pictures.values():
            self.pending[picture.tag] = (step, picture)
        if time.monotonic() - self.pictures_at >= PICTURE_EVERY_S:
            self._write_pictures()
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, (int, float)):
                self.writer.add_scalar(_tb_name(key), value, step)
            elif isinstance(value, list):
                # Lists are per rank, but a mixture-of-experts layer's figures are per layer or per expert.
                item = "layer" if key.endswith("_per_layer") else "expert" if key.endswith("_per_expert") else "rank"
                for i, v in enumerate(value):
                    self.writer.add_scalar(f"{_tb_name(key)}/{item}{i}", v, step)

    def image(self, tag: str, png: bytes, step: int, file: str | None = None) -> None:
        """A PNG picture to TensorBoard's images at `step`, and to `<run_dir>/<file>` when given."""
        if not self.is_logger:
            return
        import numpy as np
        from PIL import Image  # matplotlib's own dependency

        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        self.writer.add_image(tag, pixels, step, dataformats="HWC")
        if file is not None:
            path = self.path.parent / file
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(png)
            os.replace(tmp, path)  # a reader never sees half a picture

    def _write_pictures(self) -> None:
        for step, picture in self.pending.values():
            self.image(picture.tag, picture.draw(step), step, picture.file)
        self.pending = {}
        self.pictures_at = time.monotonic()

    def close(self) -> None:
        if self.is_logger:
            self._write_pictures()
            self.writer.close()
            self._file.close()


def _tb_name(key: str) -> str:
    """TensorBoard tag of a metrics.jsonl key: grouped, per-rank lists as <key>/rank<N>."""
    if key in ("tokens_per_s", "flops_per_step", "tflops_per_rank", "mfu"):  # parallel.throughput: scalars
        return f"throughput/{key}"
    key = key.removesuffix("_per_rank")
    if key.startswith("eval_"):
        return f"eval/{key.removeprefix('eval_')}"
    if key.startswith(("mem_", "rss_")):
        return f"memory/{key}"
    if key.startswith("moe_"):
        return f"moe/{key.removeprefix('moe_').removesuffix('_per_layer')}"
    if key.startswith("offload_"):
        return f"offload/{key.removeprefix('offload_')}"
    if key.endswith("time_s"):
        return f"time/{key}"
    return f"train/{key}"


def _all_gather(values: list, dtype: torch.dtype, group=None) -> list:
    """Every rank's equally long `values`, concatenated in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=dtype)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [v for x in out for v in x.tolist()]


def gather_floats(values: list[float], group=None) -> list[float]:
    """Every rank's `values`, concatenated in rank order, on every rank."""
    return [float(v) for v in _all_gather(values, torch.float64, group)]


def gather_ints(value: int, group=None) -> list[int]:
    """Every rank's `value`, in rank order, on every rank."""
    return [int(v) for v in _all_gather([value], torch.int64, group)]
