"""Typed configuration: the schemas behind conf/, the errors, and each group's own simple checks.

Each config group (model, data, optim, trainer, loss, memory, hardware) has a dataclass
here, stored in Hydra's ConfigStore as the base of the root config, so a wrong
type or an unknown key fails while Hydra composes. The strategy group has one per
strategy, made in parallel/strategy_specs.py (the one module below this one; its
unknown keys are refused as the config is typed: Note [strategy schemas]); this
module imports nothing else of the project. A group's checks of its own values sit
beside its schema (`check_trainer`, ...); rules that need the model, the data or
a strategy sit beside that code, and `parallel.validate` calls them all once,
before any worker starts. Every rule raises :class:`ConfigError` naming the key,
the value, the rule and the options.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

# The strategy's keys and its table live in the module below this one (Note [strategy table]); they are
# re-exported here, where the other groups' schemas are.
from parallel.strategy_specs import (  # noqa: F401
    SCHEMAS,
    SPECS,
    ZERO_LEVELS,
    StrategyBase,
    StrategyConfig,
    StrategySpec,
    pipelined,
    takers,
    tensor_parallel,
)

TASKS = ("regression", "classification", "lm")
INITS = ("module", "name")
PRECISIONS = ("auto", "fp32", "bf16")
REDUCE_PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
NONFINITE = ("stop", "skip")  # trainer.nonfinite: Note [non-finite steps] in parallel/nonfinite.py
LR_SCHEDULES = ("cosine", "constant", "linear", "wsd")
BALANCES = ("time", "memory", "params")
LOSS_REDUCTIONS = ("mean", "sum")


class ConfigError(ValueError):
    """A user error in the configuration: reported in one line, exit status 2, no traceback."""


class RunError(RuntimeError):
    """A run that cannot go on for a reason outside the configuration (a checkpoint that cannot be read, a
    disk that filled): reported in one line, exit status 1."""


def fail(key: str, value: Any, rule: str, options: Any = None) -> None:
    """Raise a ConfigError that names the key, the value, the rule and the options."""
    msg = f"{key}={value!r}: {rule}"
    if options is not None:
        msg += f" (valid: {options})"
    raise ConfigError(msg)


def error_text(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def import_target(key: str, target: Any) -> Any:
    """What a dotted path 'package.module.name' (a config's `_target_`) names; a ConfigError naming `key`
    when it is not a dotted path or does not import. The directory the run was started in is searched
    last, so a user's module beside their command line is found as `python -m` would find it."""
    if not isinstance(target, str) or "." not in target.strip("."):
        fail(key, target, "must be a dotted path 'package.module.name'")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    mod_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        fail(key, target, f"cannot be imported ({error_text(e)})")


@dataclass
class LoraConfig:
    # LoRA adapters through PEFT (Note [LoRA] in parallel/models/lora.py); r=0: none.
    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    # PEFT's target_modules: module names or name suffixes (e.g. [q_proj, v_proj]); empty: PEFT's default for
    # the architecture.
    targets: List[str] = field(default_factory=list)
    # Modules trained in full beside the adapters (e.g. a new classification head).
    modules_to_save: List[str] = field(default_factory=list)


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
    # Parameter name patterns (`*` wildcards, e.g. "blocks.0.*") frozen for the run: no gradients, no
    # optimizer state, under every strategy.
    freeze: List[str] = field(default_factory=list)
    # The initial weights (Note [initial values] in parallel/init/values.py): module (the model's own, as
    # `torch.manual_seed(trainer.seed); factory(**args)` makes them; built once, on rank 0) or name (each
    # tensor seeded by its name, on every rank; for a model too large for one host).
    init: str = "module"
    # Pretrained weights: a .safetensors, .pt or .bin state dict, a sharded safetensors index, or a model
    # directory; they replace the initial values of every tensor they hold.
    weights: Optional[str] = None
    # With weights: every saved tensor of the model must be in them, and nothing else (false: the missing
    # ones keep their initial values and the rest is ignored; both listed at start). model=hf sets false
    # (conf/model/hf.yaml): its directory loads as from_pretrained loads it.
    strict: bool = True
    # model=hf: a Hugging Face model directory (config.json, and its weights when pretrained), the Auto
    # class that builds it (default: the config's `architectures`), and config overrides.
    path: Optional[str] = None
    auto_class: Optional[str] = None
    pretrained: bool = True
    config: Dict[str, Any] = field(default_factory=dict)
    # LoRA through PEFT: model.lora.r=8 model.lora.targets=[q_proj,v_proj], or any PEFT config in Hydra's
    # instantiate shape (+model.peft._target_=peft.LoraConfig +model.peft.r=8 ...); not both.
    lora: LoraConfig = field(default_factory=LoraConfig)
    peft: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    # synthetic (generated from the seed), shards (a directory written by launch/make_shards.py) or custom
    # (the user's Dataset).
    name: str = "synthetic"
    # Task and sizes: data=shards reads them from the dataset's manifest.
    task: str = "regression"
    # What the model is fed (synthetic): features (float vectors of data.features) or tokens (ids of
    # data.seq_len below data.vocab_size, as a text classifier takes them); data.task=lm always feeds tokens.
    inputs: str = "features"
    features: int = 32
    targets: int = 4
    classes: int = 10
    vocab_size: int = 64
    seq_len: int = 32
    # Standard deviation of the label noise (regression, synthetic).
    noise: float = 0.01
    # data=shards: the dataset directory; samples per shuffle window (0 or 1: the written order);
    # batches read ahead; reader threads (data=custom: loader processes, 0: in the training process);
    # checks before training: size (every shard's length) or checksum (also its CRC-32, reading every byte once).
    path: Optional[str] = None
    shuffle_buffer: int = 10000
    prefetch: int = 2
    workers: int = 2
    verify: str = "checksum"
    # data=custom (Note [custom data] in parallel/data/custom/__init__.py): the user's factory
    # "package.module.callable" returning a torch Dataset (map-style or iterable; a Hugging Face
    # datasets.Dataset too), called with `args`. task "auto": read from the first sample with the sizes.
    _target_: Optional[str] = None
    args: Dict[str, Any] = field(default_factory=dict)
    # The sample's field fed to the model and the one the loss compares with: a dict key or a tuple index
    # (with data.collate: of the batch it returns), or a list of keys passed by name (Note [inputs by name]
    # in parallel/tensors.py); None: item 0 and 1 of a tuple, input_ids / pixel_values / x and labels / y.
    input_key: Any = None
    target_key: Optional[str] = None
    # {_target_: package.module.fn}: turns a list of samples into a batch; none: PyTorch's default_collate.
    collate: Dict[str, Any] = field(default_factory=dict)
    # Map-style: visit the samples in an order permuted by (seed, epoch); false: the dataset's own order.
    shuffle: bool = True
    # Evaluation data: a second dataset ({_target_, args}), or this fraction of a map-style training set
    # held out (never trained on).
    eval: Dict[str, Any] = field(default_factory=dict)
    eval_fraction: float = 0.0
    # The shapes and dtypes of data=custom's fields, and its size, are what validation read from its first
    # sample, not settings: parallel.data.spec.DataSpec, carried to the workers beside this config.


@dataclass
class SchedulerConfig:
    # A torch.optim.lr_scheduler class ("torch.optim.lr_scheduler.StepLR" or a user's), built as
    # `cls(optimizer, **args)` in place of optim.schedule; None: optim.schedule.
    _target_: Optional[str] = None
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    name: str = "adamw"
    # An optimizer class (`torch.optim.SGD`, or a user's `package.module.Class`) built with lr and
    # weight_decay from the keys below, betas and eps when its constructor takes them, and `args`;
    # None: AdamW (Note [optimizer] in parallel/optim.py).
    _target_: Optional[str] = None
    args: Dict[str, Any] = field(default_factory=dict)
    lr: float = 5e-3
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    # Parameter name patterns (`*` wildcards; a pattern matches the whole name or its end after a dot, so
    # `bias` matches `blocks.0.attn.bias`) trained without weight decay.
    no_decay: List[str] = field(default_factory=list)
    # `pattern:factor` entries (as strategy.tp_plan's): the learning rate of matching parameters is
    # lr x factor (the first entry that matches, in order), e.g. ["head.*:0.1", "*norm*:2"].
    lr_scale: List[str] = field(default_factory=list)
    warmup_steps: int = 0
    # constant | cosine | linear | wsd (warmup-stable-decay), after the linear warmup (Note [lr schedule]).
    schedule: str = "cosine"
    # cosine, linear and wsd decay to lr * min_lr_ratio at the last step.
    min_lr_ratio: float = 0.1
    # wsd: the decay takes the last decay_steps steps (None: decay_fraction of trainer.steps).
    decay_steps: Optional[int] = None
    decay_fraction: float = 0.2
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


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
    # auto: bf16 on CUDA, fp32 on the CPU; bf16: autocast to bf16 on either, the weights and optimizer state
    # kept in fp32 (Note [mixed precision] in parallel/strategies/data.py).
    precision: str = "auto"
    # The dtype gradients are reduced over data-parallel ranks in: fp32 (default), or bf16 (half the bytes).
    reduce_precision: str = "fp32"
    # Seconds a collective may wait before the run fails instead of hanging; init_timeout_s until the first step
    # has ended (Note [two timeouts] in parallel/dims.py).
    timeout_s: float = 300.0
    init_timeout_s: float = 1800.0
    # A step with a non-finite loss or grad norm: stop the run, or skip it (Note [non-finite steps]).
    nonfinite: str = "stop"
    nonfinite_limit: int = 5
    progress: bool = True
    # Write the trained weights, gathered and unpartitioned, to <run_dir>/final_model.pt.
    save_final: bool = False
    # At the end of the run, export its weights into <run_dir>/export as launch/export.py does (Note [export] in
    # parallel/export/__init__.py): from final_model.pt with save_final, else from the last checkpoint (which
    # no rank gathers whole), so it needs one of them.
    export: bool = False
    # Save a checkpoint (parallel.checkpoint) every N steps and at the last step; 0: none. The newest
    # keep_checkpoints complete ones are kept.
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    # Continue from a checkpoint: its directory, a run directory (its newest complete one), auto (this run
    # directory's newest; none there: start at step 0), or null (start at step 0). auto by default, so that a
    # requeued or restarted job goes on from where it stopped.
    resume: Optional[str] = "auto"
    # After a preemption signal (SIGTERM, SIGUSR1), stop at once when the step and its checkpoint have not
    # ended within this many seconds (Note [preemption] in parallel/preemption.py).
    preempt_timeout_s: float = 60.0
    # The ranks agree on a preemption signal at every step boundary when steps take this long, else every few
    # steps, about this many seconds apart (the check is a collective); 0: at every boundary.
    preempt_check_s: float = 0.1
    # Under SLURM, a preempted job requeues itself (submitit's protocol, or scontrol requeue).
    requeue: bool = False
    # Evaluate every N steps and at the last step (0: never), over eval_batches global batches of the eval data
    # (parallel.evaluation); forward only, and training goes on exactly as without it.
    eval_every: int = 0
    eval_batches: int = 4
    # Compile each repeated block with torch.compile (Note [regional compilation] in parallel/strategies/compile.py).
    compile: bool = False
    # Profile steps [START, END] (inclusive) with torch.profiler on every rank: Chrome traces in <run_dir>/profile/
    # (Note [profiles] in parallel/profiling.py). None: no profiler.
    profile: Optional[List[int]] = None
    # CUDA: record the allocator's history; a snapshot in <run_dir>/memory_snapshot/ on OOM and at the end.
    memory_snapshot: bool = False
    # One device's peak FLOP/s, the denominator of the logged MFU; None: the table of known GPUs, or the
    # CPU's matrix-product rate measured at start (Note [peak FLOP/s] in parallel/hardware.py).
    peak_flops: Optional[float] = None


@dataclass
class LossConfig:
    # A built-in by name (parallel.loss.LOSSES); None: the task's (regression: mse, classification and lm:
    # cross_entropy).
    name: Optional[str] = None
    # A user function "package.module.fn", (output, target, **args) -> a scalar; replaces the built-in.
    _target_: Optional[str] = None
    # Keyword arguments of the function (a built-in's too: label_smoothing, delta, ...).
    args: Dict[str, Any] = field(default_factory=dict)
    # Integer targets equal to it are padding: not counted, no loss (Note [global loss] in parallel/loss.py).
    ignore_index: int = -100
    # What the user's function returns: mean (over its samples) or sum (over its counted targets); either way
    # the run's loss is normalized over the counted targets of the whole global batch.
    reduction: str = "mean"


@dataclass
class MemoryConfig:
    # Per-device budget for the planner, e.g. "512MB" or 80e9; None: the device's own.
    budget: Optional[str] = None
    # Per-process CUDA memory cap (0, 1]; lets several jobs share a GPU. No effect on CPU.
    fraction: Optional[float] = None


@dataclass
class PlanConfig:
    # calibration.json made by launch/calibrate.py (Note [calibration] in parallel/planning/calibration.py): the rates
    # launch/plan.py and strategy=auto price a step with; None: this process measured at start.
    calibration: Optional[str] = None
    # launch/plan.py: each module's bytes on the first rank (plan.json by_module), its `top` largest printed.
    by_module: bool = False
    top: int = 20
    # true: every block traced; false: a model of many blocks alike traced at 2, 3 and 4 blocks and its plan
    # extended to its depth, to the same bytes (Note [planning by depth] in parallel/planning/depth.py).
    every_block: bool = False
    # strategy=auto over a cluster (Note [auto over a cluster] in parallel/planning/cluster.py): at most this many
    # layouts planned in full, and no plan started that would end after this many seconds of the search.
    auto_plans: int = 40
    auto_deadline_s: float = 480.0


@dataclass
class LinkConfig:
    # A link a device sends over: what it is, its bandwidth per direction per device (bytes/s) and the latency of
    # one step of a collective over it (seconds); null where the profile has no such link.
    kind: str = ""
    generation: Optional[int] = None
    bandwidth: Optional[float] = None
    latency: Optional[float] = None


@dataclass
class HardwareConfig:
    # The machine a plan's step time is priced on (conf/hardware/*.yaml; Note [hardware profiles] in
    # parallel/hardware.py). device cpu: this host, measured as launch/plan.py always has; cuda: a GPU profile,
    # priced from the figures below without running anything (Note [step time on a profile]).
    name: str = "cpu"
    device: str = "cpu"
    gpu: str = ""  # the device's name as torch gives it
    peak_flops: Dict[str, float] = field(default_factory=dict)  # dense FLOP/s by precision: bf16, tf32, fp32, fp8
    sms: Optional[int] = None  # streaming multiprocessors: the products' wave quantization
    memory_bytes: Optional[int] = None
    memory_bandwidth: Optional[float] = None  # bytes/s
    power_w: Optional[float] = None
    devices_per_node: int = 1
    node_link: LinkConfig = field(default_factory=LinkConfig)  # between the devices of a node (NVLink)
    network: LinkConfig = field(default_factory=LinkConfig)  # across nodes, per device
    host_link: LinkConfig = field(default_factory=LinkConfig)  # to the host's memory (PCIe)
    # Measured products: "MxNxK" -> FLOP/s in bf16 (launch/calibrate.py trainer.device=cuda writes them).
    gemm: Dict[str, float] = field(default_factory=dict)
    measured: str = ""  # where and when the measured figures were taken


@dataclass
class Config:
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    # Workers to start when not under torchrun; None: 1, or torchrun's world size.
    nproc: Optional[int] = None
    # Where the run writes; None: Hydra's output directory (or, under torchrun,
    # one chosen by rank 0 and shared with every rank).
    run_dir: Optional[str] = None


def _model_outputs(task: str, targets: int, classes: int, vocab_size: int) -> int:
    """Width of the model's output for a task (used by conf/model/*.yaml)."""
    return {"regression": targets, "classification": classes, "lm": vocab_size}.get(task, targets)


def from_dict(d: dict) -> Config:
    """A resolved config handed over as a plain dict (to a worker process) back as dataclasses; nothing is
    read or derived again."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), d))  # type: ignore[return-value]


def to_dict(cfg: Config) -> dict:
    """`cfg` as a plain dict that crosses process boundaries (and back with `from_dict`)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


# Groups that name a user's callable in `_target_` and may give its keyword arguments beside it, as Hydra's
# `instantiate` takes them, instead of under `args`: their nodes take keys their schema lacks, and
# parallel.instantiate moves those into `args` (and refuses them without a `_target_`).
TARGET_GROUPS = ("model", "data", "loss", "optim")


@dataclass
class ComposedConfig(Config):
    """The root schema Hydra composes conf/ against: Config, with the strategy node typed by the chosen
    conf/strategy/<name>.yaml's own schema instead of StrategyConfig (Note [strategy schemas])."""

    strategy: StrategyBase = field(default_factory=StrategyBase)


def schema() -> Any:
    """The root schema as a config node; the TARGET_GROUPS nodes accept keys beyond their dataclass's, and so
    does the strategy node, whose keys parallel.validate.strategy_config checks (Note [strategy schemas])."""
    node = OmegaConf.structured(ComposedConfig)
    for group in (*TARGET_GROUPS, "strategy"):
        OmegaConf.set_struct(node[group], False)
    return node


def register_configs() -> None:
    """Store the root schema so conf/config.yaml can extend it, and each strategy's schema so its
    conf/strategy/<name>.yaml can (`/strategy_schema/<name>@_here_` in its defaults list)."""
    if not OmegaConf.has_resolver("parallel_outputs"):
        OmegaConf.register_new_resolver("parallel_outputs", _model_outputs)
    if not OmegaConf.has_resolver("parallel_run_dir"):
        # hydra.run.dir: the user's run_dir when set, else Hydra's dated default.
        OmegaConf.register_new_resolver("parallel_run_dir", lambda chosen, default: chosen or default)
    store = ConfigStore.instance()
    store.store(name="parallel_schema", node=schema())
    for name, cls in SCHEMAS.items():
        store.store(group="strategy_schema", name=name, node=cls)


register_configs()


def strategy_spec(name: str) -> StrategySpec:
    """The row of the strategy table for `name` (Note [strategy table]). Raises ConfigError listing the
    strategies for an unknown name."""
    if name not in SPECS:
        fail("strategy.name", name, "unknown strategy", sorted(SPECS))
    return SPECS[name]


def positive(key: str, value: Any, allow_zero: bool = False) -> None:
    """Fail unless `value` is an integer >= 1 (>= 0 with allow_zero)."""
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        fail(key, value, f"must be an integer >= {low}")


def cuda_run(device: str) -> bool:
    """Whether `trainer.device` puts the run on CUDA."""
    import torch  # torch is heavy; the schemas alone do not need it

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def check_trainer(t: TrainerConfig) -> None:
    for key in ("steps", "batch_size", "grad_accum", "log_every"):
        positive(f"trainer.{key}", getattr(t, key))
    positive("trainer.seed", t.seed, allow_zero=True)
    positive("trainer.checkpoint_every", t.checkpoint_every, allow_zero=True)
    positive("trainer.keep_checkpoints", t.keep_checkpoints)
    positive("trainer.eval_every", t.eval_every, allow_zero=True)
    positive("trainer.eval_batches", t.eval_batches)
    if t.clip_grad_norm < 0:
        fail("trainer.clip_grad_norm", t.clip_grad_norm, "must be >= 0 (0 disables clipping)")
    if t.timeout_s <= 0:
        fail("trainer.timeout_s", t.timeout_s, "must be > 0 seconds")
    if not t.init_timeout_s >= t.timeout_s:
        fail("trainer.init_timeout_s", t.init_timeout_s, f"the wait before the first step has ended must be >= "
             f"trainer.timeout_s={t.timeout_s:g}", f">= {t.timeout_s:g}")
    if t.nonfinite not in NONFINITE:
        fail("trainer.nonfinite", t.nonfinite, "what a step with a non-finite loss or gradient norm does",
             list(NONFINITE))
    positive("trainer.nonfinite_limit", t.nonfinite_limit)
    if t.peak_flops is not None and not 0 < t.peak_flops < float("inf"):
        fail("trainer.peak_flops", t.peak_flops, "must be a device's peak FLOP/s > 0", ["e.g. 989e12", "null"])
    if not t.preempt_timeout_s > 0:
        fail("trainer.preempt_timeout_s", t.preempt_timeout_s, "must be > 0 seconds (after a preemption "
             "signal, the time a step and its checkpoint may take before the worker stops without saving)")
    if not t.preempt_check_s >= 0:
        fail("trainer.preempt_check_s", t.preempt_check_s, "must be >= 0 seconds (0: check for a preemption "
             "signal at every step boundary)")
    if t.device not in DEVICES:
        fail("trainer.device", t.device, "unknown device", list(DEVICES))
    if t.precision not in PRECISIONS:
        fail("trainer.precision", t.precision, "unknown precision", list(PRECISIONS))
    if t.export and not t.save_final and not t.checkpoint_every:
        fail("trainer.export", t.export, "exports what the run saves: set trainer.save_final=true (its final "
             "weights, gathered on rank 0) or trainer.checkpoint_every=N (its checkpoint at the last step)")
    if t.reduce_precision not in REDUCE_PRECISIONS:
        fail("trainer.reduce_precision", t.reduce_precision, "the dtype gradients are reduced in over "
             "data-parallel ranks", list(REDUCE_PRECISIONS))


def bf16_run(cfg: "Config") -> bool:
    """Whether the run computes in bf16 (autocast, and FSDP2 gathering bf16 copies): trainer.precision=bf16, or
    auto on CUDA."""
    t = cfg.trainer
    return t.precision == "bf16" or (t.precision == "auto" and cuda_run(t.device))
