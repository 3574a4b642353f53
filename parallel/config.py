"""Typed configuration: the schemas behind conf/ and every cross-field rule.

Each config group (strategy, model, data, optim, trainer, memory) has a dataclass
here, stored in Hydra's ConfigStore as the base of the root config, so a wrong
type or an unknown key fails while Hydra composes. Rules that relate several
fields live in :func:`validate`, which runs once, before any worker starts, and
raises :class:`ConfigError` naming the key, the value, the rule and the options.
"""
from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

TASKS = ("regression", "classification", "lm")
PRECISIONS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("cosine", "constant")
BALANCES = ("time", "memory", "params")
ZERO_LEVELS = (0, 1, 2, 3)


class ConfigError(ValueError):
    """A user error in the configuration: reported without a traceback."""


def fail(key: str, value: Any, rule: str, options: Any = None) -> None:
    """Raise a ConfigError that names the key, the value, the rule and the options."""
    msg = f"{key}={value!r}: {rule}"
    if options is not None:
        msg += f" (valid: {options})"
    raise ConfigError(msg)


@dataclass
class StrategyConfig:
    name: str = "single"
    # Data-parallel degree; None derives it from the world size.
    dp: Optional[int] = None
    # 0: DDP, 1: optimizer state sharded, 2: + gradients (FSDP2, no reshard
    # after forward), 3: + parameters (FSDP2, reshard after forward).
    zero: int = 0
    # Pipeline degree (ranks in one pipeline); None derives it from the world size.
    pp: Optional[int] = None
    # PyTorch schedule name, case-insensitive (see parallel.strategies.schedules).
    schedule: str = "1F1B"
    # Microbatches per step; None: 2 x the number of stages.
    microbatches: Optional[int] = None
    # Stages each rank runs; None: 2 for interleaved, looped and V schedules, else 1.
    stages_per_rank: Optional[int] = None
    # Block names where stages 1.. begin; empty: balanced automatically by `balance`.
    split_points: List[str] = field(default_factory=list)
    # The cost the automatic split balances: time, memory or params.
    balance: str = "time"
    # Tensor-parallel degree (ranks sharing each layer); None derives it from the world size.
    tp: Optional[int] = None
    # "pattern:style" entries (pattern over module names, with *); empty: the built-in model's own plan.
    tp_plan: List[str] = field(default_factory=list)
    # Shard norms, dropout and the residual stream along the sequence between
    # tensor-parallel layers (built-in transformer only).
    sequence_parallel: bool = False
    # Offload (one device): the tier each kind lives on: device, cpu, disk, auto (the
    # tier below the device); activations also checkpoint (recompute in backward),
    # which every other strategy takes too (per block: parallel.strategies.recompute).
    params: str = "auto"
    optimizer: str = "auto"
    activations: str = "device"
    # Directory for the disk tier; None: <run_dir>/offload. Removed at the end.
    path: Optional[str] = None
    # Blocks read ahead of the one computing.
    prefetch: int = 1
    # Run a model's frozen leading part one batch ahead, on its own thread, while
    # the rest trains (models with frozen_forward/trainable_forward, e.g. stacked).
    lookahead: bool = True


@dataclass
class ModelConfig:
    # A built-in model's name (see parallel.models.MODELS), or "custom".
    name: str = "mlp"
    # A user factory "package.module.callable" returning an nn.Module; when
    # set it replaces the built-in and receives `args` as keyword arguments.
    _target_: Optional[str] = None
    args: Dict[str, Any] = field(default_factory=dict)
    # model=stacked: a state dict with the frozen extractor's pretrained weights.
    frozen_checkpoint: Optional[str] = None


