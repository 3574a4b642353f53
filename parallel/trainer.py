"""One owner of a run: build it, resume it, train it, evaluate it, save it, close it.

`run_training` is what a worker does once its process group and run directory
exist (parallel.launcher); `build_run` is also what the planner runs on fake
tensors (parallel.planning.planner), so both build exactly the same thing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from parallel import checkpoint, evaluation, preemption
from parallel.config import Config
from parallel.data import DataSource, build_data, build_eval_data
from parallel.dims import ParallelDims, batch_mesh, set_collective_timeout
from parallel.engine import Engine, LooksAhead, looks_ahead, own_optimizer
from parallel.init import ByName, InitPlan, init_plan
from parallel.lr_schedule import build_scheduler
from parallel.memory.oom import out_of_memory
from parallel.metrics import Metrics, PeakMemory, console_on, gather_ints, log, process_peak_rss, progress_bar
from parallel.models import weights
from parallel.models.build import meta_model
from parallel.models.moe_stats import moe_record
from parallel.models.recipe import model_recipe
from parallel.nonfinite import AgreedStop, Guard
from parallel.optim import all_sum, build_optimizer, param_names
from parallel.profiling import Profiling, run_phase
from parallel.runtime import Runtime
from parallel.seeding import seed_all, stream_seed
from parallel.strategies import parallelize
from parallel.strategies.compile import CompileClock, compiling
from parallel.strategies.tensor.whole import describe, unequal_gradients
from parallel.tensors import local_bytes, rank_optimizer
from parallel.throughput import Throughput, postfix, text


@dataclass
class Run:
    """Everything the loop needs, built once per worker."""

    cfg: Config
    engine: Engine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: DataSource
    device: torch.device
    is_logger: bool
    plan: InitPlan  # of the unpartitioned model: names -> initialization and canonical names of tied weights
    next_batch: tuple | None = None  # (step, x, y) read one step early for an engine that looks ahead
    ahead: LooksAhead | None = None  # the engine, when it looks ahead (Note [engine contract])
    rng_seed: int = 0  # this rank's stream of random numbers (Note [random numbers] in parallel/seeding.py)
    eval_data: DataSource | None = None  # with trainer.eval_every (Note [evaluation] in parallel/evaluation.py)
    compile_clock: CompileClock | None = None  # with trainer.compile (Note [regional compilation])
    tp_group: object = None  # tp > 1: checked at the first step (Note [weights left whole]), then None
    data_spec: object = None  # what validation read from the data (Note [data spec] in parallel/data/spec.py)

    def canonical(self) -> dict[str, str]:
        """Every parameter name -> the name its optimizer state is saved under (a tied weight's first)."""
        return {name: entry.canonical for name, entry in self.plan.items()}

    def close(self) -> None:
        """Release the engine's threads and files and the data's readers (also when the run failed)."""
        self.engine.close()
        self.data.close()
        if self.compile_clock is not None:
            self.compile_clock.close()
        if self.eval_data is not None:
            self.eval_data.close()


def build_run(cfg: Config, dims: ParallelDims, runtime: Runtime, mesh=None, model=None,
              data: DataSource | None = None) -> Run:
    """Build the model on the meta device, hand it to the strategy, and add the optimizer, schedule and data.

    `mesh`, `model` (on meta) and `data` may come ready-made (the planner makes
    them outside its fake-tensor mode). The initial values are `runtime.values`;
    when it is None they are made here from the model's recipe (Note [building a
    model], Note [initial values]), with `runtime.run_dir` for the file rank 0
    hands the model's own values over in.
    """
    mesh = dims.build_mesh(runtime.device.type) if mesh is None else mesh
    recipe = model_recipe(cfg.model)  # what to build, resolved once (Note [building a model])
    model = meta_model(recipe) if model is None else model
    # Training mode, as a user's loop sets it: a factory may return a model in eval mode (Hugging Face's
    # from_pretrained does), which would turn dropout off and BatchNorm to its running statistics.
    model.train()
    plan = init_plan(model)  # names -> initialization, taken before any partitioning
    if runtime.values is None:
        values = ByName(cfg.trainer.seed, model) if runtime.run_dir is None else \
            weights.initial_values(recipe, cfg.trainer.seed, runtime.run_dir, model, plan)
        runtime = dataclasses.replace(runtime, values=values)
    engine = parallelize(model, mesh, cfg, runtime, plan)
    names = param_names(engine.state_modules(), {name: entry.canonical for name, entry in plan.items()})
    own = own_optimizer(engine)
    optimizer = own.make_optimizer(names) if own is not None else \
        build_optimizer(engine.model, names, cfg.optim, engine.state_sharding)
    # Each dp x ep rank reads its share of the global batch; cp ranks read the same samples (Note [mesh
    # dimensions] in parallel/dims.py).
    batch = batch_mesh(mesh)
    dp_rank, dp_size = batch.get_local_rank(), batch.size()
    if data is None:
        data = build_data(cfg.data, cfg.trainer.seed, cfg.trainer.batch_size, dp_rank, dp_size, spec=runtime.data)
    eval_data = build_eval_data(cfg.data, cfg.trainer.seed, cfg.trainer.batch_size, dp_rank, dp_size) \
        if cfg.trainer.eval_every else None
    # The loss lives where the engine computes it; one such rank logs (dp, ep, cp and tp rank 0).
    is_logger = engine.holds_loss and dp_rank == 0 and all(mesh[k].get_local_rank() == 0 for k in ("cp", "tp"))
    rng_seed = stream_seed(cfg.trainer.seed, dp_rank, mesh["pp"].get_local_rank())
    clock = CompileClock() if compiling(cfg, runtime) else None  # blocks compile at the first step, not here
    tp_group = mesh["tp"].get_group() if mesh["tp"].size() > 1 else None
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.steps)
    return Run(cfg, engine, optimizer, scheduler, data, runtime.device, is_logger, plan, rng_seed=rng_seed,
               eval_data=eval_data, compile_clock=clock, ahead=looks_ahead(engine), tp_group=tp_group,
               data_spec=runtime.data)


