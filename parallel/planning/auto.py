"""strategy=auto: plan every candidate way to spread the model, keep those that fit, run the fastest.

# Note [auto]
Candidates for W workers (the other strategy keys keep their defaults):
    W = 1   single; offload with activations on the device, recomputed
            (checkpoint) or on the tier below
    W > 1   data with zero 0, 1, 2, 3, and zero 3 sharded within groups of
            W / R ranks for each divisor 1 < R < W of W (hybrid sharding,
            strategy.dp_replicate=R: Note [hybrid sharding] in parallel/dims.py);
            model (tensor parallel over W); pipeline
            over W (balanced by parameters, so the run cuts where the plan did);
            hybrid for every factorization of W into two degrees: dp x pp,
            dp x tp and dp x cp, each with zero 0 and 3; context (cp over W)
            for a causal transformer (long sequences in small batches); for a
            model with mixture-of-experts layers also expert parallelism: ep
            over W and dp x ep, with zero 0 and 3 (the plan holds each rank's
            experts and sends a balanced share of the tokens through the
            real all-to-alls, Note [moe layer]). Every candidate with a
            pipeline is tried with m = p, 2p and 4p microbatches (p pipeline
            ranks) unless strategy.microbatches is given.
    any     a candidate (not offload) over the budget is tried again with its
            activations recomputed per block (strategy.activations=checkpoint):
            more compute for less memory, worth it only when it makes a plan fit.
            A recomputed candidate that fits is tried once more with selective
            recomputation (strategy.activations=selective, the products' outputs
            saved: Note [selective recomputation]), which keeps more than
            checkpoint and recomputes far fewer FLOPs: it runs when it fits too
            and prices faster. Tried after checkpoint, not before it: a
            candidate that checkpoint cannot fit costs no second plan, so the
            plans added are one per candidate that recomputation makes fit.
Each is validated (a candidate the model cannot take, say tensor parallelism on
a model with no Linear pairs, is dropped with the reason) and planned
(parallel.planning.planner: its peak per rank, and the work of its step). Those whose
largest rank peak exceeds `memory.budget` are dropped; a CUDA run's peak is the
memory its caching allocator reserves (max_memory_reserved, Note [caching
allocator] in parallel/planning/allocator.py), what the GPU must hold. The rest are ranked by
the step time parallel.planning.cost predicts (Note [cost model]): the plan's work
(Note [step work]) priced with the rates of plan.calibration (a
calibration.json of launch/calibrate.py, Note [calibration]), else with this
process's measured at start. The table shows every term: compute, bubble,
comm, transfers (offload's disk bytes / the disk bandwidth measured at start)
and their sum. A run started by auto logs the prediction beside the measured
step time (metrics.jsonl predicted_step_time_s, read from the run's auto.json:
parallel.throughput.auto_prediction), so every run shows the model's error.

Expert parallelism's all-to-alls are in comm as the planned step makes them
(the balanced stand-in runs the shard's own exchange, Note [moe layer]): per
MoE layer and step, the tokens go to their experts' ranks and come back
(dispatch, combine) and their gradients go the same two ways in backward,
each a rank's n x k rows of d elements of b bytes less the 1/ep of them
that stays on the rank (its own experts' share of a balanced router):

    4 x n x k x d x b x (ep - 1) / ep   plus   E x 8 x (ep - 1) / ep

n the tokens the rank routes in the step (its share of the batch x the
sequence length), k = top_k, d the model width, E the experts; the second
term is the all-to-all of the counts (int64 per expert) before each
dispatch. With the moe defaults under ep 2 (n = 16 x 32, k 2, d 64, fp32,
2 layers): 1.05 MB a step. Blocks recomputed in backward run their forward's
two again (6 x instead of 4 x). Context parallelism's exchange is counted by
the same rules: per attention layer the rank's keys and values all-gathered
in forward and again in backward ((cp - 1) x its chunk each) and the
gradients of all cp chunks all-reduced (2 (cp - 1) / cp x them). plan.json
gives the all-to-alls' part of comm_bytes as all_to_all_bytes.

The bytes of comm_bytes count what leaves the rank under the ring algorithms
(Note [comm bytes]); the cost model prices each call by what it is handed.

With a GPU profile and more workers than one of its nodes holds, the list
above is not what is tried: every layout dp x tp x pp x cp of the world is
enumerated, screened by a lower bound on its memory, ordered by an estimate
and the most promising planned within plan.auto_plans and
plan.auto_deadline_s (Note [auto over a cluster] in
parallel/planning/cluster.py); auto.json then holds what the search did
(`search`) beside the planned candidates.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from parallel.config import Config, ConfigError, cuda_run, fail, strategy_spec
from parallel.hardware import gpu_profile
from parallel.memory.budget import budget_bytes
from parallel.models.build import build_meta_model
from parallel.pictures.candidates import write_candidates
from parallel.planning.allocator import held
from parallel.planning.cluster import applies, search, summary_text
from parallel.planning.cost import calibration_for, describe, replay_for, step_times
from parallel.planning.layouts import Candidate, apply_overrides
from parallel.planning.on_profile import describe_profile, profile_times
from parallel.planning.planner import plan
from parallel.strategies.expert import has_experts
from parallel.validate import validate


def candidates(world: int, microbatches: int | None = None, experts: bool = False) -> list[Candidate]:
    """The strategies tried for `world` workers (Note [auto]); `microbatches`: the user's, when given;
    `experts`: the model has mixture-of-experts layers (expert parallelism is tried too)."""
    if world == 1:
        return [Candidate("single", ["strategy=single"])] + [
            Candidate(f"offload, activations {a}", ["strategy=offload", f"strategy.activations={a}"])
            for a in ("device", "checkpoint", "auto")]

    def pipelined(name: str, overrides: list[str], pp: int) -> list[Candidate]:
        if microbatches is not None:
            return [Candidate(name, overrides)]
        return [Candidate(f"{name} m{m}", [*overrides, f"strategy.microbatches={m}"]) for m in (pp, 2 * pp, 4 * pp)]

    out = [Candidate(f"data zero {z}", ["strategy=data", f"strategy.zero={z}"]) for z in range(4)]
    # Hybrid sharding: R replicas of a zero 3 group; R = W would shard over groups of one rank (zero 0's memory).
    out += [Candidate(f"data zero 3 dp_replicate {r}", ["strategy=data", "strategy.zero=3",
                                                        f"strategy.dp_replicate={r}"])
            for r in range(2, world) if world % r == 0]
    out.append(Candidate(f"model tp{world}", ["strategy=model"]))
    # Context parallelism: each sequence split over the ranks; it applies to a causal transformer on token
    # sequences (validate drops it for other models), and is what fits when a batch of long sequences is too
    # small to split over data-parallel ranks.
    out.append(Candidate(f"context cp{world}", ["strategy=context"]))
    out += pipelined(f"pipeline pp{world}", ["strategy=pipeline", "strategy.balance=params"], world)
    for a in range(2, world):
        if world % a:
            continue
        b = world // a
        for z in (0, 3):
            common = ["strategy=hybrid", f"strategy.dp={a}", f"strategy.zero={z}"]
            out += pipelined(f"hybrid dp{a} x pp{b} zero {z}",
                             [*common, f"strategy.pp={b}", "strategy.balance=params"], b)
            out.append(Candidate(f"hybrid dp{a} x tp{b} zero {z}", [*common, f"strategy.tp={b}"]))
            out.append(Candidate(f"hybrid dp{a} x cp{b} zero {z}", [*common, f"strategy.cp={b}", "strategy.pp=1"]))
            if experts:
                out.append(Candidate(f"hybrid dp{a} x ep{b} zero {z}", [*common, f"strategy.ep={b}"]))
    if experts:
        out += [Candidate(f"expert ep{world} zero {z}", ["strategy=expert", f"strategy.zero={z}"]) for z in (0, 3)]
    return out


def recomputed(cand: Candidate) -> Candidate | None:
    """`cand` with its activations recomputed per block, for a candidate over the budget (None for offload,
    which tries its own activation tiers, and for one already recomputing)."""
    if strategy_spec(_strategy(cand)).offloads or any(o.startswith("strategy.activations=") for o in cand.overrides):
        return None
    return Candidate(f"{cand.name}, recompute", [*cand.overrides, "strategy.activations=checkpoint"])


def selective(cand: Candidate) -> Candidate | None:
    """`cand`, recomputed per block (`recomputed`) and within the budget, with selective recomputation instead
    (Note [auto]); None for any other candidate."""
    checkpoint = "strategy.activations=checkpoint"
    if strategy_spec(_strategy(cand)).offloads or checkpoint not in cand.overrides:
        return None
    return Candidate(cand.name.replace(", recompute", ", selective"),
                     [o if o != checkpoint else "strategy.activations=selective" for o in cand.overrides])


def _strategy(cand: Candidate) -> str:
    """The name of the strategy a candidate runs (its `strategy=NAME` override)."""
    return next(o.partition("=")[2] for o in cand.overrides if o.startswith("strategy="))


def device_budget(cfg: Config, world: int) -> int:
    """memory.budget, or the device's memory: a GPU's, or on the CPU this machine's RAM shared by the workers.
    A CUDA run planned on a host without a GPU (Note [planning for CUDA]) needs memory.budget."""
    if cfg.memory.budget is not None:
        return budget_bytes(cfg.memory)
    if gpu_profile(cfg) is not None:  # the profile's memory (Note [hardware profiles])
        return cfg.hardware.memory_bytes
    if cuda_run(cfg.trainer.device):
        if not torch.cuda.is_available():
            fail("memory.budget", None, "planning a CUDA run on a host without a GPU needs the GPU's memory",
                 ["e.g. 80GB (H100)", "141GB (H200)"])
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world


def disk_bandwidth(directory: Path, nbytes: int = 64 << 20) -> float:
    """Bytes/s of writing then reading back a file in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    path, block = directory / ".auto-bandwidth", os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes >> 20):
            f.write(block)
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    elapsed = time.perf_counter() - t0
    path.unlink()
    return 2 * nbytes / elapsed


