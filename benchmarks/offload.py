"""strategy=offload against the same run without offload: peak RSS, step time, bytes moved, the I/O bound.

    python benchmarks/offload.py [--cases weights,activations] [--steps 4]

Two cases, each run without offload (`strategy=single`) and with it
(`strategy=offload`), one after the other in this invocation:

  weights      an MLP with ~2 GB of training state (600 MB of weights, their
               gradients and two AdamW moments); weights, gradients and
               optimizer state on disk, the step overlapping backward
               (trainer.clip_grad_norm=0, see docs/offload.md).
  activations  a narrower MLP on a large batch, whose saved activations dwarf
               its weights; activations on disk as well.

Both runs take `model.init=name`, the initialization for a model larger than
host memory (docs/models.md#initialization): under the default,
`model.init=module`, the process builds the whole model once at start to write
its initial weights, and that, not the training, would be the offload run's
peak RSS.

The disk bandwidth is measured in the same run (a file as large as the bytes
a step moves, written then read back, through the page cache as the engine's
files are), and the I/O bound of a step is the bytes it moves at that
bandwidth. Targets: peak RSS <= 0.35x (weights) and <= 0.5x (activations) of
the run without offload, with step time <= 1.3x the I/O bound. Where the
compute of a step takes longer than its transfers (the step of the run without
offload exceeds the I/O bound), no engine can reach the I/O bound, so a
column also divides by that step. On a machine whose few cores do both the
compute and the copies into and out of the page cache, the two compete, and
the last column divides by their sum (no overlap at all: below 1 means
overlap won time back). Prints a table and writes
benchmarks/results/offload.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "weights": (["model.args.hidden=2896", "model.args.depth=18", "trainer.batch_size=16",
                 "trainer.clip_grad_norm=0"], []),
    "activations": (["model.args.hidden=512", "model.args.depth=16", "trainer.batch_size=16384",
                     "trainer.clip_grad_norm=0"], ["strategy.activations=disk"]),
}


def run(args: list[str], steps: int, run_dir: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *args, "model.init=name", f"trainer.steps={steps}",
           f"trainer.log_every={steps}", "trainer.progress=false", f"run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def disk_bandwidth(directory: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """Bytes per second of writing then reading back a file of `nbytes` in `directory`."""
    path = directory / "bandwidth.bin"
    block = os.urandom(chunk)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(max(1, nbytes // chunk)):
            f.write(block)
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    elapsed = time.perf_counter() - t0
    moved = 2 * max(1, nbytes // chunk) * chunk
    path.unlink()
    return moved / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="weights,activations")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "offload.json"))
    a = ap.parse_args()
    rows = []
    print(f"{'case':<12} {'run':<8} {'peak RSS MB':>11} {'RSS ratio':>9} {'step s':>7} {'moved MB/step':>13} "
          f"{'disk MB/s':>9} {'I/O bound s':>11} {'step / bound':>12} {'step / max(bound, single)':>25} "
          f"{'step / (bound + single)':>23}")
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        for case in a.cases.split(","):
            model, offload = CASES[case]
            base = run(model + ["strategy=single"], a.steps, Path(tmp) / f"{case}-single")
            off = run(model + ["strategy=offload"] + offload, a.steps, Path(tmp) / f"{case}-offload")
            moved = off["offload_params_bytes"] + off["offload_optimizer_bytes"] + off["offload_activations_bytes"]
            bandwidth = disk_bandwidth(Path(tmp), int(moved))
            bound = moved / bandwidth
            ratio = off["rss_peak_bytes"] / base["rss_peak_bytes"]
            row = {"case": case, "rss_peak_bytes": {"single": base["rss_peak_bytes"], "offload": off["rss_peak_bytes"]},
                   "rss_ratio": ratio, "step_time_s": {"single": base["step_time_s"], "offload": off["step_time_s"]},
                   "mem_peak_bytes": {"single": base["mem_peak_bytes"], "offload": off["mem_peak_bytes"]},
                   "bytes_moved_per_step": moved, "moved_by_kind": {k: off[f"offload_{k}_bytes"] for k in
                                                                    ("params", "optimizer", "activations")},
                   "wait_s_per_step": off["offload_wait_s"], "disk_bytes_per_s": bandwidth, "io_bound_s": bound,
                   "step_over_bound": off["step_time_s"] / bound,
                   # The step cannot beat its own compute either: the run without offload.
                   "step_over_limit": off["step_time_s"] / max(bound, base["step_time_s"]),
                   # Compute and transfers one after the other: what a step costs with no overlap at all.
                   "step_over_serial": off["step_time_s"] / (bound + base["step_time_s"])}
            rows.append(row)
            print(f"{case:<12} {'single':<8} {base['rss_peak_bytes'] / 1e6:>11.0f} {'':>9} "
                  f"{base['step_time_s']:>7.2f}")
            print(f"{case:<12} {'offload':<8} {off['rss_peak_bytes'] / 1e6:>11.0f} {ratio:>9.3f} "
                  f"{off['step_time_s']:>7.2f} {moved / 1e6:>13.0f} {bandwidth / 1e6:>9.0f} {bound:>11.2f} "
                  f"{off['step_time_s'] / bound:>12.2f} {row['step_over_limit']:>25.2f} "
                  f"{row['step_over_serial']:>23.2f}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=2))
    print("targets: RSS ratio <= 0.35 (weights), <= 0.5 (activations); step / bound <= 1.3 "
          "(step / max(bound, single) where compute exceeds the transfers)")


if __name__ == "__main__":
    main()
