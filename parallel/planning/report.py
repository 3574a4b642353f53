"""What launch/plan.py prints and writes for a planned run: the table of each rank role's bytes, what a CUDA plan
includes and leaves out, the predicted step time and its terms, the largest modules (plan.by_module), and
plan.json with its picture, memory.png (docs/planning.md)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from parallel.config import Config, bf16_run, cuda_run, strategy_spec
from parallel.hardware import gpu_profile
from parallel.memory.budget import budget_bytes
from parallel.pictures.memory import write_memory
from parallel.planning.auto import choose, device_budget, disk_bandwidth, table, write_record
from parallel.planning.cost import calibration_for, describe, replay_for, step_times
from parallel.planning.cuda import BLOCK, LEFT_OUT, cublas_workspace
from parallel.planning.on_profile import report_profile
from parallel.planning.planner import KINDS, plan
from parallel.units import human_bytes


def report(cfg: Config, world: int, run_dir: str, data=None) -> None:
    """Plan `cfg` (validated for `world` ranks; strategy=auto: its candidates first, then the one it picks),
    print the plan and write plan.json and memory.png into `run_dir`; `data`: what was read from the data
    (parallel.data.spec.DataSpec)."""
    found = None
    if strategy_spec(cfg.strategy.name).chooses:  # strategy=auto: plan the candidates, then the one picked
        budget, searched = device_budget(cfg, world), {}
        cfg, found = choose(cfg, world, Path(run_dir), data=data, searched=searched)
        if not searched:  # over a cluster the search printed its own table (Note [auto over a cluster])
            print(table(found, f"budget {human_bytes(budget)} per rank"))
        print(f"written: {write_record(Path(run_dir), found, searched)}")
    plans = plan(cfg, world, by_module=cfg.plan.by_module, data=data)
    os.makedirs(run_dir, exist_ok=True)
    cuda = cuda_run(cfg.trainer.device)
    _print_table(cfg, plans, world, cuda)
    record = {"world_size": world, "strategy": cfg.strategy.name, "device": "cuda" if cuda else "cpu", "ranks": [
        {k: v for k, v in vars(p).items() if k not in ("by_module", "calls", "tally")} for p in plans]}
    if cuda:
        record["cuda"] = _cuda_notes(cfg, plans)
    record["step_time"] = _step_time(cfg, plans, world, run_dir)  # auto's pick: its plan priced with auto's rates
    if found is not None:
        record["auto"] = [vars(c) for c in found]
    if cfg.plan.by_module:
        _print_modules(plans[0], cfg.plan.top)
        record["by_module"] = plans[0].by_module
    hw = gpu_profile(cfg)  # a GPU profile's memory is the budget unless one is given
    for path in _write(run_dir, record, budget_bytes(cfg.memory) or (hw.memory_bytes if hw is not None else None)):
        print(f"written: {path}")


def _print_table(cfg: Config, plans: list, world: int, cuda: bool) -> None:
    head = f"{'rank':>4}  {'ranks alike':<12}" + "".join(f"{k:>12}" for k in KINDS) + f"{'total':>12}  peak in"
    print(f"plan{' for CUDA' if cuda else ''}: strategy={cfg.strategy.name} model={cfg.model._target_ or cfg.model.name}"
          f" nproc={world} batch_size={cfg.trainer.batch_size} ("
          + ("bytes the CUDA caching allocator holds at each rank's peak, as torch.cuda.max_memory_allocated counts"
             if cuda else "bytes of live tensors at each rank's peak") + ")")
    print(head)
    for p in plans:
        where = p.peak_phase + (f" ({p.peak_module})" if p.peak_module else "")
        print(f"{p.rank:>4}  {_ranks(p.same_as):<12}" + "".join(f"{human_bytes(getattr(p, k)):>12}" for k in KINDS)
              + f"{human_bytes(p.total):>12}  {where}")


def _print_modules(first, top: int) -> None:
    """plan.by_module: the `top` modules of the first rank role holding the most, largest first."""
    rows = first.by_module[:top]
    if not rows:
        return
    print(f"\nby module, rank {first.rank} (own parameters, saved for backward, forward temporaries), "
          f"largest first:")
    width = max(len(r["name"]) for r in rows)
    print(f"{'module':<{width}}  {'type':<20}{'params':>12}{'saved':>12}{'temp':>12}{'total':>12}")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['type'][:19]:<20}{human_bytes(r['params']):>12}{human_bytes(r['saved']):>12}"
              f"{human_bytes(r['temp']):>12}{human_bytes(r['total']):>12}")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    text = ",".join(map(str, ranks))
    return text if len(text) <= 16 else text[:13] + "..."


def _step_time(cfg, plans, world: int, run_dir: str) -> dict:
    """Print the step time the cost model predicts for the plan (Note [cost model] in parallel/planning/cost.py), its
    terms and the rates it used; the same for plan.json."""
    offloads = strategy_spec(cfg.strategy.name).offloads
    disk = disk_bandwidth(Path(cfg.strategy.path or run_dir)) if offloads else None
    hw = gpu_profile(cfg)
    if hw is not None:  # priced on the profile from the plan's work, nothing replayed (Note [step time on a profile])
        return report_profile(cfg, plans, world, hw, disk)
    cal = calibration_for(cfg, world)
    replay = replay_for(cfg, cal, world)
    t = step_times(cfg, plans, cal, world, disk, replay)
    print(f"step time: predicted {t['step'] * 1e3:.1f} ms: compute {t['compute'] * 1e3:.1f} (matrix products "
          f"{t['products'] * 1e3:.1f}, memory-bound ops {t['memory'] * 1e3:.1f}, per-op and per-step costs "
          f"{t['ops'] * 1e3:.1f}), bubble {t['bubble'] * 1e3:.1f}, comm {t['comm'] * 1e3:.1f}, transfers "
          f"{t['transfers'] * 1e3:.1f} ms\nstep time: " + ("op calls timed here, " if replay else "")
          + f"rates {describe(cal)}")
    return {"predicted_s": t, "calibration": cfg.plan.calibration, "rates": describe(cal),
            "calls_timed_here": replay is not None}


def _cuda_notes(cfg, plans) -> dict:
    """Print what a CUDA plan includes and leaves out (Note [planning for CUDA]); the same for plan.json."""
    workspace, source = cublas_workspace()
    worst = max(plans, key=lambda p: p.total)
    precision = "bf16 autocast" if bf16_run(cfg) else "fp32"
    pinned = max(p.host_pinned for p in plans)
    print(f"CUDA, included: {precision}; the caching allocator's {BLOCK}-byte rounding (+{human_bytes(worst.rounding)} "
          f"at rank {worst.rank}'s peak); cuBLAS workspaces of {workspace / 2**20:.1f} MiB, one per thread that runs "
          f"matrix products ({human_bytes(worst.workspaces)} at that peak; {source}); the optimizer's foreach "
          f"temporaries" + (f"; offload's pinned host memory, {human_bytes(pinned)} (the host's, not in total)"
                           if pinned else ""))
    for p in plans:  # the caching allocator's segments (Note [caching allocator] in parallel/planning/allocator.py)
        print(f"CUDA, reserved: rank {p.rank}: {human_bytes(p.reserved)} (torch.cuda.max_memory_reserved; "
              f"{human_bytes(p.reserved - p.total)} cached over the total), {human_bytes(p.reserved_expandable)} with "
              f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; memory.budget is checked against it")
    print(f"CUDA, left out: {', '.join(LEFT_OUT)}: leave room for them under memory.budget")
    ops = {}
    for p in plans:
        for name, n in p.fp32_on_cuda.items():
            ops[name] = max(ops.get(name, 0), n)
    if ops:
        print("CUDA, autocast: calls given bf16 tensors that CUDA's autocast runs in fp32 (the CPU's would not), "
              "planned so: " + ", ".join(f"{name} x{n}" for name, n in sorted(ops.items())))
    return {"precision": precision, "allocator_block": BLOCK, "cublas_workspace": workspace,
            "cublas_workspace_from": source, "host_pinned": pinned, "fp32_on_cuda": ops, "left_out": LEFT_OUT}


def _write(run_dir: str, record: dict, budget: int | None) -> list[str]:
    """plan.json and its picture, memory.png (parallel.pictures.memory), into `run_dir`; their paths."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "plan.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    ranks = record["ranks"]
    labels = [f"rank {p['rank']}" if p["same_as"] == [p["rank"]] else f"ranks {_ranks(p['same_as'])}" for p in ranks]
    cuda = record.get("device") == "cuda"
    picture = write_memory(os.path.join(run_dir, "memory.png"), labels, {k: [p[k] for p in ranks] for k in KINDS},
                           budget, f"plan{' for CUDA' if cuda else ''}: strategy={record['strategy']} nproc="
                           f"{record['world_size']}\n" + ("CUDA memory allocated" if cuda else "live tensors")
                           + " at each rank's peak")
    return [path, str(picture)]