def choose(cfg: Config, world: int, run_dir: Path, progress=print, data=None,
           searched: dict | None = None) -> tuple[Config, list[Candidate]]:
    """The fastest candidate that fits; every candidate with its figures or the reason it was dropped (`data`:
    what was read from the data, parallel.data.spec.DataSpec). Over a cluster (Note [auto over a cluster]) the
    layouts searched instead, and `searched` filled with what the search did.

    Raises:
        ConfigError: when no candidate fits the budget (naming the smallest peak).
    """
    budget = device_budget(cfg, world)
    hw = gpu_profile(cfg)  # a GPU profile prices each candidate from its work (Note [step time on a profile])
    if applies(world, hw):
        progress(f"auto: budget {budget / 2**30:.1f} GiB per rank of CUDA memory; rates {describe_profile(hw)}")
        found, summary = search(cfg, world, run_dir, budget, hw, progress, data)
        progress(summary_text(summary, budget))
        if searched is not None:
            searched.update(summary)
        return _picked(cfg, found, budget, world, data), found
    cal = calibration_for(cfg, world) if hw is None else None
    replay = replay_for(cfg, cal, world) if hw is None else None
    disk = disk_bandwidth(Path(run_dir)) if world == 1 else None
    progress(f"auto: budget {budget / 1e6:.1f} MB per rank{' of CUDA memory' if cuda_run(cfg.trainer.device) else ''}; "
             f"rates {describe(cal) if hw is None else describe_profile(hw)}"
             + (f"; disk {disk / 1e9:.2f} GB/s" if disk else ""))
    quiet = logging.getLogger("parallel")
    level = quiet.level
    found = candidates(world, cfg.strategy.microbatches, experts=has_experts(build_meta_model(cfg.model)))
    i = 0
    while i < len(found):  # recomputed variants join the list as candidates exceed the budget (then fit)
        cand = found[i]
        i += 1
        c = apply_overrides(cfg, cand.overrides)
        c.run_dir = str(run_dir)
        quiet.setLevel(logging.WARNING)  # the strategies' own build messages, once per candidate
        try:
            validate(c, world, data)
            plans = plan(c, world, data=data)
        except ConfigError as e:
            cand.dropped = f"does not apply: {e}"
        except Exception as e:  # noqa: BLE001 - a candidate the planner cannot take is one option less
            cand.dropped = f"could not be planned: {type(e).__name__}: {e}"
        finally:
            quiet.setLevel(level)
        if cand.dropped is None:
            cand.peak = max(held(p) for p in plans)  # a CUDA plan's reserved memory: Note [caching allocator]
            cand.times = step_times(c, plans, cal, world, disk, replay) if hw is None else \
                profile_times(c, plans, world, hw, disk)
            if cand.peak > budget:
                cand.dropped = f"peak {cand.peak / 1e6:.2f} MB > budget {budget / 1e6:.2f} MB"
                again = recomputed(cand)
            else:
                again = selective(cand)
            if again is not None:
                found.append(again)
        state = cand.dropped or f"peak {cand.peak / 1e6:.2f} MB, step {cand.times['step'] * 1e3:.1f} ms"
        progress(f"auto: [{i}/{len(found)}] {cand.name}: {state}")
    found = sorted(found, key=lambda c: (c.dropped is not None, c.times.get("step", 0)))
    return _picked(cfg, found, budget, world, data), found


