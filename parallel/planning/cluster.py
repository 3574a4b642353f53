"""strategy=auto over a cluster: every layout enumerated, screened by a bound, ordered by an estimate, the most
promising planned within a deadline, ranked by the planned step on the GPU profile.

# Note [auto over a cluster]
With a GPU profile (`hardware=NAME`) and more workers than a node holds
(`nproc` > devices_per_node), auto's candidates are not Note [auto]'s list
but every layout of the world (parallel.planning.layouts): dp x tp x pp x cp
= W with tp a divisor of a node's devices (its all-reduces stay on NVLink);
dp with zero 0-3 and zero 3 in R replicas (strategy.dp_replicate, each
divisor 1 < R < dp); pp with every schedule PyTorch's pipelining has
(parallel.strategies.pipeline.schedules.SCHEDULES), 2 and 4 stages per rank
for the interleaved and looped ones (2 for the V-shaped), m = p, 2p, 4p
microbatches (or strategy.microbatches); each with the activations kept,
recomputed selectively or recomputed per block. The model's rules are
applied before anything is built: tp divides the attention's head counts,
pp x stages per rank at most the blocks, dp the batch and the microbatches
the per-rank batch, 2 x cp the sequence, the schedule's own
(schedules.check). Those ruled out are counted by reason. A layout with tp > 1
and neither pp nor cp runs with sequence and loss parallelism (strategy.
sequence_parallel, strategy.loss_parallel, as torchtitan's tensor parallelism
does) where the model's plan takes them, probed once (`_cuts_sequence`): its
residual stream and logits then count 1/tp on a rank.

Then, per layout, arithmetic only (parallel.planning.screen):
    bound     bytes some rank must hold whatever the planner finds: at the
              optimizer's step the weights, gradients and optimizer state
              (Adam's two moments) sharded as the layout shards them and
              spread over tp x pp as evenly as can be; at the end of a
              forward the weights, the optimizer state, one microbatch's
              saved block inputs (two per block with activations kept) at
              2 bytes an element and the last stage's logits in bf16. A
              layout whose bound exceeds memory.budget is dropped unplanned.
    estimate  of the peak (the activations a pipeline keeps in flight, fp32
              logits with their gradient, a gathered block under zero 3)
              and of the step: the model's FLOPs (parallel.throughput
              .model_flops, counted once) over the world at 60% of the
              profile's peak, x 4/3 recomputed per block, x 1.05 selective,
              the pipeline's bubble (analytic_bubble), tp's all-reduces and
              cp's exchanges waited whole and the data-parallel reduction
              beside the compute, each priced by the collective model over
              the nodes its group spans (Note [collective model]).
The layouts left are planned (validate, then parallel.planning.planner's full
plan: roles alike planned once, Note [planner]; priced on the profile, Note
[step time on a profile]) in the order of the estimate, those estimated to fit
first, until `plan.auto_plans` plans or `plan.auto_deadline_s` seconds: a plan
is not started when the mean time of plans of its kind (traced by depth, or
whole: Note [planning by depth]) would pass the deadline. A layout is skipped
unplanned when a plan already says how it ends: the same degrees, schedule and
microbatches over the budget (or refused by the pipeline's split, no stage
split within the budget) with no more memory (a zero at least as high with
no more replicas, a policy keeping no less), or fitting with a policy that
recomputes less. The planned are ranked by the step the plan prices; the top
ten are printed with their reserved memory, step, tokens/s per device and MFU,
and the counts of what was refused, screened out, skipped, dropped and why
(auto.json: `search`).
"""
from __future__ import annotations

import logging
import time
from collections import Counter

from parallel.config import Config, ConfigError, HardwareConfig
from parallel.data import example_input
from parallel.dims import ParallelDims
from parallel.models.build import build_meta_model
from parallel.planning.allocator import held
from parallel.planning.depth import traced_whole
from parallel.planning.layouts import POLICIES, Candidate, Layout, ModelShape, apply_overrides, enumerate_layouts
from parallel.planning.on_profile import profile_times
from parallel.planning.planner import plan
from parallel.planning.screen import estimate
from parallel.strategies.tensor import check_loss_parallel, resolve_plan
from parallel.tensors import as_call
from parallel.throughput import model_flops
from parallel.units import human_bytes
from parallel.validate import validate

