"""Pipeline schedules: the framework vs a hand-written loop, and vs the analytic bound.

    python benchmarks/pipeline.py [--pairs 3] [--m 2,4,8,16] [--mb-rows 96]
                                  [--schedules GPipe,1F1B,Interleaved1F1B,ZBVZeroBubble]

For p=2 ranks and each (schedule, m): the framework (`strategy=pipeline` with
the same split points) and benchmarks/pp_loop.py (PyTorch's schedule driven by
hand) run alternately, --pairs times; the step-time ratio is the median of the
per-pair ratios. A microbatch has --mb-rows rows whatever m (the global batch is
m x mb-rows), so the per-microbatch time stays the same as m grows.

The analytic bound is (v*m + p - 1) x t, with v stages per rank and t the
slowest stage's forward+backward time on one microbatch, measured with the
stage alone in this process (no pipeline, no communication). It is compared
with the framework's whole step (fw/bound: with data, clipping and the
optimizer) and with the schedule's part of it (sched/bound). Prints a table,
writes benchmarks/results/pipeline.json.
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

import torch  # noqa: E402

from benchmarks.pp_loop import stage_times  # noqa: E402
from parallel.strategies.pipeline import partition, schedules  # noqa: E402

P = 2


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def split(a, schedule: str) -> list[int]:
    v = schedules.default_stages_per_rank(schedule)
    return partition.equal_split(a.depth + 2, P * v)  # blocks: inp, depth blocks, head


def block_names(a) -> list[str]:
    return ["inp"] + [f"blocks.{i}" for i in range(a.depth)] + ["head"]


def framework(a, schedule: str, m: int, run_dir: Path) -> dict:
    names = [block_names(a)[i] for i in split(a, schedule)[1:]]
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), f"nproc={P}", "strategy=pipeline",
           f"strategy.schedule={schedule}", f"strategy.microbatches={m}",
           f"strategy.split_points=[{','.join(names)}]", f"model.args.hidden={a.hidden}",
           f"model.args.depth={a.depth}", f"trainer.batch_size={m * a.mb_rows}", f"trainer.steps={a.steps}",
           f"trainer.log_every={a.steps}", "trainer.progress=false", f"run_dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, env=_env(), cwd=ROOT)
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def handwritten(a, schedule: str, m: int) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={P}",
           str(ROOT / "benchmarks" / "pp_loop.py"), f"--hidden={a.hidden}", f"--depth={a.depth}",
           f"--batch={m * a.mb_rows}", f"--steps={a.steps}", f"--schedule={schedule}", f"--microbatches={m}",
           f"--starts={','.join(map(str, split(a, schedule)))}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(), cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])["step_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--m", default="2,4,8,16")
    ap.add_argument("--schedules", default="GPipe,1F1B,Interleaved1F1B,ZBVZeroBubble")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--mb-rows", type=int, default=96, help="rows per microbatch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)  # as each worker runs (OMP_NUM_THREADS=1)
    rows = []
    head = (f"{'schedule':<16} {'m':>3} {'mb ms':>7} {'framework ms':>13} {'hand ms':>9} {'fw/hand':>8} "
            f"{'bound ms':>9} {'fw/bound':>9} {'sched/bound':>11} {'bubble':>7} {'analytic':>8}")
    print(head)
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in a.schedules.split(","):
            v = schedules.default_stages_per_rank(schedule)
            for m in [int(x) for x in a.m.split(",")]:
                fws, hands, last = [], [], None
                for i in range(a.pairs):
                    last = framework(a, schedule, m, Path(tmp) / f"{schedule}-{m}-{i}")
                    fws.append(last["step_time_s"])
                    hands.append(handwritten(a, schedule, m))
                ratio = statistics.median(f / h for f, h in zip(fws, hands))
                chunk = max(stage_times(a.hidden, a.depth, split(a, schedule), a.mb_rows))
                bound = (v * m + P - 1) * chunk
                fw = statistics.median(fws)
                row = {"schedule": schedule, "p": P, "m": m, "stages_per_rank": v, "microbatch_stage_s": chunk,
                       "framework_step_s": fw, "handwritten_step_s": statistics.median(hands),
                       "framework_over_handwritten": ratio, "analytic_bound_s": bound,
                       "framework_over_bound": fw / bound, "schedule_step_s": last["schedule_time_s"],
                       "schedule_over_bound": last["schedule_time_s"] / bound, "bubble_measured": last["bubble_measured"],
                       "bubble_analytic": last["bubble_analytic"],
                       "stage_time_s_in_run": [t / m for t in last["stage_time_s_per_stage"]], "pairs": list(zip(fws, hands))}
                rows.append(row)
                print(f"{schedule:<16} {m:>3} {chunk * 1e3:>7.1f} {fw * 1e3:>13.1f} {row['handwritten_step_s'] * 1e3:>9.1f} "
                      f"{ratio:>8.3f} {bound * 1e3:>9.1f} {fw / bound:>9.3f} {row['schedule_over_bound']:>11.3f} "
                      f"{row['bubble_measured']:>7.3f} "
                      f"{row['bubble_analytic']:>8.3f}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=2))
    print("targets: fw/hand <= 1.02; sched/bound <= 1.05 where mb ms >= 20 (the bound covers the schedule, not the optimizer step)")


if __name__ == "__main__":
    main()
