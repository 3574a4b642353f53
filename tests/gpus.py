"""The GPUs of the machine the tests run on: hidden from every test but the CUDA ones.

# Note [tests on a GPU machine]
The suite passes on a machine with GPUs as it does on one without: every test
but those marked `cuda` runs on the CPU, in the test process and in every
process it starts.

- tests/conftest.py hides the GPUs (`hide`: CUDA_VISIBLE_DEVICES="") before
  anything initializes CUDA. pytest-xdist's workers and every process a test
  starts inherit it. `trainer.device=auto` then means the CPU, as on a machine
  without a GPU: multi-rank runs use gloo (two ranks on one GPU would meet in
  nccl as "Duplicate GPU detected"), validation and the planner see a CPU run,
  and in-process tests compute what they compute on the CPU.
- A run that names `trainer.device=cuda` (tests/cli.py `run`) gets the GPUs
  back (`with_gpus`: CUDA_VISIBLE_DEVICES as it was), in a new interpreter:
  never through the zygote (tests/zygote.py), which runs with the GPUs hidden
  (a process forked from one that has initialized CUDA cannot use it).
- A test that needs CUDA in its own process (the allocator's snapshot, the
  device's name) runs its body in a child that sees the GPUs (`call`).
- `count()` is the number of GPUs the CUDA tests may use, asked of a child
  process (this one hides them); 0 without asking on a CPU build of torch. The
  marker `cuda` (one GPU) or `cuda(n)` skips a test, with the reason, where
  there are fewer (tests/conftest.py).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# CUDA_VISIBLE_DEVICES as it was before `hide` (JSON: null when it was unset), for the runs that use the GPUs.
SAVED = "PARALLEL_TESTS_CUDA_VISIBLE_DEVICES"


def hide() -> None:
    """Hide the GPUs from this process and the processes it starts (before anything initializes CUDA)."""
    if SAVED not in os.environ:  # xdist's workers inherit both from the main process: keep the first value
        os.environ[SAVED] = json.dumps(os.environ.get("CUDA_VISIBLE_DEVICES"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def hidden(env: dict) -> dict:
    """`env` with the GPUs hidden (`hide` for a child's environment)."""
    e = dict(env)
    e.setdefault(SAVED, json.dumps(e.get("CUDA_VISIBLE_DEVICES")))
    e["CUDA_VISIBLE_DEVICES"] = ""
    return e


def with_gpus(env: dict) -> dict:
    """`env` with the GPUs visible again: CUDA_VISIBLE_DEVICES as it was before `hide`."""
    e = dict(env)
    if SAVED not in e:  # never hidden
        return e
    visible = json.loads(e[SAVED])
    if visible is None:
        e.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        e["CUDA_VISIBLE_DEVICES"] = visible
    return e


_PROBE = ("import json, torch; n = torch.cuda.device_count(); "
          "print(json.dumps([n, torch.cuda.get_device_name(0) if n else None]))")


@functools.cache
def _probe() -> tuple[int, str | None]:
    """(GPUs, the first one's name), asked of a child process that sees them (~3 s, once per process); no
    child on a CPU build of torch."""
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return 0, None
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=with_gpus(dict(os.environ)), capture_output=True,
                          text=True, timeout=120)
    return tuple(json.loads(proc.stdout)) if proc.returncode == 0 else (0, None)


def count() -> int:
    """The GPUs the CUDA tests may use."""
    return _probe()[0]


def name() -> str | None:
    """The name of the first of them (torch.cuda.get_device_name(0)); None without one."""
    return _probe()[1]


def call(fn, *args: str, timeout: float = 300) -> None:
    """Run `fn(*args)` (a module-level function of a test module; string arguments) in a child process that
    sees the GPUs; its failure, with its traceback, fails the calling test."""
    code = f"import sys; from {fn.__module__} import {fn.__name__} as fn; fn(*sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                          env=with_gpus(dict(os.environ)), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{fn.__name__} on the GPU exited {proc.returncode}:\n{proc.stderr[-5000:]}"
