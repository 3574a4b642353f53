"""Preemption: a signal ends the run at a step boundary, with a checkpoint of that step, and may requeue it.

# Note [preemption]
Clusters end jobs with a signal: SLURM sends SIGTERM at preemption (SIGKILL after
its grace time) and, with `--signal=USR1@90`, SIGUSR1 ahead of the time limit;
Kubernetes sends SIGTERM; submitit sends its own signal (SUBMITIT_PREEMPT_SIGNAL,
USR2 by default). A worker that receives one of them (`signals()`):

  1. finishes the step it is in: the handler only records the signal (a watcher
     thread reads it from Python's wakeup fd, so it is seen even while the main
     thread waits in a collective);
  2. at a step boundary all ranks all-reduce (max) the signal each has seen,
     two ints over a CPU (gloo) group: a rank that saw none, or saw it a step
     later, still stops at the same step as the others, so no rank saves another
     step. It is the one collective the check adds, and a point where the ranks
     wait for each other: 0.13-0.24 ms alone with 2 gloo ranks on one host,
     0.5-0.9 ms added to a 2-10 ms CPU step on 2 shared cores
     (benchmarks/preemption.py). So the ranks compare notes at every boundary
     only when steps take trainer.preempt_check_s (0.1 s) or longer, as a
     GPU's steps mostly do (the cost is then under 1%, and the run stops at the
     step the signal came in, which an asynchronous check overlapped with the
     next step would not); shorter steps are checked every k-th boundary, k
     such that k steps take about preempt_check_s (`checks_every`), so the cost
     stays near 1% and a signal is acted on at most about preempt_check_s
     later. Each rank proposes k from its own steps since the last check, and
     the same all-reduce agrees on the smallest, so every rank checks at the
     same boundaries; trainer.preempt_check_s=0 checks every boundary;
  3. saves a checkpoint of that step through the atomic path (Note [atomic
     checkpoint]), whatever trainer.checkpoint_every is, and stops;
  4. exits with PREEMPTED (75, EX_TEMPFAIL in sysexits.h: a temporary failure,
     to be tried again). The launcher's own process, a torchrun worker and a
     SLURM task all use it; the launcher of `nproc=N` workers exits 75 when every
     worker did. With trainer.requeue=true, rank 0 first requeues the job:
     through submitit's checkpoint/requeue protocol in a submitit job (which then
     exits that task as submitit does), else `scontrol requeue $SLURM_JOB_ID`.
     The requeued job resumes from the checkpoint (trainer.resume=auto, the
     default) on the world size it has.

A second signal, at least SAME_SIGNAL_S after the first, or trainer.preempt_timeout_s
passing after the first, stops the worker at once without saving: exit status
128 + the signal's number, as a shell reports a process that a signal ended. A
signal that arrives twice within SAME_SIGNAL_S counts once: SLURM signals every
process of a task, so a worker started by a launcher receives the launcher's
forwarded copy as well as its own. After the checkpoint is complete further
signals are ignored: the worker is exiting (and torchrun's agent, seeing the
first worker end, signals the others).

Where the signal arrives:
  * the workers directly (SLURM signals every task): as above;
  * `python launch/train.py nproc=N`: the launcher forwards SIGTERM and SIGUSR1
    to its workers (`forwarding`) and waits for them;
  * torchrun's agent: it forwards SIGTERM (and what --signals-to-handle adds,
    e.g. SIGUSR1) to its workers and SIGKILLs them after --shutdown-timeout
    (default 30 s), which must cover a step and a checkpoint; torchrun itself
    then ends with its own SignalException (exit status 1, its traceback).
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.checkpoint import newest_complete, step_dir
from parallel.metrics import log

PREEMPTED = os.EX_TEMPFAIL  # 75; Note [preemption]
SAME_SIGNAL_S = 1.0  # a signal again within this many seconds is the same one, delivered twice
MAX_EVERY = 1000  # the most steps between two checks, however short the steps


def checks_every(seconds_per_step: float, check_s: float) -> int:
    """How many steps apart the ranks check for a signal when a step takes `seconds_per_step`: every step when
    steps take `check_s` or longer (or check_s is 0), else about check_s / seconds_per_step (Note [preemption])."""
    if check_s <= 0 or seconds_per_step >= check_s:
        return 1
    return min(MAX_EVERY, max(1, int(check_s / max(seconds_per_step, 1e-9))))


def signals() -> tuple[signal.Signals, ...]:
    """The signals that preempt a run: SIGTERM, SIGUSR1, and in a submitit job submitit's own."""
    own = _submitit_signal()
    return (signal.SIGTERM, signal.SIGUSR1) + ((own,) if own not in (None, signal.SIGTERM, signal.SIGUSR1) else ())


