"""The configuration, composed once: typed, resolved (derived values filled in) and validated, before any
worker starts. Workers receive it resolved and do not resolve it again, and beside it what was read from the
data (a DataSpec: Note [data spec] in parallel/data/spec.py).

Each concern checks its own settings beside its code; this module only calls
those checks, in the order below, and stops at the first broken rule with a
ConfigError naming the key, the value, the rule and the options.
"""
from __future__ import annotations

import dataclasses
import difflib

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from parallel.batchnorm import check_sync_batchnorm
from parallel.checkpoint import check_resume
from parallel.config import (
    TARGET_GROUPS,
    Config,
    StrategyConfig,
    check_trainer,
    error_text,
    fail,
    pipelined,
    positive,
    schema,
    strategy_spec,
    takers,
    tensor_parallel,
)
from parallel.data import DataSpec, check_data, example_target, has_eval_data, read_hints
from parallel.dims import ParallelDims
from parallel.hardware import check_hardware
from parallel.instantiate import move_beside_keys
from parallel.loss import check_loss, check_loss_config, derive_output_loss
from parallel.lr_schedule import check_schedule
from parallel.memory.budget import check_memory
from parallel.models.build import check_model, check_model_takes_data
from parallel.models.recipe import derive_auto_class
from parallel.models.weights import check_weights
from parallel.optim import check_optim, check_optimizer
from parallel.preemption import check_requeue
from parallel.profiling import check_profile
from parallel.strategies import check_strategy
from parallel.strategies.compile import check_compile
from parallel.strategies.context import check_context
from parallel.strategies.data import check_replicas
from parallel.strategies.expert import check_experts
from parallel.strategies.offload.check import check_offload_disk
from parallel.strategies.pipeline import check_pipeline, check_split, schedules
from parallel.strategies.recompute import check_recompute_degrees
from parallel.strategies.tensor import check_loss_parallel, check_plan, check_tensor_keys


def to_config(cfg: DictConfig | dict) -> Config:
    """`to_config_with_data`'s config alone."""
    return to_config_with_data(cfg)[0]


def to_config_with_data(cfg: DictConfig | dict) -> tuple[Config, DataSpec]:
    """Turn a composed DictConfig (or its plain-dict form: a config composed before, read back) into typed
    dataclasses, and what was read from the data.

    A key the strategy does not take is refused first (Note [strategy schemas] in parallel/strategy_specs.py; a
    plain dict's strategy takes every key). With data=shards the task and sizes come from the dataset's
    manifest, with data=custom from its first sample, set before interpolations resolve (a model's
    `${data.features}` reads them); the sample's fields and the dataset's size are the DataSpec (Note [data
    spec] in parallel/data/spec.py).
    """
    strict = not isinstance(cfg, dict)
    if not strict:
        if isinstance(cfg.get("data"), dict) and "spec" in cfg["data"]:  # read back from a run made when the
            cfg = {**cfg, "data": {k: v for k, v in cfg["data"].items() if k != "spec"}}  # config held it
        cfg = OmegaConf.merge(schema(), cfg)
    else:
        refuse_appended_keys(cfg)
    cfg.strategy = strategy_config(cfg.strategy, strict)
    move_beside_keys(cfg)  # before the user's dataset is first called (Note [instantiate shape])
    hints, data = read_hints(cfg.data)
    for key, value in hints.items():
        cfg.data[key] = value
    composed = OmegaConf.to_object(cfg)
    return Config(**{f.name: getattr(composed, f.name) for f in dataclasses.fields(Config)}), data


def refuse_appended_keys(node: DictConfig, path: str = "") -> None:
    """A key that Hydra's `+key=value` appended where the schema has none (Hydra opens a node to append to
    it, whatever its schema): a ConfigError naming it, the closest key and the valid ones. The groups whose
    `_target_` takes keyword arguments beside it (TARGET_GROUPS) take any key at their top (parallel.instantiate
    checks those), their nested settings not; the strategy's keys are its schema's (`strategy_config`)."""
    cls = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(cls):
        return
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in node:
        name = f"{path}.{key}" if path else str(key)
        if key not in fields and path not in TARGET_GROUPS:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {path + '.' if path else ''}{close[0]}?" if close else ""
            fail(name, OmegaConf.to_container(node)[key] if OmegaConf.is_config(node[key]) else node[key],
                 f"no such key{f' of {path}' if path else ''}{hint}", fields)
        child = node._get_node(key)
        if name != "strategy" and isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            refuse_appended_keys(child, name)


