"""Training from shards on disk against the same samples held in RAM, at 0.1 GB and 1 GB.

    python benchmarks/data.py [--sizes 0.1,1] [--pairs 3] [--steps 200]

For each dataset size (samples of 256 float32 features and 4 targets, about
1 KB each), in one invocation:
  1. the dataset is written with the project's shard writer;
  2. the disk's raw read bandwidth: the shard files read front to back after
     their pages are dropped from the page cache (posix_fadvise DONTNEED), and
     again from the cache;
  3. a training loop (an MLP 256 -> 512 -> 512 -> 4, AdamW, one thread) fed,
     in alternating pairs of fresh processes (shards, RAM, shards, RAM, ...),
     by `ShardData` (data=shards: reader threads, prefetch, shuffle windows)
     or by the same samples in the same order from one numpy array loaded
     whole into memory (the in-RAM baseline users start from). Each process
     reports samples/s over the steps after the first ten, and its peak RSS
     (VmHWM: its own, not the parent's at the fork).

Prints a table and writes benchmarks/results/data.json. Targets: shard
throughput >= 0.9 x in RAM when the disk is not the limit (the files are in
the page cache after writing, and the step asks for less than the cold read
bandwidth); peak RSS grows <= 10% from 0.1 GB to 1 GB of shards.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

F, T, BATCH = 256, 4, 512


def write(out: Path, gigabytes: float) -> int:
    import numpy as np

    from parallel.data.shards import ShardWriter

    n = int(gigabytes * 1e9) // ((F + T) * 4)
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((F, T)).astype(np.float32) / F ** 0.5
    with ShardWriter(out / "shards", shard_size="64MB") as w:
        for lo in range(0, n, 1 << 16):
            x = rng.standard_normal((min(n, lo + (1 << 16)) - lo, F), dtype=np.float32)
            w.add_arrays({"features": x, "targets": x @ teacher})
    return n


def read_bandwidth(directory: Path, cold: bool) -> float:
    """Bytes/s reading every shard front to back (cold: after dropping their cached pages)."""
    files = sorted(directory.glob("shard-*.bin"))
    if cold:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    total, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                block = fh.read(8 << 20)
                if not block:
                    break
                total += len(block)
    return total / (time.perf_counter() - t0)


class InMemory:
    """The in-RAM baseline: every sample in one array, served in ShardData's order."""

    def __init__(self, order):
        import numpy as np

        self.order = order
        m = order.m
        whole = np.empty(m.count, dtype=m.dtype)
        for s in m.shards:  # the whole dataset, resident
            whole[s["first"]:s["first"] + s["count"]] = np.fromfile(m.root / s["file"], dtype=m.dtype)
        self.x = np.ascontiguousarray(whole["features"])
        self.y = np.ascontiguousarray(whole["targets"])

    def batch(self, step, device):
        import torch

        ids = self.order.sample_ids(step)
        return torch.from_numpy(self.x[ids]), torch.from_numpy(self.y[ids])


def worker(mode: str, path: str, steps: int) -> None:
    """One measured run (a fresh process, so its peak RSS is its own); prints a JSON line."""
    import torch

    from parallel.config import DataConfig
    from parallel.data.shards import ShardData
    from parallel.metrics import process_peak_rss

    torch.set_num_threads(1)
    cfg = DataConfig(name="shards", path=path, features=F, targets=T, verify="size")
    order = ShardData(cfg, seed=0, batch_size=BATCH)
    data = order if mode == "shards" else InMemory(order)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(F, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, T))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cpu = torch.device("cpu")
    t0 = None
    for step in range(1, steps + 1):
        if step == 11:
            t0 = time.perf_counter()
        x, y = data.batch(step, cpu)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"samples_per_s": (steps - 10) * BATCH / elapsed, "loss": loss.item(),
                      "rss_peak_bytes": process_peak_rss(),
                      "wait_s": getattr(data, "wait_s", 0.0)}))
    order.close()


def measure(mode: str, path: Path, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "--worker", mode, str(path), str(steps)], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.1,1", help="dataset sizes in GB")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data.json"))
    a = ap.parse_args()
    rows = []
    print(f"{'GB':>5} {'samples':>9} {'cold MB/s':>10} {'warm MB/s':>10} {'pair':>4} {'shards samp/s':>13} "
          f"{'RAM samp/s':>11} {'shards/RAM':>10} {'RSS shards MB':>13} {'RSS RAM MB':>10}")
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        for gb in (float(s) for s in a.sizes.split(",")):
            d = Path(tmp) / f"{gb}GB"
            n = write(d, gb)
            cold = read_bandwidth(d / "shards", cold=True)
            warm = read_bandwidth(d / "shards", cold=False)
            for pair in range(a.pairs):
                s = measure("shards", d / "shards", a.steps)
                r = measure("ram", d / "shards", a.steps)
                row = {"gigabytes": gb, "samples": n, "cold_read_bytes_per_s": cold, "warm_read_bytes_per_s": warm,
                       "pair": pair, "shards": s, "ram": r, "ratio": s["samples_per_s"] / r["samples_per_s"]}
                rows.append(row)
                print(f"{gb:>5} {n:>9,} {cold / 1e6:>10.0f} {warm / 1e6:>10.0f} {pair:>4} "
                      f"{s['samples_per_s']:>13,.0f} {r['samples_per_s']:>11,.0f} {row['ratio']:>10.3f} "
                      f"{s['rss_peak_bytes'] / 1e6:>13.0f} {r['rss_peak_bytes'] / 1e6:>10.0f}", flush=True)
            mine = [r for r in rows if r["gigabytes"] == gb]
            needed = (F + T) * 4 * statistics.median(r["shards"]["samples_per_s"] for r in mine)
            print(f"{gb} GB: median shards / RAM throughput {statistics.median(r['ratio'] for r in mine):.3f} "
                  f"(target >= 0.9); the loop read {needed / 1e6:.0f} MB/s of the disk's {cold / 1e6:.0f} MB/s cold")
    sizes = sorted({r["gigabytes"] for r in rows})
    rss = {gb: statistics.median(r["shards"]["rss_peak_bytes"] for r in rows if r["gigabytes"] == gb) for gb in sizes}
    growth = rss[sizes[-1]] / rss[sizes[0]] - 1
    print(f"peak RSS from shards: {' -> '.join(f'{rss[g] / 1e6:.0f} MB ({g} GB)' for g in sizes)}: "
          f"{growth:+.1%} (target <= +10%)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "rows": rows, "rss_growth": growth,
                                       "median_ratio": {gb: statistics.median(r["ratio"] for r in rows
                                                                                 if r["gigabytes"] == gb)
                                                        for gb in sizes}}, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