def _submitit_signal() -> signal.Signals | None:
    """The signal submitit sends a job's tasks ahead of its end (its SUBMITIT_PREEMPT_SIGNAL), in its jobs."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)


def in_slurm() -> bool:
    """True in a SLURM job, or a job of submitit's local executor (which requeues as SLURM would)."""
    return "SLURM_JOB_ID" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") in ("slurm", "local")


def check_requeue(requeue: bool) -> None:
    """trainer.requeue outside SLURM: a warning, before any worker starts; nothing will be requeued."""
    if requeue and not in_slurm():
        log.warning("trainer.requeue=true: not in a SLURM job (no SLURM_JOB_ID, no submitit job); a preempted "
                    "run saves and stops, and nothing is requeued")


class Preempted(Exception):
    """The run stopped at a step boundary after a signal, with a checkpoint of that step (Note [preemption])."""

    def __init__(self, signal_name: str | None, step: int | None, path: Path | str | None, run_dir: Path | str):
        where = f"saved step {step} in {path}" if path is not None else "no complete checkpoint"
        super().__init__(f"preempted{f' ({signal_name})' if signal_name else ''}: {where}; the same command with "
                         f"run_dir={run_dir} goes on from it (trainer.resume=auto)")
        self.signal_name, self.step, self.path = signal_name, step, path


class Watch:
    """The signals of one worker process: recorded by a thread, agreed on by every rank at step boundaries.

    Args:
        timeout_s: after the first signal, stop at once when this many seconds have passed.
        check_s: the ranks check at every step boundary when steps take this long, else every few (Note
            [preemption]).
        group: the process group to agree over (a CPU one); None: the default group.
        clock: what times the steps between checks (seconds, monotonic); a test passes its own, to set how long
            steps take. The timeout and SAME_SIGNAL_S are the watcher thread's, on time.monotonic.
    """

    def __init__(self, timeout_s: float, check_s: float = 0.0, group=None, clock=time.monotonic):
        self.timeout_s, self.check_s, self.group, self.clock = timeout_s, check_s, group, clock
        self.next_check = 0  # the first step boundary of the next check
        self._last: tuple[int, float] | None = None  # (step, time) of the last check
        self.signum = 0  # the first signal received (0: none yet); written by the watcher thread only
        self.saved = False  # the checkpoint is complete: later signals are ignored
        self._first = 0.0
        self._old: dict = {}
        self._old_fd = -1
        self._read = self._write = -1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take the signals (from the main thread): each one is written to a pipe the watcher thread reads."""
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for s in signals():
            self._old[s] = signal.signal(s, _recorded)
        self._thread = threading.Thread(target=self._watch, name="preemption-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Give the signals back to their previous handlers and end the watcher thread."""
        if self._thread is None:
            return
        os.set_blocking(self._write, True)
        os.write(self._write, b"\0")  # not a signal: the thread's cue to end
        self._thread.join()
        self._thread = None
        signal.set_wakeup_fd(self._old_fd)
        for s, handler in self._old.items():
            # After the checkpoint the worker only exits: a signal then (torchrun's agent stopping the workers
            # once one has ended) must not end it by another status.
            signal.signal(s, signal.SIG_IGN if self.saved else handler)
        if self.saved:
            _given_back.update(self._old)
        os.close(self._read)
        os.close(self._write)

    def due(self, step: int) -> bool:
        """Whether the ranks check at the boundary after `step` (the same answer on every rank)."""
        return step >= self.next_check

    def agreed(self, step: int | None = None) -> int:
        """The signal every rank stops for at this step boundary, 0 for none (a collective: every rank calls it
        at the same boundaries). With `step`, also when to check next: the fewest steps apart any rank proposes."""
        every = 1
        if step is not None and self._last is not None and step > self._last[0]:
            every = checks_every((self.clock() - self._last[1]) / (step - self._last[0]), self.check_s)
        flag = torch.tensor([self.signum, -every], dtype=torch.int64)  # max of -every: the smallest every
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if step is not None:
            self.next_check, self._last = step - int(flag[1]), (step, self.clock())
        return int(flag[0])

    def _watch(self) -> None:
        deadline = None
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._read], [], [], wait)
            if not ready:
                _stop_now(self.signum, f"trainer.preempt_timeout_s={self.timeout_s:g} passed since "
                                       f"{signal.Signals(self.signum).name}")
            for signum in os.read(self._read, 64):
                if signum == 0:
                    return
                if signum not in [int(s) for s in signals()]:
                    continue  # another signal with a Python handler (SIGINT): its handler deals with it
                now = time.monotonic()
                if not self.signum:
                    self._first, deadline = now, now + self.timeout_s
                    self.signum = signum
                    log.warning("%s: the run stops after this step, with a checkpoint of it (Note [preemption])",
                                signal.Signals(signum).name)
                elif not self.saved and now - self._first >= SAME_SIGNAL_S:
                    _stop_now(signum, f"a second signal ({signal.Signals(signum).name})")