def run_training(cfg: Config, run_dir: Path, device: torch.device, data=None) -> None:
    """Build this worker's part of the run, resume it when asked, train, save the final weights, close.

    Args:
        cfg: the resolved, validated config (parallel.validate).
        run_dir: the run directory, the same on every rank.
        device: this worker's device.
        data: what validation read from the data (a parallel.data.spec.DataSpec; None: nothing read).
    """
    world = dist.get_world_size()
    dims = ParallelDims.of(cfg.strategy, world)
    mesh = dims.build_mesh(device.type)
    set_collective_timeout(cfg.trainer.init_timeout_s)  # the mesh's groups too (Note [two timeouts])
    run = build_run(cfg, dims, Runtime(device=device, run_dir=run_dir, data=data), mesh=mesh)
    set_collective_timeout(cfg.trainer.init_timeout_s)  # and those the strategy made (a pipeline's)
    weights.done(run_dir)
    console_on(run.is_logger)
    # After building (rank 0 built the user's model under its own seed; a pipeline may have timed blocks) and
    # before a checkpoint restores the generators it saved: Note [random numbers].
    seed_all(run.rng_seed)
    try:
        path = checkpoint.resume_target(cfg, run_dir)
        with run_phase("checkpoint_load"):
            start = 0 if path is None else checkpoint.load(run, path)
        train(cfg, run, run_dir, start)
        if cfg.trainer.save_final:
            with run_phase("save_final"):
                save_final(run.engine, run_dir / "final_model.pt")
    except Exception as e:
        oom = out_of_memory(e, cfg, run.engine.model, device, run_dir)  # Note [out of memory]: one line
        if oom is None:
            raise
        raise oom from None
    finally:
        run.close()  # offload removes its files, shards stop their readers; also when the run fails
    if run.is_logger:
        log.info("done: %s", run_dir)