def _picked(cfg: Config, found: list[Candidate], budget: int, world: int, data) -> Config:
    """The config of the first of `found` (ranked) that fits, validated; a ConfigError when none does."""
    fits = [c for c in found if c.dropped is None]
    if not fits:
        _none_fits(cfg, found, budget)
    chosen = apply_overrides(cfg, fits[0].overrides)
    chosen.run_dir = cfg.run_dir
    validate(chosen, world, data)
    return chosen


def write_record(run_dir: Path, found: list[Candidate], searched: dict | None = None) -> Path:
    """auto.json: the pick's overrides and predicted step, every candidate (and over a cluster what the search
    did, `search`); the run logs the prediction beside its measured step (parallel.throughput.auto_prediction)."""
    picked = next(c for c in found if c.dropped is None)
    record = {"chosen": picked.overrides, "predicted_step_time_s": picked.times["step"],
              "candidates": [vars(c) for c in found]}
    if searched:
        record["search"] = searched
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    path = Path(run_dir, "auto.json")
    path.write_text(json.dumps(record, indent=2))
    return path


def _none_fits(cfg: Config, found: list[Candidate], budget: float) -> None:
    """Raise the ConfigError of a search where no candidate fits: the smallest peak planned, or why none was."""
    planned = [c for c in found if c.peak is not None]
    if not planned:
        raise ConfigError("strategy=auto: no candidate could be planned "
                          f"({'; '.join(f'{c.name}: {c.dropped}' for c in found)})")
    smallest = min(planned, key=lambda c: c.peak)
    raise ConfigError(f"memory.budget={cfg.memory.budget or f'{budget} (the device)'}: no plan fits; the "
                      f"smallest is {smallest.name} ({' '.join(smallest.overrides)}) needing "
                      f"{smallest.peak / 1e6:.2f} MB per rank")


