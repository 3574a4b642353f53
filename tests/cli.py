"""Run the training CLI as a user would, and read what a run leaves behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "launch" / "train.py")

# Small and fast: every step logged, no progress bar, final weights written.
FAST = ["trainer.steps=6", "trainer.log_every=1", "trainer.progress=false", "trainer.save_final=true",
        "trainer.timeout_s=60"]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.pop("HYDRA_FULL_ERROR", None)
    return e


def run(args: list[str], cwd: Path, timeout: float = 180, launcher: list[str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run `python launch/train.py *args` (or `launcher + [train.py] + args`) in `cwd`."""
    cmd = (launcher or [sys.executable]) + [TRAIN] + list(args)
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def metrics(run_dir: Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses(run_dir: Path) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in metrics(run_dir)], dtype=torch.float64)


def final_weights(run_dir: Path) -> dict:
    return torch.load(Path(run_dir) / "final_model.pt", map_location="cpu", weights_only=True)


def assert_same_training(run_dir: Path, ref_dir: Path) -> None:
    """Loss per step within 1e-4 relative and equal final weights (the parity invariant).

    "Equal" weights: within 1e-4 relative (1e-5 absolute), as for the loss. A
    sharded matmul sums in another order than the whole one, and AdamW turns a
    rounding difference in a near-zero gradient into one of up to ~lr x 1e-2.
    """
    torch.testing.assert_close(losses(run_dir), losses(ref_dir), rtol=1e-4, atol=0)
    got, want = final_weights(run_dir), final_weights(ref_dir)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