TOP = 10  # rows of the table printed


def applies(world: int, hw: HardwareConfig | None) -> bool:
    """Whether auto searches layouts (Note [auto over a cluster]): a GPU profile and more workers than a node."""
    return hw is not None and world > hw.devices_per_node


def search(cfg: Config, world: int, run_dir, budget: int, hw: HardwareConfig, progress=print,
           data=None) -> tuple[list[Candidate], dict]:
    """The planned candidates, ranked (fitting first, by the planned step), and what the search did (counts by
    reason, timings, the top rows) for auto.json (Note [auto over a cluster])."""
    t0 = time.perf_counter()
    model = build_meta_model(cfg.model)
    shape = ModelShape.of(model, cuts_sequence=_cuts_sequence(model, cfg, data))
    flops = model_flops(cfg, data)
    layouts, refused = enumerate_layouts(world, shape, cfg, hw.devices_per_node)
    screened, kept = Counter(), []
    for lay in layouts:
        est = estimate(lay, shape, cfg, hw, flops)
        if est.bound > budget:
            screened[f"bound over the budget (zero {lay.zero}, {lay.activations})"] += 1
        else:
            kept.append((lay, est))
    kept.sort(key=lambda le: (le[1].peak > budget, le[1].step))
    progress(f"auto: {len(layouts)} layouts of {world} ranks ({sum(refused.values())} ruled out by the model's "
             f"rules), {sum(screened.values())} over the budget by their bound; planning the most promising "
             f"of {len(kept)} (at most {cfg.plan.auto_plans} plans, {cfg.plan.auto_deadline_s:.0f} s) "
             f"[{time.perf_counter() - t0:.1f} s]")
    found, skipped = _plan_in_order(cfg, world, run_dir, budget, hw, kept, data, progress, t0)
    fits = sorted((c for c in found if c.dropped is None), key=lambda c: c.times["step"])
    ranked = fits + [c for c in found if c.dropped is not None]
    dropped = Counter(c.dropped.split(":")[0] if not c.dropped.startswith("peak") else "planned peak over the budget"
                      for c in found if c.dropped)
    summary = {"layouts": len(layouts), "refused": dict(refused), "screened_out": dict(screened),
               "planned": len(found), "fit": len(fits), "dropped": dict(dropped), "skipped": dict(skipped),
               "seconds": time.perf_counter() - t0,
               "top": [_row(c, cfg, world, hw, flops) for c in fits[:TOP]]}
    return ranked, summary


def _cuts_sequence(model, cfg: Config, data) -> bool:
    """Whether a tensor-parallel layout runs with sequence and loss parallelism: the model's plan (at tp 2) takes
    both, and the loss is the built-in cross-entropy (Note [loss parallelism])."""
    try:
        check_loss_parallel(apply_overrides(cfg, ["strategy=model", "strategy.loss_parallel=true"]))
        resolve_plan(model, 2, cfg.strategy.tp_plan, True, as_call(example_input(cfg.data, spec=data))[0], True)
    except ConfigError:
        return False
    return True


