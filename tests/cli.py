"""Run the training CLI as a user would, and read what a run leaves behind."""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from tests import gpus, parity

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "launch" / "train.py")

# Collectives wait at most 60 s after the first step, 150 s until it has ended (the rendezvous, the build: 4
# workers on 2 loaded cores took over 60 s to meet), both under `run`'s 180 s (tests/README.md, Timeouts).
TIMEOUTS = ["trainer.timeout_s=60", "trainer.init_timeout_s=150"]
# Small and fast: every step logged, no progress bar, final weights written.
FAST = ["trainer.steps=6", "trainer.log_every=1", "trainer.progress=false", "trainer.save_final=true", *TIMEOUTS]


def env(args: list[str] = ()) -> dict:
    """The environment of a run with these arguments: the GPUs hidden unless it names trainer.device=cuda (Note
    [tests on a GPU machine] in tests/gpus.py)."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.pop("HYDRA_FULL_ERROR", None)
    return gpus.with_gpus(e) if uses_gpus(args) else gpus.hidden(e)


def uses_gpus(args: list[str]) -> bool:
    """Whether a run with these arguments is a CUDA run: it names trainer.device=cuda."""
    return "trainer.device=cuda" in args


def run(args: list[str], cwd: Path, timeout: float = 180, launcher: list[str] | None = None,
        check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run `python launch/train.py *args` (or `launcher + [train.py] + args`) in `cwd`, on the CPU unless `args`
    name trainer.device=cuda (Note [tests on a GPU machine] in tests/gpus.py).

    A run on the CPU is a child of the zygote (tests/zygote.py), with the framework imported, and so is the agent
    of a launcher run as a module (`python -m torch.distributed.run ...`: its workers are new interpreters);
    `fresh`: a new interpreter, for a test that measures the process itself (its peak RSS); a CUDA run is always
    one.
    """
    cmd = (launcher or [sys.executable]) + [TRAIN] + list(args)
    e = env(args)
    module = launcher is not None and launcher[:2] == [sys.executable, "-m"]
    if (launcher is None or module) and not fresh and not uses_gpus(args) and _Zygote.serves(e):
        target, rest = (launcher[2], cmd[3:]) if module else (TRAIN, list(args))
        proc = _Zygote.run(target, rest, Path(cwd), e, timeout, cmd, module=module)
    else:
        proc = subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


class Started:
    """A run `start` began in the zygote, as much of subprocess.Popen as a test that signals a run uses: `pid`
    (the leader of the run's process group, its workers in it), `poll()`, `communicate(timeout)`, `returncode`."""

    def __init__(self, pid: int, cmd: list[str]):
        self.pid, self.cmd, self.returncode, self._done = pid, cmd, None, None

    def poll(self) -> int | None:
        if self._done is None and _Zygote.ended():
            self.communicate(timeout=60)
        return self.returncode

    def communicate(self, timeout: float) -> tuple[str, str]:
        if self._done is None:
            self._done = _Zygote.finish(self.pid, self.cmd, timeout)
            self.returncode = self._done.returncode
        return self._done.stdout, self._done.stderr