def strategy_config(node: DictConfig, strict: bool = True) -> StrategyConfig:
    """The composed strategy node as the StrategyConfig the code reads, every key the strategy does not take at
    its default (Note [strategy schemas] in parallel/strategy_specs.py).

    Args:
        node: the `strategy` node of a composed config.
        strict: refuse a key that the named strategy does not take (a config composed from conf/ and the
            command line); false: take every StrategyConfig key (a run's config read back, which may hold
            all of them: Note [strategy schemas]).

    Raises:
        ConfigError: naming the key and the strategy, or the value of the wrong type.
    """
    raw = OmegaConf.to_container(node, resolve=True)
    name = raw.get("name")
    spec = strategy_spec(name)
    if strict:
        for key, value in raw.items():
            if key != "name" and key not in spec.keys:
                others = [n for n in takers(key) if n != name]
                where = f"but of strategy={', '.join(others)}" if others else "nor of another strategy"
                fail(f"strategy.{key}", value, f"not a key of strategy={name}, {where}", sorted(spec.keys))
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(StrategyConfig), raw))
    except OmegaConfBaseException as e:  # a key given beside the group's schema (strategy.name=...), untyped
        key = getattr(e, "key", None)
        fail(f"strategy.{key}", raw.get(key), error_text(e))


def resolve(cfg: Config, world_size: int) -> Config:
    """Fill the values left to be derived (degrees, schedule spelling, stages per rank, microbatches), in
    place. Idempotent: a resolved config resolves to itself."""
    s = cfg.strategy
    dims = ParallelDims.from_config(s, world_size)
    s.dp, s.ep, s.pp, s.cp, s.tp = dims.dp, dims.ep, dims.pp, dims.cp, dims.tp
    if pipelined(s):
        name = schedules.canonical(s.schedule)
        if name is None:
            fail("strategy.schedule", s.schedule, "unknown schedule (case-insensitive)", list(schedules.SCHEDULES))
        s.schedule = name
        if s.stages_per_rank is None:
            s.stages_per_rank = schedules.default_stages_per_rank(name)
        positive("strategy.stages_per_rank", s.stages_per_rank)  # before microbatches are derived from it
        if s.microbatches is None:
            s.microbatches = 2 * s.pp * s.stages_per_rank
    return cfg


def validate(cfg: Config, world_size: int, data: DataSpec | None = None) -> None:
    """Check every rule of `cfg` for `world_size` workers; raise ConfigError on the first broken one. Also
    resolves `cfg` (see `resolve`). `data`: what was read from the data (`to_config_with_data`), which
    data=custom has; None for the other sources."""
    # 1. Each group's own values: cheap, and nothing below is meaningful without them.
    check_trainer(cfg.trainer)
    check_profile(cfg.trainer)
    check_requeue(cfg.trainer.requeue)
    if cfg.nproc is not None:
        positive("nproc", cfg.nproc)
    check_optim(cfg.optim)
    check_schedule(cfg)
    check_data(cfg.data, cfg.trainer.batch_size, cfg.trainer.eval_every, data)  # data=custom's checks read it
    data = data or DataSpec()
    _derive(cfg, data)
    check_loss_config(cfg.loss)
    _check_eval_data(cfg)
    check_memory(cfg.memory)
    check_hardware(cfg, world_size)  # a GPU profile makes the run CUDA's and bounds memory.budget
    s = cfg.strategy
    spec = strategy_spec(s.name)  # its row of the table (Note [strategy table])
    if spec.chooses:  # each candidate is validated as it is tried (parallel.planning.auto)
        check_optimizer(cfg, check_model(cfg.model))
        return
    # 2. The strategy's keys, by name first (a plain strategy may reject a degree while resolving), then the
    #    degrees derived from the world size, then the keys that depend on them.
    check_strategy(cfg, world_size)
    resolve(cfg, world_size)
    _check_degree_keys(s)
    check_loss_parallel(cfg)
    _check_inputs_by_name(cfg, data)
    per_rank = _check_batch(cfg)
    if pipelined(s):
        check_pipeline(cfg, per_rank)
    # 3. The model, then what needs it: the optimizer's patterns, the offload disk, BatchNorm layers to sync, a
    #    checkpoint to resume, blocks to compile, the tensor plan, the pipeline split, the data through the model.
    #    Each reads the one meta model built here and leaves it as it is (a split or a rehearsal works on a copy).
    model = check_model(cfg.model)
    check_optimizer(cfg, model)
    check_weights(cfg.model, model)
    if spec.offloads and s.path is not None:
        check_offload_disk(cfg, model)
    if s.sync_batchnorm:
        check_sync_batchnorm(cfg, model)
    if cfg.trainer.resume is not None:
        check_resume(cfg)
    if s.ep > 1 or s.cp > 1:
        check_experts(model, s.ep, s.cp, s.zero, s.pp, s.tp)
    check_compile(cfg, model)
    if tensor_parallel(s):
        check_plan(model, cfg, data)
    if s.cp > 1:  # before the split, which traces the model on the cp chunks
        check_context(cfg, model)
    if pipelined(s):
        check_split(model, cfg, data)
    out = check_model_takes_data(cfg, model, data)
    if out is not None:
        check_loss(cfg.loss, cfg.data.task, out, example_target(cfg.data, spec=data))