def _plan_in_order(cfg, world, run_dir, budget, hw, kept, data, progress, t0) -> tuple[list[Candidate], Counter]:
    """Plan `kept` (layouts with their estimates) best first, the estimate corrected by each plan, until the
    limit or the deadline; the planned candidates and the counts of those skipped, by reason."""
    state = _State(budget)
    pending, learnt = list(kept), True
    while pending:
        if learnt:  # the corrected estimate's order; a layout skipped teaches nothing
            pending.sort(key=lambda le: (not state.fits(*le), le[1].step))
            pending.reverse()  # the best last, for pop(); of equals the first in the sorted order
            learnt = False
        if len(state.found) >= cfg.plan.auto_plans:  # the limit: every layout left is past it
            state.skipped[f"past plan.auto_plans={cfg.plan.auto_plans}"] += len(pending)
            break
        lay, est = pending.pop()  # the best, at the end
        # traced whole as the layout's own config would be (its zero is the one key of it that matters)
        whole = lay.zero == 1 or traced_whole(cfg, ParallelDims(lay.dp, lay.pp, lay.tp, world, lay.cp), False)
        why = state.known(lay) or state.no_time(cfg, whole, len(state.found), time.perf_counter() - t0)
        if why:
            state.skipped[why] += 1
            continue
        start = time.perf_counter()
        learnt = True
        cand = _planned(apply_overrides(cfg, lay.overrides), lay, world, run_dir, budget, hw, data)
        state.learn(lay, est, cand, whole, time.perf_counter() - start)
        text = cand.dropped or f"peak {human_bytes(cand.peak)}, step {cand.times['step'] * 1e3:.3g} ms"
        progress(f"auto: [{len(state.found)}] {cand.name} (estimated {human_bytes(est.peak)}, "
                 f"{est.step * 1e3:.3g} ms): {text[:160]} [{time.perf_counter() - start:.0f} s]")
    return state.found, state.skipped


class _State:
    """What the planning loop has learnt (Note [auto over a cluster]): the plans and how they ended, the
    planned peak over the estimated one per activation policy (with or without a pipeline), the seconds plans
    take traced whole or by depth, the errors of plans that could not be made by schedule."""

    def __init__(self, budget: int):
        self.budget, self.found, self.skipped = budget, [], Counter()
        self.outcome: dict[Layout, bool] = {}  # planned layout -> fits
        self.scale: dict[tuple, float] = {}
        self.seconds: dict[bool, list[float]] = {True: [], False: []}
        self.failed: dict[str | None, str] = {}

    def fits(self, lay: Layout, est) -> bool:
        # the correction learnt for its policy, else the latest learnt (the states' share is alike)
        return est.peak * self.scale.get((lay.activations, lay.pp > 1), self.scale.get(None, 1.0)) <= self.budget

    def learn(self, lay: Layout, est, cand: Candidate, whole: bool, seconds: float) -> None:
        self.found.append(cand)
        self.seconds[whole].append(seconds)
        if cand.peak is not None:
            self.outcome[lay] = cand.dropped is None
            self.scale[(lay.activations, lay.pp > 1)] = self.scale[None] = cand.peak / est.peak
        elif cand.dropped.startswith("could not be planned"):
            self.failed[lay.schedule] = cand.dropped.partition(": ")[2][:80]
        elif "no split into" in cand.dropped:  # its stages cannot fit the budget: over it, as a plan would say
            self.outcome[lay] = False

    def no_time(self, cfg: Config, whole: bool, planned: int, elapsed: float) -> str | None:
        """Why no plan of this kind starts now: the limit, the deadline (at the mean of plans of its kind), or
        for a plan traced whole half the deadline spent on such plans."""
        if planned >= cfg.plan.auto_plans:
            return f"past plan.auto_plans={cfg.plan.auto_plans}"
        times = self.seconds[whole]
        mean = sum(times) / len(times) if times else 0.0
        kind = "whole" if whole else "by-depth"
        if mean > cfg.plan.auto_deadline_s - elapsed:
            return f"past plan.auto_deadline_s ({kind} plans take {mean:.0f} s)"
        if whole and sum(times) + mean > cfg.plan.auto_deadline_s / 2:
            return f"past half of plan.auto_deadline_s on plans traced whole ({mean:.0f} s each)"
        return None

    def known(self, lay: Layout) -> str | None:
        """Why a plan already made says how `lay` ends, or None: a plan of its schedule failed (or those of two
        schedules with the same error, for any pipeline), or `_known`."""
        if lay.pp > 1:
            if lay.schedule in self.failed:
                return f"{lay.schedule}: as a plan before, could not be planned: {self.failed[lay.schedule]}"
            errors = Counter(self.failed.values())
            if errors and errors.most_common(1)[0][1] >= 2:
                return f"pipelines: plans of two schedules could not be made: {errors.most_common(1)[0][0]}"
        return _known(lay, self.outcome)


