"""Loading a user's dataset: data=custom on 2 ranks vs a hand-written DataLoader + DistributedSampler loop,
alternating; or (--mode stream) a stream read whole by every rank vs the same stream split into shards.

    python benchmarks/dataloading.py [--pairs 7] [--steps 40] [--workers 1] [--rounds 2]
    python benchmarks/dataloading.py --mode stream [--shards 4] [--workers 2] [--pairs 5]

Both sides train the same MLP (strategy=data strategy.zero=0 against a hand-written DDP loop) on the same
map-style dataset (benchmarks/costly_data.py), whose samples cost real CPU time to make, loaded by
`--workers` loader processes a rank, `--prefetch` batches ahead each. Each side reports its mean step time
and its mean wait for a batch (`data_time_s`) over steps 2..N-1. Runs alternate A B A B ... in fresh
processes and the figure is the median of the per-pair throughput ratios (framework / hand-written), since
timings on a shared machine drift. Prints a table and writes benchmarks/results/dataloading.json. Targets:
ratio >= 0.95, and data_time_s near zero when the loader processes keep up with the step.

--mode stream: both sides are the framework (strategy=data strategy.zero=0, 2 ranks) on the same costly
samples as a stream (benchmarks/costly_data.py `costly_stream`): before, a stream without `shard` (each rank
reads every sample in one loader process and keeps its half); after, the same samples in `--shards` shards
(each rank reads only its own shards, in up to `--workers` loader processes). The figure is the median of
the per-pair throughput ratios (split / whole); it writes benchmarks/results/dataloading_stream.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def framework(a, run_dir: Path, data: tuple = ("data._target_=benchmarks.costly_data.costly",)) -> dict:
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "nproc=2", "strategy=data", "strategy.zero=0",
           "data=custom", *data, f"+data.args.rounds={a.rounds}",
           f"data.workers={a.workers}", f"data.prefetch={a.prefetch}", f"model.args.hidden={a.hidden}",
           f"model.args.depth={a.depth}", f"trainer.batch_size={a.batch}", f"trainer.steps={a.steps}",
           f"trainer.log_every={a.steps}", "trainer.progress=false", f"run_dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, env=_env(), cwd=ROOT)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return {"step_time_s": last["step_time_s"], "data_time_s": last["data_time_s"]}


def handwritten(a) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "benchmarks" / "dataloading_loop.py"), f"--hidden={a.hidden}", f"--depth={a.depth}",
           f"--batch={a.batch}", f"--steps={a.steps}", f"--workers={a.workers}", f"--prefetch={a.prefetch}",
           f"--rounds={a.rounds}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(), cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def streams(a) -> None:
    """--mode stream: the stream read whole by every rank vs split into shards, alternating pairs."""
    from benchmarks.costly_data import costly, sample_cost_s

    cost = sample_cost_s(costly(rounds=a.rounds))
    print(f"one sample: {cost * 1e3:.3f} ms to make; a global batch of {a.batch}: {cost * a.batch * 1e3:.1f} ms "
          f"in one process; {a.shards} shards, {a.workers} loader workers a rank; {os.cpu_count()} CPU cores")
    print(f"{'pair':>4} {'whole samples/s':>16} {'data_time_s':>12} {'split samples/s':>16} {'data_time_s':>12} "
          f"{'ratio':>7}")
    rows = []
    stream = "data._target_=benchmarks.costly_data.costly_stream"
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.pairs):
            whole = framework(a, Path(tmp) / f"whole{i}", (stream, "+data.args.shards=1"))
            split = framework(a, Path(tmp) / f"split{i}", (stream, f"+data.args.shards={a.shards}"))
            ws, ss = a.batch / whole["step_time_s"], a.batch / split["step_time_s"]
            rows.append({"pair": i, "whole": whole, "split": split, "whole_samples_per_s": ws,
                         "split_samples_per_s": ss, "ratio": ss / ws})
            print(f"{i:>4} {ws:>16.1f} {whole['data_time_s']:>12.4f} {ss:>16.1f} {split['data_time_s']:>12.4f} "
                  f"{ss / ws:>7.3f}", flush=True)
    median = statistics.median(r["ratio"] for r in rows)
    print(f"median split / whole throughput: {median:.3f}")
    result = {"config": vars(a), "sample_cost_s": cost, "cpu_cores": os.cpu_count(), "pairs": rows,
              "median_ratio": median}
    out = Path(a.out or ROOT / "benchmarks" / "results" / "dataloading_stream.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["loop", "stream"], default="loop",
                    help="loop: vs a hand-written loop; stream: a stream read whole vs split into shards")
    ap.add_argument("--shards", type=int, default=4, help="--mode stream: the split stream's shards")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="the work per sample (benchmarks/costly_data.py)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/dataloading[_stream].json")
    a = ap.parse_args()
    if a.mode == "stream":
        streams(a)
        return
    a.out = a.out or str(ROOT / "benchmarks" / "results" / "dataloading.json")
    from benchmarks.costly_data import costly, sample_cost_s

    cost = sample_cost_s(costly(rounds=a.rounds))
    print(f"one sample: {cost * 1e3:.3f} ms to make; a rank's batch of {a.batch // 2}: "
          f"{cost * a.batch / 2 * 1e3:.1f} ms in one process; {os.cpu_count()} CPU cores")
    rows = []
    print(f"{'pair':>4} {'framework samples/s':>20} {'data_time_s':>12} {'hand samples/s':>15} "
          f"{'data_time_s':>12} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.pairs):
            f = framework(a, Path(tmp) / f"run{i}")
            h = handwritten(a)
            fs, hs = a.batch / f["step_time_s"], a.batch / h["step_time_s"]
            rows.append({"pair": i, "framework": f, "handwritten": h, "framework_samples_per_s": fs,
                         "handwritten_samples_per_s": hs, "ratio": fs / hs})
            print(f"{i:>4} {fs:>20.1f} {f['data_time_s']:>12.4f} {hs:>15.1f} {h['data_time_s']:>12.4f} "
                  f"{fs / hs:>7.3f}", flush=True)
    median = statistics.median(r["ratio"] for r in rows)
    data_f = statistics.median(r["framework"]["data_time_s"] for r in rows)
    data_h = statistics.median(r["handwritten"]["data_time_s"] for r in rows)
    print(f"median framework / hand-written throughput: {median:.3f} (target >= 0.95); median data_time_s: "
          f"framework {data_f:.4f}, hand-written {data_h:.4f}")
    result = {"config": vars(a), "sample_cost_s": cost, "cpu_cores": os.cpu_count(), "pairs": rows,
              "median_ratio": median, "median_data_time_s": {"framework": data_f, "handwritten": data_h},
              "target": 0.95}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