def _check_eval_data(cfg: Config) -> None:
    if cfg.trainer.eval_every and not has_eval_data(cfg.data):
        fail("trainer.eval_every", cfg.trainer.eval_every, f"data={cfg.data.name} has no eval data",
             ["0 (no evaluation)", "data=synthetic (a held-out stream)", "data=custom with data.eval"])


def _derive(cfg: Config, data: DataSpec) -> None:
    """What the data says of the model and the loss: model=hf without architectures gets the task's class;
    targets that go to the forward by name, the model's own loss (`loss.name=output`)."""
    derive_auto_class(cfg.model, cfg.data.task)
    derive_output_loss(cfg.loss, list(data.named or ()), cfg.data.target_key)


def _check_degree_keys(s: StrategyConfig) -> None:
    """The strategy keys whose meaning depends on the derived degrees: the tensor-parallel keys (tp > 1), the
    replicas of hybrid sharding (a divisor of dp), and what selective recomputation does not take (expert
    parallelism)."""
    check_tensor_keys(s, tensor_parallel(s))
    check_replicas(s)
    check_recompute_degrees(s)


def _check_inputs_by_name(cfg: Config, data: DataSpec) -> None:
    """Fields passed to the forward by name (Note [inputs by name] in parallel/tensors.py) go where a batch is
    cut by rows; the strategies that cut sequences, trace the forward into stages or infer a plan from it take
    one input tensor."""
    s = cfg.strategy
    if not data.named:
        return
    cuts = [why for on, why in ((pipelined(s), f"strategy.pp={s.pp} traces a forward of one input tensor into "
                                 "stages"), (s.cp > 1, f"strategy.cp={s.cp} cuts one token tensor's sequences"),
                                (tensor_parallel(s), f"strategy.tp={s.tp} plans its layers on one input tensor"))
            if on]
    if cuts:
        fail("data.input_key", list(data.named), f"fields passed by name train under single, data "
             f"and offload; {cuts[0]}", ["one input field (data.input_key=NAME)", "strategy=data"])


def _check_batch(cfg: Config) -> int:
    """The global batch divides over the dp x ep ranks (Note [mesh dimensions]) and grad_accum micro-steps;
    returns the per-rank batch."""
    t, s = cfg.trainer, cfg.strategy
    ranks = s.dp * s.ep
    degree = f"dp {s.dp}" if s.ep == 1 else f"dp {s.dp} x ep {s.ep}"
    per_rank = t.batch_size // ranks
    if t.batch_size % ranks:
        fail("trainer.batch_size", t.batch_size, f"the global batch must divide by the data-parallel degree "
             f"{degree}", f"a multiple of {ranks}")
    if per_rank % t.grad_accum:
        fail("trainer.grad_accum", t.grad_accum,
             f"must divide the per-rank batch {per_rank} (= trainer.batch_size {t.batch_size} / {degree})",
             [d for d in range(1, per_rank + 1) if per_rank % d == 0])
    return per_rank