@dataclass
class DataConfig:
    # synthetic (generated from the seed) or shards (a directory written by launch/make_shards.py).
    name: str = "synthetic"
    # Task and sizes: data=shards reads them from the dataset's manifest.
    task: str = "regression"
    features: int = 32
    targets: int = 4
    classes: int = 10
    vocab_size: int = 64
    seq_len: int = 32
    # Standard deviation of the label noise (regression, synthetic).
    noise: float = 0.01
    # data=shards: the dataset directory; samples per shuffle window (0 or 1: the written order);
    # batches read ahead; reader threads; checks before training: size (every shard's length) or
    # checksum (also its CRC-32, reading every byte once).
    path: Optional[str] = None
    shuffle_buffer: int = 10000
    prefetch: int = 2
    workers: int = 2
    verify: str = "checksum"


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 5e-3
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"
    # The cosine schedule decays to lr * min_lr_ratio at the last step.
    min_lr_ratio: float = 0.1


@dataclass
class TrainerConfig:
    steps: int = 50
    seed: int = 0
    # The global batch: split over data-parallel ranks, then over grad_accum.
    batch_size: int = 32
    grad_accum: int = 1
    log_every: int = 10
    # Clip the global gradient norm to this value; 0 disables clipping.
    clip_grad_norm: float = 1.0
    device: str = "auto"
    precision: str = "auto"
    # Seconds a collective may wait before the run fails instead of hanging.
    timeout_s: float = 300.0
    progress: bool = True
    # Write the trained weights, gathered and unpartitioned, to <run_dir>/final_model.pt.
    save_final: bool = False
    # Save a checkpoint (parallel.checkpoint) every N steps and at the last step; 0: none. The newest
    # keep_checkpoints complete ones are kept.
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    # Continue from a checkpoint: its directory, a run directory (its newest complete one), or auto (this
    # run directory's newest; none there: start at step 0). Workers restarted by torchrun resume auto.
    resume: Optional[str] = None


@dataclass
class MemoryConfig:
    # Per-device budget for the planner, e.g. "512MB" or 80e9; None: the device's own.
    budget: Optional[str] = None
    # Per-process CUDA memory cap (0, 1]; lets several jobs share a GPU. No effect on CPU.
    fraction: Optional[float] = None


@dataclass
class Config:
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    # Workers to start when not under torchrun; None: 1, or torchrun's world size.
    nproc: Optional[int] = None
    # Where the run writes; None: Hydra's output directory (or, under torchrun,
    # one chosen by rank 0 and shared with every rank).
    run_dir: Optional[str] = None


def _model_outputs(task: str, targets: int, classes: int, vocab_size: int) -> int:
    """Width of the model's output for a task (used by conf/model/*.yaml)."""
    return {"regression": targets, "classification": classes, "lm": vocab_size}.get(task, targets)


def register_configs() -> None:
    """Store the root schema so conf/config.yaml can extend it."""
    if not OmegaConf.has_resolver("parallel_outputs"):
        OmegaConf.register_new_resolver("parallel_outputs", _model_outputs)
    if not OmegaConf.has_resolver("parallel_run_dir"):
        # hydra.run.dir: the user's run_dir when set, else Hydra's dated default.
        OmegaConf.register_new_resolver("parallel_run_dir", lambda chosen, default: chosen or default)
    ConfigStore.instance().store(name="parallel_schema", node=Config)


register_configs()


# ---------------------------------------------------------------------------
# Cross-field validation: one place, before any worker starts.
# ---------------------------------------------------------------------------

def to_config(cfg: DictConfig | dict) -> Config:
    """Turn a composed DictConfig (or its plain-dict form) into typed dataclasses.

    With data=shards the task and sizes come from the dataset's manifest, set
    before interpolations resolve (a model's `${data.features}` reads them).
    """
    if isinstance(cfg, dict):
        cfg = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    if cfg.data.name == "shards":
        _read_shard_hints(cfg)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _read_shard_hints(cfg: DictConfig) -> None:
    from parallel.data.shards import Manifest

    if not cfg.data.path:
        fail("data.path", cfg.data.path, "data=shards needs the dataset directory", "a directory written by "
             "launch/make_shards.py")
    m = Manifest.load(cfg.data.path)
    m.field("features"), m.field("targets")
    hints = m.record.get("hints") or {}
    if not hints:
        fail("data.path", cfg.data.path, "the manifest names no task for its features and targets")
    for key, value in hints.items():
        cfg.data[key] = value


