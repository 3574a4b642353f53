"""Where the framework's own time per step goes: strategy=data on 2 ranks, built up piece by piece from a
hand-written DDP step, alternating.

    python benchmarks/overhead_parts.py [--repeats 8] [--steps 40] [--hidden 512] [--depth 4] [--batch 256]

benchmarks/overhead.py compares whole runs (the framework against benchmarks/ddp_loop.py). This one runs,
in one pair of processes (torchrun, gloo), the same step in rungs, each adding one piece of the framework
to the one before:

    hand        the hand-written step (benchmarks/ddp_loop.py's: DDP, AdamW, LambdaLR, clip_grad_norm_, its
                own data)
    engine      the framework's built run (parallel.trainer.build_run: composable DDP, the loss over the
                global batch, AdamW and its schedule) stepped by hand: engine.forward_backward, engine.clip,
                optimizer.step, zero_grad, scheduler.step, on the hand-written step's data
    data        + the framework's data (run.data.batch: this rank's slice of the step's global batch)
    train_step  parallel.trainer.train_step (the profile's phases, the look-ahead check)
    guard       + the divergence guard (parallel.nonfinite.Guard: the step's loss and gradient norm read and
                checked before the optimizer step, Note [non-finite steps]; on the CPU a read of host memory,
                on CUDA one synchronization)
    loop        parallel.trainer.train: the whole loop a run steps (progress, the memory watch and
                metrics at logged steps, checkpoint and evaluation checks, the preemption agreement), its
                step_time_s (steady steps, as benchmarks/overhead.py reads it)

Each rung trains --steps steps and reports the mean time of its steady steps (all but the first and the
last); rungs run in order, then in reverse, --repeats times. A piece's cost is the median over repeats of
its rung's time minus the rung before it, in the same repeat. The same MLP and batch as
benchmarks/overhead.py. Prints a table, writes benchmarks/results/overhead_parts.json.
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
RUNGS = ("hand", "engine", "data", "train_step", "guard", "loop")
TIMEOUT_S = 600


def steady(times: list[float]) -> float:
    return statistics.fmean(times[1:-1])


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.ddp_loop import hand_step
    from parallel import preemption
    from parallel.config import Config
    from parallel.dims import ParallelDims
    from parallel.nonfinite import Guard
    from parallel.runtime import Runtime
    from parallel.trainer import build_run, train, train_step
    from parallel.validate import validate

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.strategy.name, cfg.strategy.zero = "data", 0
    cfg.model.args = {"hidden": a.hidden, "depth": a.depth}
    cfg.trainer.batch_size, cfg.trainer.steps, cfg.trainer.log_every = a.batch, a.steps, a.steps
    cfg.trainer.progress, cfg.trainer.resume = False, None
    validate(cfg, world)
    cpu = torch.device("cpu")
    run = build_run(cfg, ParallelDims.of(cfg.strategy, world), Runtime(device=cpu))

    guard = Guard(cfg.trainer, Path(tempfile.gettempdir()))  # the run directory is named only when it stops
    hand, hand_data = hand_step(cfg.data.features, cfg.data.targets, a.hidden, a.depth, a.batch, a.steps, rank,
                                world)

    def engine_step(x, y) -> None:
        run.engine.forward_backward(x, y)
        run.engine.clip(cfg.trainer.clip_grad_norm)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()

    steps = {
        "hand": hand,
        "engine": lambda step: engine_step(*hand_data(step)),
        "data": lambda step: engine_step(*run.data.batch(step, cpu)),
        "train_step": lambda step: train_step(run, step),
        "guard": lambda step: train_step(run, step, guard),
    }

    def timed(name: str) -> float:
        if name == "loop":
            with tempfile.TemporaryDirectory() as d:
                d = Path(d) if rank == 0 else None
                paths = [d]
                dist.broadcast_object_list(paths, src=0)
                train(cfg, run, paths[0])
                dist.barrier()
                if rank == 0:
                    return json.loads((paths[0] / "metrics.jsonl").read_text().splitlines()[-1])["step_time_s"]
                return 0.0
        times = []
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            steps[name](step)
            times.append(time.perf_counter() - t0)
        return steady(times)

    results = {name: [] for name in RUNGS}
    with preemption.watching(cfg.trainer.preempt_timeout_s, cfg.trainer.preempt_check_s):
        for repeat in range(a.repeats):
            for name in RUNGS if repeat % 2 == 0 else reversed(RUNGS):
                dist.barrier()
                results[name].append(timed(name))
    if rank == 0:
        print(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overhead_parts.json"))
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker", f"--repeats={a.repeats}", f"--steps={a.steps}", f"--hidden={a.hidden}",
           f"--depth={a.depth}", f"--batch={a.batch}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=TIMEOUT_S).stdout
    results = json.loads(out.strip().splitlines()[-1])
    rows, previous = [], None
    for name in RUNGS:
        t = statistics.median(results[name])
        cost = None if previous is None else statistics.median(
            [b - c for b, c in zip(results[name], results[previous])])
        ratio = statistics.median([b / h for b, h in zip(results[name], results["hand"])])
        rows.append({"rung": name, "step_s": t, "cost_s": cost, "vs_hand": ratio, "times_s": results[name]})
        previous = name
    print(f"strategy=data on 2 ranks, MLP hidden {a.hidden} depth {a.depth}, batch {a.batch}: {a.repeats} "
          f"repeats of {a.steps} steps per rung")
    print(f"{'rung':<11} {'step':>9} {'+cost':>9} {'vs hand':>8}")
    for r in rows:
        cost = "" if r["cost_s"] is None else f"{r['cost_s'] * 1e3:+8.3f}ms"
        print(f"{r['rung']:<11} {r['step_s'] * 1e3:7.3f}ms {cost:>9} {r['vs_hand']:8.3f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": {k: v for k, v in vars(a).items() if k != "worker"},
                                       "rows": rows}, indent=1))
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
