"""A process that has imported the framework once and forks a child for each `python launch/train.py` run.

Imports are most of a short run's time (~3.5 s of torch, Hydra and the framework's lazy imports, against ~1 s
of training), and the suite makes hundreds of runs. A child forked from here starts with them imported, and
is otherwise the process a user gets: its own pid and process group, the test's arguments, working directory,
environment, stdin/stdout/stderr, Hydra and logging untouched until the script runs, its exit status.

    python -m tests.zygote    reads one JSON request a line, answers {"pid": ...} then {"status": ...}

tests/cli.py `run` is the client; a run whose environment differs from this process's is not sent here, nor a
CUDA run: the zygote runs with the GPUs hidden (Note [tests on a GPU machine] in tests/gpus.py), and a process
forked from one that has initialized CUDA could not use it. Where an import has started a thread anyway, a fork
is not safe (a lock the thread held would stay locked in the child): the zygote answers the first request with
{"refused": why}, and the client runs every request in a new interpreter.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import pkgutil
import runpy
import sys
import threading
import traceback

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


def _child(request: dict) -> None:
    """Become `python train.py *args` in the request's directory and environment; never returns."""
    code = 1
    try:
        os.setsid()  # a process group of its own: a timeout stops the run and its workers together
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)  # also replaces this server's pipes to the client
            os.close(opened)
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(script)  # as `python <script>` sets it
        try:
            runpy.run_path(script, run_name="__main__")
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
    _preload_strategies()
    _preload_transformers()
    tasks = os.listdir("/proc/self/task")
    if len(tasks) != 1:
        # The client then starts each run in a new interpreter (tests/cli.py): slower, and right. Python's own
        # threads are named; a library's native ones (a driver's, a thread pool's) are only counted.
        named = ", ".join(t.name for t in threading.enumerate())
        print(json.dumps({"refused": f"the zygote runs {len(tasks)} threads (Python's: {named}) after its imports; "
                                     f"a fork needs it to run one"}), flush=True)
        return
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
