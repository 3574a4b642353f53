"""A process that has imported the framework once and forks a child for each `python launch/train.py` run.

Imports are most of a short run's time (~3.5 s of torch, Hydra and the framework's lazy imports, against ~1 s
of training), and the suite makes hundreds of runs. A child forked from here starts with them imported, and
is otherwise the process a user gets: its own pid and process group, the test's arguments, working directory,
environment, stdin/stdout/stderr, Hydra and logging untouched until the script runs, its exit status.

    python -m tests.zygote    reads one JSON request a line, answers {"pid": ...} then {"status": ...}

A request names a "script" (`python <script> *args`) or a "module" (`python -m <module> *args`: torchrun's agent,
whose workers it starts are new interpreters).

tests/cli.py `run` is the client; a run whose environment differs from this process's is not sent here (but for
PYTHONPATH, which the child puts on its sys.path as a new interpreter would), nor a CUDA run: the zygote runs
with the GPUs hidden (Note [tests on a GPU machine] in tests/gpus.py), and a process forked from one that has
initialized CUDA could not use it. Where an import has started a thread anyway, a fork is not safe (a lock the
thread held would stay locked in the child): the zygote answers the first request with {"refused": why}, and
the client runs every request in a new interpreter.

`forkable` and `run_forked` serve another process that forks its runs alike (benchmarks/gpu.py --smoke,
benchmarks/export_memory.py --smoke).
"""
from __future__ import annotations

import atexit
import gc
import importlib
import inspect
import json
import os
import pkgutil
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# What a run imports (launch/train.py, and lazily the trainer, checkpoints, every strategy, TensorBoard).
# No thread may be running at a fork (a lock it held would stay locked in the child): checked below.
import hydra  # noqa: F401
import matplotlib.backends.backend_agg  # noqa: F401  (imported when a picture is drawn: parallel/pictures/)
import matplotlib.figure  # noqa: F401
import torch  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.utils.tensorboard  # noqa: F401

import parallel.checkpoint  # noqa: F401
import parallel.launcher  # noqa: F401
import parallel.strategies
import parallel.trainer  # noqa: F401


def _preload_strategies() -> None:
    for module in pkgutil.iter_modules(parallel.strategies.__path__):
        importlib.import_module(f"parallel.strategies.{module.name}")


def _preload_transformers() -> None:
    """The Hugging Face models the tests build (transformers imports each model's module on first use)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as parallel/models/hf.py sets it before importing
    import transformers

    for name in ("LlamaForCausalLM", "GPT2LMHeadModel", "BertForSequenceClassification", "AutoModelForCausalLM"):
        getattr(transformers, name)


def preload() -> None:
    """Import what a run imports on demand: every strategy, and the Hugging Face models the tests build; then
    leave it out of the collector's sight (Note [what a forked run costs])."""
    global _preloaded
    if _preloaded:
        return
    _preload_strategies()
    _preload_transformers()
    gc.freeze()
    inspect.modulesbyfile.setdefault("<frozen runpy>", "runpy")
    _preloaded = True


_preloaded = False


# Note [what a forked run costs]
# A child of this process starts with ~465,000 objects imported (transformers
# among them; a run of the command line imports ~330,000); two things grow with
# it, and each took as much time as a short run's training:
# - the cyclic garbage collector walks them at each full collection (~0.25 s),
#   in the child's launcher and agent as in its workers: frozen here
#   (gc.freeze), as a worker freezes what it imported (Note [the collector in a
#   worker] in parallel/launcher.py);
# - inspect.getmodule, for a frame whose file is no module's, loops over every
#   module imported, and torch's elastic agent calls inspect.stack at each step of
#   its rendezvous (~1.5 s of the agent's time in a 2-worker run). The frames of
#   runpy (this process runs as `python -m tests.zygote`, and the child runs the
#   script through runpy) are such frames, absent from `python launch/train.py`:
#   their module is told to inspect once here.


def why_not_fork() -> str | None:
    """Why this process cannot fork a run safely (a thread besides this one), or None."""
    tasks = os.listdir("/proc/self/task")
    if len(tasks) == 1:
        return None
    # Python's own threads are named; a library's native ones (a driver's, a thread pool's) are only counted.
    named = ", ".join(t.name for t in threading.enumerate())
    return f"the process runs {len(tasks)} threads (Python's: {named}); a fork needs it to run one"