def _known(lay: Layout, outcome: dict[Layout, bool]) -> str | None:
    """Why a plan already made of the same degrees, schedule and microbatches says how `lay` ends, or None."""
    keeps = POLICIES.index  # lower: keeps more activations
    for other, fits in outcome.items():
        if (other.degrees, other.schedule, other.stages, other.microbatches) != \
                (lay.degrees, lay.schedule, lay.stages, lay.microbatches):
            continue
        if not fits and lay.zero <= other.zero and lay.replicate >= other.replicate and \
                keeps(lay.activations) <= keeps(other.activations):
            return "no less memory than a plan over the budget"
        if fits and (lay.zero, lay.replicate) == (other.zero, other.replicate) and \
                keeps(lay.activations) > keeps(other.activations):
            return "recomputes more than a plan that fits"
    return None


def _planned(c: Config, lay: Layout, world: int, run_dir, budget: int, hw: HardwareConfig, data) -> Candidate:
    """`lay` validated and planned (its strategy's build messages quieted), priced on `hw`, dropped over the
    budget or with the reason it cannot be planned."""
    cand = lay.candidate()
    c.run_dir = str(run_dir)
    quiet = logging.getLogger("parallel")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        validate(c, world, data)
        plans = plan(c, world, data=data)
    except ConfigError as e:
        cand.dropped = f"does not apply: {e}"
        return cand
    except Exception as e:  # noqa: BLE001 - a layout the planner cannot take is one option less
        cand.dropped = f"could not be planned: {type(e).__name__}: {e}"
        return cand
    finally:
        quiet.setLevel(level)
    cand.peak = max(held(p) for p in plans)  # a CUDA plan's reserved memory: Note [caching allocator]
    cand.times = profile_times(c, plans, world, hw)
    cand.times.pop("comm_by_kind", None)
    if cand.peak > budget:
        cand.dropped = f"peak {cand.peak / 1e6:.2f} MB > budget {budget / 1e6:.2f} MB"
    return cand


def _row(c: Candidate, cfg: Config, world: int, hw: HardwareConfig, flops: int | None) -> dict:
    """A fitting candidate's line of the top table: reserved memory, step, tokens/s per device, MFU."""
    step = c.times["step"]
    tokens = cfg.trainer.batch_size * cfg.data.seq_len if cfg.data.task == "lm" else None
    peak = hw.peak_flops.get("bf16") or max(v for v in hw.peak_flops.values() if v)
    return {"name": c.name, "overrides": c.overrides, "reserved": c.peak, "step_s": step,
            "tokens_per_s_per_device": tokens / step / world if tokens else None,
            "mfu": flops / world / step / peak if flops else None}


def summary_text(summary: dict, budget: int) -> str:
    """The search's counts by reason and its top rows, as launch/plan.py and train.py print them."""
    def counts(d: dict) -> str:
        return "; ".join(f"{k}: {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "none"

    lines = [f"auto: {summary['layouts']} layouts; ruled out before: {counts(summary['refused'])}",
             f"auto: screened out by the bound (> {budget / 2**30:.1f} GiB): {counts(summary['screened_out'])}",
             f"auto: planned {summary['planned']}, {summary['fit']} fit; dropped: {counts(summary['dropped'])}; "
             f"not planned: {counts(summary['skipped'])}; {summary['seconds']:.0f} s",
             f"{'':2}{'layout':<52}{'reserved GiB':>13}{'step ms':>10}{'tokens/s/dev':>14}{'MFU':>7}"]
    for i, r in enumerate(summary["top"]):
        tokens = f"{r['tokens_per_s_per_device']:,.0f}" if r["tokens_per_s_per_device"] else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        lines.append(f"{'->' if i == 0 else '  '}{r['name']:<52}{r['reserved'] / 2**30:>13.1f}"
                     f"{r['step_s'] * 1e3:>10.1f}{tokens:>14}{mfu:>7}")
    return "\n".join(lines)