def _recorded(signum, frame) -> None:
    """The Python-level handler: nothing to do, the watcher thread has the signal from the wakeup fd."""


def _stop_now(signum: int, why: str) -> None:
    """End this process at once, from any thread, as the signal would have without a handler (128 + number)."""
    print(f"rank {os.environ.get('RANK', '0')}: {why}: stopping at once, without saving", file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    os._exit(128 + signum)


_watch: Watch | None = None  # this worker's; signals belong to the process
_given_back: dict = {}  # the handlers before the Watch, after a preemption (submitit's, to requeue)


@contextlib.contextmanager
def watching(timeout_s: float, check_s: float = 0.0, clock=time.monotonic):
    """Watch for preemption signals while a worker runs (from its main thread, with the process group up);
    the arguments are Watch's."""
    global _watch
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")  # the agreement is on CPU
    _watch = Watch(timeout_s, check_s, group, clock)
    _watch.start()
    try:
        yield _watch
    finally:
        _watch.close()
        _watch = None


def seen() -> int:
    """The first preemption signal this worker's watch has recorded, 0 for none yet (or no watch): what this
    rank brings to the next check. For code that must know a signal has landed (tests/preempting.py)."""
    return _watch.signum if _watch is not None else 0


def stop_here(run, checkpoints, step: int) -> Preempted | None:
    """At the boundary after `step` (every rank calls it): when a signal has come, save `step` and return what
    stops the run. The last step ends the run anyway, so it is not checked."""
    if _watch is None or step == run.cfg.trainer.steps or not _watch.due(step):
        return None
    signum = _watch.agreed(step)
    if not signum:
        return None
    path = step_dir(checkpoints.root, step) if checkpoints.due(step) else checkpoints.save(run, step)
    _watch.saved = True
    name = signal.Signals(signum).name
    log.warning("preempted by %s: stopped after step %d, saved in %s", name, step, path)
    return Preempted(name, step, path, checkpoints.root.parent)  # checkpoints_of(run_dir)


def finish(e: Preempted, requeue: bool) -> int:
    """After a worker stopped for a signal (its process group gone): requeue the job when asked (rank 0);
    the exit status. In a submitit job submitit's protocol requeues and exits this process itself."""
    if requeue and int(os.environ.get("RANK", "0")) == 0:
        _requeue(e)
    return PREEMPTED


def _requeue(e: Preempted) -> None:
    own = _submitit_signal()
    if own is not None:
        handler = _given_back.get(own)  # submitit's checkpoint-and-requeue (Watch.close)
        if callable(handler):
            log.warning("trainer.requeue: handing the job to submitit to requeue")
            try:
                handler(own, None)  # exits this process when the job is requeued
            except Exception as err:  # submitit's "not requeued" (timed out too often, no checkpoint method)
                log.warning("trainer.requeue: submitit did not requeue the job: %s", err)
            return
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        log.warning("trainer.requeue=true: not in a SLURM job; nothing requeued")
        return
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        ok, detail = done.returncode == 0, (done.stderr or done.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        ok, detail = False, str(err)
    if ok:
        log.warning("trainer.requeue: job %s requeued (scontrol requeue); it resumes from %s", job, e.path)
    else:
        log.warning("trainer.requeue: `scontrol requeue %s` failed: %s", job, detail)


# ---- the launcher of nproc workers ----------------------------------------------------------------------------

@contextlib.contextmanager
def forwarding():
    """In the process that started the workers: SIGTERM and SIGUSR1 (and submitit's signal) reach every
    worker, which stop as Note [preemption] says. Yields the names of the signals forwarded so far."""
    import multiprocessing

    seen: list[str] = []

    def forward(signum, frame):
        seen.append(signal.Signals(signum).name)
        for child in multiprocessing.active_children():  # the workers (elastic's processes)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    old = {s: signal.signal(s, forward) for s in signals()}
    try:
        yield seen
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def preempted_run(forwarded: list[str], run_dir: str) -> Preempted:
    """What the launcher reports when every worker stopped for a signal: the newest complete checkpoint (the
    one they saved)."""
    path, _ = newest_complete(Path(run_dir))
    step = None if path is None else int(path.name.removeprefix("step-"))
    return Preempted(forwarded[0] if forwarded else None, step, path, run_dir)


def all_preempted(exit_codes: list[int]) -> bool:
    """Every worker that ended with an error ended with PREEMPTED (the others ended cleanly)."""
    return bool(exit_codes) and all(code == PREEMPTED for code in exit_codes)


def stopped_at_once(exit_codes: list[int]) -> str | None:
    """The signal that stopped the workers at once (a second signal, a timeout), if every failed one was."""
    names = {int(s): s.name for s in signals()}
    found = [names.get(code - 128) or names.get(-code) for code in exit_codes]
    return found[0] if found and all(found) else None