def next_batch(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step`; for an engine that looks ahead, the next step's input is read now and handed to it
    (offload's frozen part runs one batch ahead)."""
    if run.next_batch is not None and run.next_batch[0] == step:
        _, x, y = run.next_batch
    else:
        x, y = run.data.batch(step, run.device)
    run.next_batch = None
    if run.ahead is not None and step < run.cfg.trainer.steps:
        run.next_batch = (step + 1, *run.data.batch(step + 1, run.device))
        run.ahead.look_ahead(run.next_batch[1])
    return x, y


def train_step(run: Run, step: int, guard: Guard | None = None) -> tuple[torch.Tensor, torch.Tensor, float, object]:
    """One optimizer step over the global batch.

    Returns (this rank's mean loss, global grad norm, data time, the guard's verdict); the loss is
    averaged over data-parallel ranks only when it is logged, to keep a collective out of every step. The
    guard (Note [non-finite steps] in parallel/nonfinite.py) sees the loss and the norm before the optimizer
    does: True, the step applies; False, it is dropped; an AgreedStop (so at the first step under tensor
    parallelism, weights left whole whose gradients differ: Note [weights left whole]), the run stops with
    nothing applied.
    """
    t0 = time.perf_counter()
    # The phases a profile and an out-of-memory line name (Note [profiles] in parallel/profiling.py).
    with run_phase("data", step):
        x, y = next_batch(run, step)
    data_time = time.perf_counter() - t0
    with run_phase("forward_backward", step):
        loss = run.engine.forward_backward(x, y)
    # Before clipping: a weight left whole with a different gradient on each tp rank would clip each rank by
    # its own norm (Note [weights left whole]).
    differ = whole_weights_differ(run)
    with run_phase("clip", step):
        norm = run.engine.clip(run.cfg.trainer.clip_grad_norm)
    verdict = differ or (True if guard is None else guard.check(step, loss, norm))
    with run_phase("optimizer_step", step):
        if verdict is True:
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)  # a dropped step's gradients go with it
        if verdict is True:
            run.scheduler.step()
    return loss, norm, data_time, verdict


def train(cfg: Config, run: Run, run_dir: Path, start: int = 0) -> list[float]:
    """Run steps `start`+1 .. `trainer.steps`; log every `trainer.log_every`, save a checkpoint every
    `trainer.checkpoint_every`. Returns the logged losses."""
    t = cfg.trainer
    metrics = Metrics(run_dir, run.is_logger, OmegaConf.to_yaml(OmegaConf.structured(cfg)), start)
    checkpoints = checkpoint.Checkpointer(cfg, run_dir)
    memory = PeakMemory(run.device)
    profiling = Profiling(t, run_dir, run.device)  # trainer.profile, trainer.memory_snapshot
    # Note [throughput] in parallel/throughput.py
    speed = Throughput.start(cfg, run.device, run.is_logger, run_dir, run.data_spec)
    guard = Guard(t, run_dir)  # Note [non-finite steps] in parallel/nonfinite.py
    bar = progress_bar(t.steps, start, run.is_logger and t.progress)
    # Everything built so far (the model, Hydra, TensorBoard) lives for the whole
    # run; freezing it keeps the cyclic garbage collector from re-scanning it in
    # the middle of steps, unless a worker has frozen its imports already (Note
    # [the collector in a worker] in parallel/launcher.py).
    freezing = gc.get_freeze_count() == 0
    if freezing:
        gc.collect()
        gc.freeze()
    losses, window, stop = [], _Window(), None
    for step in range(start + 1, t.steps + 1):
        logging_step = step % t.log_every == 0 or step == t.steps
        watched = step == start + 1 or logging_step
        t0 = time.perf_counter()
        with profiling.step(step), memory.watch(run.engine, run.optimizer) if watched else contextlib.nullcontext():
            loss, norm, data_time, verdict = train_step(run, step, guard)
        if isinstance(verdict, AgreedStop):  # before this step's log line and checkpoint
            stop = verdict
            break
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        window.add(time.perf_counter() - t0, data_time, watched)
        if step == start + 1:
            first_step_done(run)
        bar.update(1)
        evals = log_eval(run, step) if evaluation.due(cfg, step) else {}
        if logging_step:
            record = log_step(run, metrics, memory, window, step, loss, norm, evals, speed, guard)
            losses.append(record["loss"])
            bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.0f}",
                            **postfix(record))
        elif evals:
            metrics.log({"step": step, **evals})
        if checkpoints.due(step):
            checkpoints.save(run, step)
        if stop := preemption.stop_here(run, checkpoints, step):  # a collective (Note [preemption])
            break
    if freezing:
        gc.unfreeze()  # a sweep runs several jobs in one process: let this run's objects go
    profiling.close()
    bar.close()
    metrics.close()
    if stop:
        raise stop
    return losses


def whole_weights_differ(run: Run) -> AgreedStop | None:
    """At the first step under tensor parallelism (every rank of the tp group calls it): weights left whole
    whose gradients differ between its ranks stop the run (Note [weights left whole]); None otherwise."""
    group, run.tp_group = run.tp_group, None  # checked once
    if group is None:
        return None
    unequal = unequal_gradients(run.engine.state_modules(), group)
    # Every rank learns whether any tp group (a pipeline stage's, a dp replica's) found one; the first rank that
    # did says so.
    found = [r for r, n in enumerate(gather_ints(len(unequal))) if n]
    if not found:
        return None
    line = describe(unequal, dist.get_world_size(group)) if unequal else ""
    return AgreedStop(line, says=dist.get_rank() == found[0], agreed=True)


def first_step_done(run: Run) -> None:
    """After the first step of this process's run: collectives wait trainer.timeout_s from now on (Note [two
    timeouts] in parallel/dims.py); the compilations it made, logged."""
    set_collective_timeout(run.cfg.trainer.timeout_s)
    if run.compile_clock is not None and run.is_logger:
        log.info("trainer.compile: %d compilations, %.1f s, in the first step", run.compile_clock.count,
                 run.compile_clock.seconds)


def log_eval(run: Run, step: int) -> dict:
    """Evaluate after `step` (collective: every rank calls it); the figures, also in the log."""
    with run_phase("evaluation", step):
        record = evaluation.evaluate(run.cfg, run.engine, run.eval_data, run.device)
    if run.is_logger:
        log.info("step %d  %s", step, "  ".join(f"{k} {v:.6f}" for k, v in record.items()))
    return record


def log_step(run: Run, metrics: Metrics, memory: PeakMemory, window: "_Window", step: int, loss: torch.Tensor,
             norm: torch.Tensor, evals: dict | None = None, speed: Throughput | None = None,
             guard: Guard | None = None) -> dict:
    """Write the record of a logged step (collective: every rank calls it), with the evaluation's figures
    after that step if any, and return it."""
    t = run.cfg.trainer
    # Each dp rank holds its share of the global loss (Note [global loss] in parallel/loss.py): their sum.
    loss_value = all_sum(loss, run.engine.loss_group).item()
    step_time, data_time = window.take()
    record = {
        "step": step, "loss": loss_value, "lr": scheduled_lr(run),
        "grad_norm": float(norm), "step_time_s": step_time,
        "data_time_s": data_time,
        "samples_per_s": t.batch_size / step_time,
    }
    record.update(speed.record(step_time) if speed else {})
    record.update(run.engine.metrics())
    record.update(moe_record(run.engine.state_modules(), run.cfg.strategy.tp or 1))
    record.update(memory_record(memory))
    record.update(state_record(run))
    record.update(evals or {})
    record.update(guard.record() if guard is not None else {})
    if run.compile_clock is not None:
        record.update(run.compile_clock.record())
    metrics.log(record)
    if run.is_logger:  # elsewhere the loss may be a placeholder (pipeline stages without it)
        log.info("step %d  loss %.6f  grad_norm %.4f  %.1f samples/s%s%s", step, loss_value,
                 record["grad_norm"], record["samples_per_s"], text(record),
                 f"  step {step_time * 1e3:.1f} ms (auto predicted {predicted * 1e3:.1f})"
                 if (predicted := record.get("predicted_step_time_s")) else "")
    return record


def scheduled_lr(run: Run) -> float:
    """The learning rate of optim.lr's groups now (those optim.lr_scale leaves alone; else the first group)."""
    lrs, base = run.scheduler.get_last_lr(), run.scheduler.base_lrs
    return next((lr for lr, b in zip(lrs, base) if b == run.cfg.optim.lr), lrs[0])


class _Window:
    """Step and data times since the last log. Steps run under the memory watch are
    slower (a dispatch per op), so they count only when the window has no other."""

    def __init__(self):
        self.times = {True: [], False: []}

    def add(self, step_time: float, data_time: float, watched: bool) -> None:
        self.times[watched].append((step_time, data_time))

    def take(self) -> tuple[float, float]:
        times = self.times[False] or self.times[True]
        self.times = {True: [], False: []}
        return sum(s for s, _ in times) / len(times), sum(d for _, d in times) / len(times)


def save_final(engine: Engine, path: Path) -> None:
    """Gather the full, unpartitioned state dict and torch.save it from rank 0."""
    state = engine.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(state, path)


def state_record(run: Run) -> dict:
    """Bytes of this rank's own pieces of the weights and of the optimizer state, every rank's (gathered)."""
    params = {id(p): p for p in run.engine.model.parameters()}  # a weight shared by two modules counts once
    state = [t for s in rank_optimizer(run.optimizer).state.values() for t in s.values()
             if torch.is_tensor(t) and t.dim() > 0]
    return {"param_bytes_per_rank": gather_ints(sum(local_bytes(p) for p in params.values())),
            "optim_state_bytes_per_rank": gather_ints(sum(local_bytes(t) for t in state))}


def memory_record(memory: PeakMemory) -> dict:
    """Peak device memory and peak RSS of every rank (gathered), and their maximum."""
    device_peaks = gather_ints(memory.value())
    rss_peaks = gather_ints(process_peak_rss())
    return {"mem_peak_bytes": max(device_peaks), "mem_peak_bytes_per_rank": device_peaks,
            "rss_peak_bytes": max(rss_peaks), "rss_peak_bytes_per_rank": rss_peaks}