def table(found: list[Candidate], budget_note: str = "") -> str:
    """The ranked candidates as text, every term of the cost model (Note [cost model]): the chosen one first.
    compute = matmul (matrix products) + mem (memory-bound ops) + ops (per-op and per-step costs)."""
    cols = [("peak MB", 9), ("matmul", 8), ("mem", 7), ("ops", 7), ("compute", 9), ("bubble", 8), ("comm", 7),
            ("io", 6), ("step ms", 9)]
    lines = [f"{'':2}{'candidate':<34}" + "".join(f"{name:>{w}}" for name, w in cols) + f"  {budget_note}"]
    keys = ("products", "memory", "ops", "compute", "bubble", "comm", "transfers", "step")
    for i, c in enumerate(found):
        mark = "->" if i == 0 and c.dropped is None else "  "
        if c.times:
            values = [f"{c.peak / 1e6:>9.2f}"] + [f"{c.times.get(k, 0.0) * 1e3:>{w}.1f}" for k, (_, w) in
                                                   zip(keys, cols[1:])]
            lines.append(f"{mark}{c.name:<34}" + "".join(values) + f"  {c.dropped or ''}")
        else:
            lines.append(f"{mark}{c.name:<34}{'-':>9}{'':>{sum(w for _, w in cols[1:])}}  {c.dropped}")
    return "\n".join(lines)


def chart(found: list[Candidate], budget: int, path: Path) -> Path:
    """The ranked candidates (as `choose` returns them) drawn as auto.png at `path`
    (parallel.pictures.candidates): the planned ones, the chosen one marked."""
    planned = [c for c in found if c.times]
    fits = [c.dropped is None for c in planned]
    return write_candidates(path, [c.name for c in planned], [c.times for c in planned],
                            [c.peak for c in planned], fits, fits.index(True) if any(fits) else None, budget,
                            skipped=len(found) - len(planned))