def start(args: list[str], cwd: Path) -> Started | subprocess.Popen:
    """`python launch/train.py *args` in `cwd`, on the CPU, started and not waited for: the zygote's child (a
    `Started`), else a new interpreter in a session of its own (a subprocess.Popen, text). Either leads its own
    process group, as a run started from a terminal does. No other run goes through the zygote until this one
    has been waited for (`communicate`, or `poll` once it has ended)."""
    cmd, e = [sys.executable, TRAIN] + list(args), env(args)
    if not uses_gpus(args) and _Zygote.serves(e):
        pid = _Zygote.start(TRAIN, list(args), Path(cwd), e)
        if pid is not None:
            return Started(pid, cmd)
    return subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_script(script: str, args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python <script> *args` in `cwd` (launch/plan.py, launch/make_shards.py, launch/export.py, a benchmark, a
    test's own script), a child of the zygote like `run`'s runs (a new interpreter when this process's
    environment is not the zygote's); not checked."""
    cmd, e = [sys.executable, script] + list(args), env()
    if _Zygote.serves(e):
        return _Zygote.run(script, list(args), Path(cwd), e, timeout, cmd)
    return subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


# Variables that change in this process during the session and that nothing imported reads at import:
# pytest's name of the current test; torch's default compile cache directory, which torch sets once it has
# computed it (a test running train.py in this process).
_CHANGING = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
# Read at an interpreter's start, and applied by the zygote's child as a new interpreter would (tests/zygote.py
# `_child`): a test may set it for a run (a submitit job's tasks import the tests' modules through it).
_APPLIED = ("PYTHONPATH",)


def _zygote_env(e: dict) -> dict:
    return {k: v for k, v in e.items() if k not in _CHANGING + _APPLIED}


class _Zygote:
    """The client of this test process's zygote (tests/zygote.py), started at its first run."""

    env = env()  # the zygote's: modules it imported may have read it (the GPUs hidden)
    proc: subprocess.Popen | None = None
    outputs: Path | None = None
    refused: str | None = None  # why the zygote cannot fork safely here: every run is then a new interpreter

    drifted: bool = False  # this process's environment has moved away from the zygote's (said once)
    running: int | None = None  # the pid of the child `start` gave, until `finish` has read its status

    @classmethod
    def serves(cls, env: dict) -> bool:
        """Whether a run in `env` goes through the zygote: its environment is the zygote's, and the zygote can
        fork safely on this machine. A variable something in this process set since (not one a test passes
        on purpose) turns every later run into a new interpreter, ~3 s each: said once, naming it."""
        mine, its = _zygote_env(env), _zygote_env(cls.env)
        if mine != its and not cls.drifted:
            cls.drifted = True
            changed = sorted(k for k in set(mine) | set(its) if mine.get(k) != its.get(k))
            warnings.warn(f"tests/cli.py: the environment differs from the zygote's in {changed}; runs with it "
                          "start a new interpreter", stacklevel=3)
        return cls.refused is None and mine == its

    @classmethod
    def run(cls, script: str, args: list[str], cwd: Path, env: dict, timeout: float,
            cmd: list[str], module: bool = False) -> subprocess.CompletedProcess:
        pid = cls.start(script, args, cwd, env, module)
        if pid is None:  # it cannot fork safely on this machine: this run and the next in a new one
            return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        return cls.finish(pid, cmd, timeout)

    @classmethod
    def start(cls, script: str, args: list[str], cwd: Path, env: dict, module: bool = False) -> int | None:
        """The pid of the zygote's child running `python <script> *args` (`module`: `python -m <script> *args`),
        or None where it cannot fork."""
        if cls.running is not None:
            raise RuntimeError(f"a run the zygote started (pid {cls.running}) has not been waited for")
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote"], cwd=ROOT, env=cls.env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
            cls.outputs = Path(tempfile.mkdtemp(prefix="zygote-"))
            atexit.register(shutil.rmtree, cls.outputs, True)
        request = {"module" if module else "script": script, "args": args, "cwd": str(cwd), "env": env,
                   "stdout": str(cls.outputs / "stdout"), "stderr": str(cls.outputs / "stderr")}
        try:
            cls.proc.stdin.write((json.dumps(request) + "\n").encode())
        except BrokenPipeError:  # it has ended: its answer says why
            pass
        answer = cls._answer(time.monotonic() + 600)  # the zygote's fork: at once, once it has started
        if "refused" in answer:
            cls.refused = answer["refused"]
            warnings.warn(f"tests/zygote.py: {cls.refused}; each run starts a new interpreter", stacklevel=4)
            return None
        cls.running = answer["pid"]
        return cls.running

    @classmethod
    def finish(cls, pid: int, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Wait up to `timeout` s for the child `start` gave; at the timeout, stop it with its workers."""
        out, err = cls.outputs / "stdout", cls.outputs / "stderr"
        try:
            status = cls._answer(time.monotonic() + timeout)["status"]
        except subprocess.TimeoutExpired:  # as subprocess.run does: stop it (here with its workers), then say so
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            cls._answer(time.monotonic() + 60)
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text()) from None
        finally:
            cls.running = None
        return subprocess.CompletedProcess(cmd, status, out.read_text(), err.read_text())

    @classmethod
    def ended(cls) -> bool:
        """Whether the child `start` gave has ended (its status is then waiting to be read by `finish`)."""
        return bool(select.select([cls.proc.stdout], [], [], 0)[0])

    @classmethod
    def _answer(cls, deadline: float) -> dict:
        """One line from the zygote (read unbuffered: a buffer would hide a line from select)."""
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([cls.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired("zygote", 0)
            chunk = os.read(cls.proc.stdout.fileno(), 1)
            if not chunk:
                raise RuntimeError(f"the zygote (tests/zygote.py) exited with {cls.proc.wait()}")
            line += chunk
        return json.loads(line)


def shared_run(args: list[str], root: Path, timeout: float = 180) -> Path:
    """The run directory of `python launch/train.py *args`, run once under `root` for every test that asks
    with the same arguments (tests/conftest.py `reference`); a test only reads it.

    `root` is shared by pytest-xdist's workers: the first to ask runs it while holding a lock on the
    arguments' file, and a worker asking at the same time waits for that run instead of making its own.
    """
    root.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(json.dumps(list(args)).encode()).hexdigest()[:16]
    run_dir, done = root / key, root / f"{key}.done"  # done: written once the run has finished
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # what a failed attempt left
            run_dir.mkdir()
            run(list(args) + [f"run_dir={run_dir}"], cwd=run_dir, timeout=timeout)
            done.write_text(" ".join(args) + "\n")  # which run it is, for someone reading the directory
    return run_dir


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def metrics(run_dir: Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses(run_dir: Path) -> torch.Tensor:
    """The logged training losses (an evaluation after a step that logs nothing has a record of its own)."""
    return torch.tensor([float("nan") if r["loss"] is None else r["loss"] for r in metrics(run_dir) if "loss" in r],
                        dtype=torch.float64)


def final_weights(run_dir: Path) -> dict:
    return torch.load(Path(run_dir) / "final_model.pt", map_location="cpu", weights_only=True)


def assert_same_training(run_dir: Path, ref_dir: Path, first_step: int = 1) -> None:
    """Loss per step within 1e-4 relative and equal final weights (the parity invariant), as Note [parity
    tolerances] in tests/parity.py says. `first_step`: `run_dir` logged from this step on (resumed there)."""
    parity.assert_same_losses(losses(run_dir), losses(ref_dir)[first_step - 1:])
    parity.assert_same_weights(final_weights(run_dir), final_weights(ref_dir), parity.run_reach(ref_dir))