def _positive(key: str, value: Any, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        fail(key, value, f"must be an integer >= {low}")


def resolve(cfg: Config, world_size: int) -> Config:
    """Fill the values left to be derived (degrees, stages per rank, microbatches), in place.

    Cheap and deterministic: the launcher and every worker call it and agree.
    """
    from parallel.dims import ParallelDims
    from parallel.strategies import schedules

    s = cfg.strategy
    dims = ParallelDims.from_config(s, world_size)
    s.dp, s.pp, s.tp = dims.dp, dims.pp, dims.tp
    if pipelined(s):
        name = schedules.canonical(s.schedule)
        if name is None:
            fail("strategy.schedule", s.schedule, "unknown schedule (case-insensitive)", list(schedules.SCHEDULES))
        s.schedule = name
        if s.stages_per_rank is None:
            s.stages_per_rank = schedules.default_stages_per_rank(name)
        _positive("strategy.stages_per_rank", s.stages_per_rank)  # before microbatches are derived from it
        if s.microbatches is None:
            s.microbatches = 2 * s.pp * s.stages_per_rank
    return cfg


def pipelined(s: StrategyConfig) -> bool:
    """Whether the model is split into pipeline stages (after `resolve`)."""
    return s.name == "pipeline" or (s.name == "hybrid" and s.pp is not None and s.pp > 1)


def tensor_parallel(s: StrategyConfig) -> bool:
    """Whether layers are split over tensor-parallel ranks (after `resolve`)."""
    return s.name == "model" or (s.name == "hybrid" and s.tp is not None and s.tp > 1)


def validate(cfg: Config, world_size: int) -> None:
    """Check every rule that spans fields; raise ConfigError on the first broken one.

    Also fills derived values (see `resolve`).

    Args:
        cfg: the typed configuration.
        world_size: the number of workers the run will have.
    """
    from parallel.strategies import STRATEGIES

    t = cfg.trainer
    for key in ("steps", "batch_size", "grad_accum", "log_every"):
        _positive(f"trainer.{key}", getattr(t, key))
    _positive("trainer.seed", t.seed, allow_zero=True)
    _positive("trainer.checkpoint_every", t.checkpoint_every, allow_zero=True)
    _positive("trainer.keep_checkpoints", t.keep_checkpoints)
    if t.clip_grad_norm < 0:
        fail("trainer.clip_grad_norm", t.clip_grad_norm, "must be >= 0 (0 disables clipping)")
    if t.timeout_s <= 0:
        fail("trainer.timeout_s", t.timeout_s, "must be > 0 seconds")
    if t.device not in DEVICES:
        fail("trainer.device", t.device, "unknown device", list(DEVICES))
    if t.precision not in PRECISIONS:
        fail("trainer.precision", t.precision, "unknown precision", list(PRECISIONS))
    if t.precision == "bf16" and not _cuda_run(t.device):
        fail("trainer.precision", t.precision, "bf16 autocast is for CUDA runs; the CPU trains in fp32",
             ["auto", "fp32"])
    if cfg.nproc is not None:
        _positive("nproc", cfg.nproc)
    _validate_optim(cfg.optim)
    _validate_data(cfg.data)
    _validate_memory(cfg.memory)

    s = cfg.strategy
    if s.name == "auto":  # each candidate is validated as it is tried (parallel.auto)
        validate_model(cfg.model)
        return
    if s.name not in STRATEGIES:
        fail("strategy.name", s.name, "unknown strategy", sorted([*STRATEGIES, "auto"]))
    if s.zero not in ZERO_LEVELS:
        fail("strategy.zero", s.zero, "unknown ZeRO level", list(ZERO_LEVELS))
    if s.name == "offload":
        _validate_offload(cfg, world_size)
    elif s.activations not in ("device", "checkpoint"):
        fail("strategy.activations", s.activations, f"strategy={s.name} keeps activations on the device or "
             "recomputes them per block; the tiers below the device are strategy=offload's",
             ["device", "checkpoint"])
    if s.name == "single" and world_size != 1:
        fail("strategy", "single", f"runs on one process, but the world size is {world_size}",
             "strategy=data or strategy=pipeline for several processes")
    if s.name not in ("data", "hybrid") and s.zero != 0:
        fail("strategy.zero", s.zero, "ZeRO sharding needs strategy=data or strategy=hybrid")
    if s.balance not in BALANCES:
        fail("strategy.balance", s.balance, "unknown cost", list(BALANCES))
    # Tensor-parallel keys are checked by strategy name first (a plain strategy
    # may reject a degree while resolving), then by the resolved hybrid's tp.
    _check_tensor_keys(s, s.name in ("model", "hybrid"))
    resolve(cfg, world_size)
    _check_tensor_keys(s, tensor_parallel(s))
    per_rank = t.batch_size // s.dp
    if t.batch_size % s.dp:
        fail("trainer.batch_size", t.batch_size,
             f"the global batch must divide by the data-parallel degree {s.dp}",
             f"a multiple of {s.dp}")
    if per_rank % t.grad_accum:
        fail("trainer.grad_accum", t.grad_accum,
             f"must divide the per-rank batch {per_rank} (= trainer.batch_size {t.batch_size} / dp {s.dp})",
             [d for d in range(1, per_rank + 1) if per_rank % d == 0])
    if pipelined(s):
        _validate_pipeline(cfg, per_rank)
    validate_model(cfg.model)
    if s.name == "offload" and s.path is not None:
        _check_offload_disk(cfg)
    if t.resume is not None:
        from parallel.checkpoint import check_resume

        check_resume(cfg)
    if tensor_parallel(s):
        from parallel.strategies.tensor import example_input, resolve_plan

        resolve_plan(build_meta_model(cfg.model), cfg, example_input(cfg))
    if pipelined(s):
        from parallel.strategies.pipeline import plan_split

        plan_split(build_meta_model(cfg.model), cfg, s.dp, measure=False)  # traces; names bad split points
    if cfg.data.name == "shards" or not cfg.model._target_:
        # A user's model may do what meta tensors cannot (read a value): only the shards' own shapes ask it to.
        _check_model_takes_data(cfg)


def _validate_offload(cfg: Config, world_size: int) -> None:
    import torch

    from parallel.offload.tiers import TIERS, effective

    s = cfg.strategy
    if world_size != 1:
        fail("strategy", "offload", f"streams one device's model from the tiers below it and runs on one process, "
             f"but the world size is {world_size}",
             "strategy=data strategy.zero=3 to shard weights and optimizer state over processes, "
             "or strategy=pipeline to split the model by layers")
    for kind in ("params", "optimizer"):
        if getattr(s, kind) not in TIERS:
            fail(f"strategy.{kind}", getattr(s, kind), "unknown tier", list(TIERS))
    if s.activations not in TIERS + ("checkpoint",):
        fail("strategy.activations", s.activations, "unknown tier", list(TIERS) + ["checkpoint"])
    if isinstance(s.prefetch, bool) or not isinstance(s.prefetch, int) or s.prefetch < 0:
        fail("strategy.prefetch", s.prefetch, "must be an integer >= 0 (blocks read ahead)")
    if cfg.trainer.grad_accum != 1:
        fail("trainer.grad_accum", cfg.trainer.grad_accum, "must be 1 under strategy=offload: each block's "
             "gradients leave the device as soon as they are complete",
             "a smaller trainer.batch_size, or strategy.activations=disk or checkpoint to fit a larger one")
    cuda = _cuda_run(cfg.trainer.device)
    device = torch.device("cuda" if cuda else "cpu")
    for kind in ("params", "optimizer"):
        if cuda and effective(getattr(s, kind), device) == "disk":
            fail(f"strategy.{kind}", "disk", "the disk tier sits below the CPU; under a GPU the tier below is "
                 "pinned CPU memory", ["cpu", "auto", "device"])


def _check_offload_disk(cfg: Config) -> None:
    """The disk tier's directory is writable and has room for the weights, gradients and AdamW state.

    (Checked again, for the run directory, when the engine is built.)"""
    import torch

    from parallel.offload.tiers import check_disk, effective

    s = cfg.strategy
    device = torch.device("cuda" if _cuda_run(cfg.trainer.device) else "cpu")
    weights = sum(p.numel() * p.element_size() for p in build_meta_model(cfg.model).parameters())
    needed = (weights if effective(s.params, device) == "disk" else 0) + \
        (3 * weights if effective(s.optimizer, device) == "disk" else 0)
    why = check_disk(s.path, max(needed, 1))
    if why:
        fail("strategy.path", s.path, why)


def _check_tensor_keys(s: StrategyConfig, allowed: bool) -> None:
    rule = "strategy=model, or strategy=hybrid with strategy.tp > 1"
    if s.tp_plan and not allowed:
        fail("strategy.tp_plan", list(s.tp_plan), f"a tensor-parallel plan needs {rule}")
    if s.sequence_parallel and not allowed:
        fail("strategy.sequence_parallel", True,
             f"sequence parallelism shards between tensor-parallel layers: it needs {rule}")


def _validate_pipeline(cfg: Config, per_rank: int) -> None:
    from parallel.strategies import schedules

    s, t = cfg.strategy, cfg.trainer
    _positive("strategy.microbatches", s.microbatches)
    _positive("strategy.stages_per_rank", s.stages_per_rank)
    if per_rank % s.microbatches:
        fail("strategy.microbatches", s.microbatches,
             f"must divide the per-rank batch {per_rank} (= trainer.batch_size {t.batch_size} / dp {s.dp})",
             [d for d in range(1, per_rank + 1) if per_rank % d == 0])
    if t.grad_accum != 1:
        fail("trainer.grad_accum", t.grad_accum,
             "must be 1 under strategy=pipeline: microbatches already accumulate gradients",
             "raise strategy.microbatches instead")
    why = schedules.check(s.schedule, s.pp, s.stages_per_rank, s.microbatches)
    if why:
        fail(f"strategy.schedule={s.schedule} with strategy.stages_per_rank={s.stages_per_rank} and "
             f"strategy.microbatches", s.microbatches, why)


def _cuda_run(device: str) -> bool:
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _validate_optim(o: OptimConfig) -> None:
    if o.name != "adamw":
        fail("optim.name", o.name, "unknown optimizer", ["adamw"])
    if not o.lr > 0:
        fail("optim.lr", o.lr, "must be > 0")
    if o.weight_decay < 0:
        fail("optim.weight_decay", o.weight_decay, "must be >= 0")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        fail("optim.betas", list(o.betas), "must be two numbers in [0, 1)")
    _positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    if o.schedule not in LR_SCHEDULES:
        fail("optim.schedule", o.schedule, "unknown schedule", list(LR_SCHEDULES))
    if not 0 <= o.min_lr_ratio <= 1:
        fail("optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")


def _validate_data(d: DataConfig) -> None:
    if d.name not in ("synthetic", "shards"):
        fail("data.name", d.name, "unknown data source", ["synthetic", "shards"])
    if d.name == "shards":
        _validate_shards(d)
    if d.task not in TASKS:
        fail("data.task", d.task, "unknown task", list(TASKS))
    for key in ("features", "targets", "classes", "vocab_size", "seq_len"):
        _positive(f"data.{key}", getattr(d, key))
    if d.noise < 0:
        fail("data.noise", d.noise, "must be >= 0")


def _validate_shards(d: DataConfig) -> None:
    from parallel.data.shards import Manifest, ShardError

    _positive("data.shuffle_buffer", d.shuffle_buffer, allow_zero=True)
    _positive("data.prefetch", d.prefetch, allow_zero=True)
    _positive("data.workers", d.workers)
    if d.verify not in ("size", "checksum"):
        fail("data.verify", d.verify, "unknown check", ["size", "checksum"])
    m = Manifest.load(d.path)
    x = m.field("features")
    if d.task != "lm" and len(x["shape"]) != 1:
        fail("data.path", d.path, f"features of shape {tuple(x['shape'])}: the built-in tasks take one "
             f"vector of features per sample", "shards written with features of shape (F,)")
    try:
        m.check_files(checksums=d.verify == "checksum")
    except ShardError as e:
        fail("data.path", d.path, str(e))


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """Parse '512MB', '80GB', '1.5GiB' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _validate_memory(m: MemoryConfig) -> None:
    if m.budget is not None:
        try:
            if parse_bytes(m.budget) <= 0:
                raise ValueError
        except ValueError:
            fail("memory.budget", m.budget, "must be a positive size", "e.g. 512MB, 80GB, 1.5GiB, 1000000")
    if m.fraction is not None and not 0 < m.fraction <= 1:
        fail("memory.fraction", m.fraction, "must be in (0, 1]")


def resolve_factory(m: ModelConfig):
    """The callable that builds the model: a built-in, or the user's `_target_`."""
    from parallel.models import MODELS

    if m._target_:
        mod_name, _, attr = m._target_.rpartition(".")
        if not mod_name:
            fail("model._target_", m._target_, "must be a dotted path 'package.module.callable'")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            fail("model._target_", m._target_, f"cannot be imported ({type(e).__name__}: {e})")
        if not callable(factory):
            fail("model._target_", m._target_, "is not callable")
        return factory
    if m.name not in MODELS:
        fail("model.name", m.name, "unknown model; use a built-in or set model._target_",
             sorted(MODELS))
    return MODELS[m.name]


def validate_model(m: ModelConfig) -> None:
    """Check that the factory exists and accepts `model.args`."""
    import os

    if m.frozen_checkpoint is not None and not os.path.isfile(m.frozen_checkpoint):
        fail("model.frozen_checkpoint", m.frozen_checkpoint, "no such file")
    factory = resolve_factory(m)
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None  # a builtin or C callable: its arguments are checked by calling it
    if sig is not None:
        try:
            sig.bind(**m.args)
        except TypeError as e:
            hint = ""
            if m._target_ and m.name != "custom":
                hint = f"; model.args holds the built-in '{m.name}' arguments: start from model=custom"
            fail("model.args", dict(m.args),
                 f"do not fit {getattr(factory, '__qualname__', factory)}{sig}: {e}{hint}",
                 list(sig.parameters))
    build_meta_model(m)


def _check_model_takes_data(cfg: Config) -> None:
    """The model runs on two samples shaped as the data's and gives what its targets need."""
    import torch

    from parallel.strategies.tensor import example_input

    d = cfg.data
    key, value, what = ("data.path", d.path, "the shards'") if d.name == "shards" else \
        ("data.task", d.task, f"data.task={d.task}'s")
    hint = " (model=gpt takes data.task=lm)" if d.name != "shards" and cfg.model.name == "gpt" else ""
    shape = {"regression": (2, d.targets), "classification": (2, d.classes), "lm": (2, d.seq_len, d.vocab_size)}
    (x,) = example_input(cfg)
    try:
        with torch.no_grad():
            out = build_meta_model(cfg.model)(x)
    except Exception as e:  # noqa: BLE001 - any failure here is the shapes not fitting
        fail(key, value, f"the model does not take {what} samples ({x.dtype} features of shape "
             f"{tuple(x.shape[1:])}){hint}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if tuple(out.shape) != shape[d.task]:
        fail(key, value, f"the model gives outputs of shape {tuple(out.shape)} for 2 samples; {what} "
             f"{d.task} targets need {shape[d.task]}")


def build_meta_model(m: ModelConfig):
    """Build the model on the meta device (no memory) and check it is an nn.Module."""
    import torch
    from torch import nn

    factory = resolve_factory(m)
    try:
        with torch.device("meta"):
            model = factory(**m.args)
    except (TypeError, ValueError) as e:
        key = "model._target_" if m._target_ else f"model={m.name}"
        fail(key, dict(m.args), f"building the model failed: {type(e).__name__}: {e}")
    if not isinstance(model, nn.Module):
        key = "model._target_" if m._target_ else "model.name"
        fail(key, m._target_ or m.name, f"must return an nn.Module, returned {type(model).__name__}")
    from parallel.init import check_initializable

    try:
        check_initializable(model)
    except ValueError as e:
        fail("model", m._target_ or m.name, str(e))
    return model