def fork(request: dict) -> int:
    """Start the request's `python <script> *args` (or `python -m <module> *args`) as a forked child (see
    `_child`); its pid."""
    for stream in (sys.stdout, sys.stderr):  # nothing of this process's buffers reaches the child's files
        stream.flush()
    pid = os.fork()
    if pid == 0:
        _child(request)
    return pid


# What the environment of a run forked from a process may hold other than that process's own: PYTHONPATH (the
# child applies it, as a new interpreter would) and the inductor cache (read when compiling, not at import).
MAY_DIFFER = ("PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR")


def forkable(env: dict) -> bool:
    """Whether a run in `env` forked from this process is the process a new interpreter would give: `env` is
    this process's environment (which its imports may have read) but for MAY_DIFFER, and once what runs import
    is imported (`preload`), this process runs no other thread (`why_not_fork`)."""
    def settled(e):
        return {k: v for k, v in e.items() if k not in MAY_DIFFER}

    if settled(env) != settled(os.environ):
        return False
    preload()  # at the first run; nothing to do after it
    return why_not_fork() is None


def run_forked(cmd: list[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`cmd` (`python <script> *args`) to its end as a child forked from this process (`fork`), its output
    captured; at `timeout`, its process group killed and subprocess.TimeoutExpired raised, as subprocess.run
    does. For a process that has imported what the script imports and runs no other thread (`why_not_fork`)."""
    # Removed here, not by a TemporaryDirectory: the child runs this process's exit functions at its own exit.
    out = Path(tempfile.mkdtemp(prefix="forked-"))
    try:
        stdout, stderr = out / "stdout", out / "stderr"
        pid = fork({"script": cmd[1], "args": cmd[2:], "cwd": str(cwd), "env": env, "stdout": str(stdout),
                    "stderr": str(stderr)})
        deadline = time.monotonic() + timeout
        while not (ended := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:  # the child leads a process group of its own: its workers too
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(cmd, timeout, stdout.read_text(), stderr.read_text())
            time.sleep(0.02)
        return subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(ended[1]), stdout.read_text(),
                                           stderr.read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _child(request: dict) -> None:
    """Become `python <script> *args` (or `python -m <module> *args`) in the request's directory and environment;
    never returns."""
    code = 1
    try:
        os.setsid()  # a process group of its own: a timeout stops the run and its workers together
        # A new interpreter puts PYTHONPATH's entries after the script's directory, made absolute from where it
        # starts: the request's entries, not this process's (a submitit job's tasks import the tests' modules
        # through it).
        ours, theirs = os.environ.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", "")
        ours = {os.path.abspath(p) for p in ours.split(os.pathsep) if p} if ours != theirs else None
        os.chdir(request["cwd"])
        if ours is not None:
            theirs = [os.path.abspath(p) for p in theirs.split(os.pathsep) if p]
            sys.path[1:] = theirs + [p for p in sys.path[1:] if p not in ours and p not in theirs]
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)  # also replaces this server's pipes to the client
            os.close(opened)
        try:
            if "module" in request:  # `python -m <module>`: run_module puts the module's file in argv[0]
                sys.argv = [request["module"], *request["args"]]
                sys.path[0] = os.getcwd()  # as `python -m` sets it
                runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [request["script"], *request["args"]]
                sys.path[0] = os.path.dirname(request["script"])  # as `python <script>` sets it
                runpy.run_path(request["script"], run_name="__main__")
            code = 0
        except SystemExit as e:  # as the interpreter turns sys.exit's argument into a status
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        # The interpreter's own shutdown (a garbage collection over everything imported, ~1 s) is skipped:
        # nothing of a run depends on it.
        os._exit(code)


def serve() -> None:
    preload()
    refused = why_not_fork()
    if refused:  # the client then starts each run in a new interpreter (tests/cli.py): slower, and right
        print(json.dumps({"refused": f"after the zygote's imports, {refused}"}), flush=True)
        return
    for line in sys.stdin:
        pid = fork(json.loads(line))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
