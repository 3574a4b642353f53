"""The strategies described once: every strategy key (`StrategyConfig`), one row per strategy of what it does
and takes (`SPECS`), and each strategy's own schema made from its row (`SCHEMAS`).

# Note [strategy table]
A strategy is one row of `SPECS`: the mesh dimensions it spreads over, the `strategy.zero` levels it takes,
whether it needs one device, streams from the tiers below the device, compiles its blocks or chooses another
strategy, and its keys. The rest of the code asks a row's capabilities (`spec.pipelines`, `spec.one_device`,
`spec.zero`) or a degree (`s.pp > 1`), never a strategy's name; a new strategy is a new row here, its builder and
its own checks in parallel/strategies/__init__.py (`STRATEGIES`, keyed by the same names), and its
conf/strategy/<name>.yaml. A row that spreads over one dimension applies that dimension's piece even at degree 1
(strategy=pipeline on one rank is a one-stage pipeline); a row that spreads over several (hybrid) combines them,
each applied where its degree is above 1, and derives unset degrees together (parallel.dims). Who reads what:

    spreads       parallel.dims (the degrees), `pipelined` and `tensor_parallel` below (validation, batch norm,
                  the pipeline checks, auto's bubble), check_strategy (tensor-parallel keys)
    zero          check_strategy
    one_device    check_strategy
    offloads      check_strategy (activation tiers), validate (the disk's room), auto (transfers), the advice
                  after an out-of-memory (parallel.memory.oom)
    compiles      parallel.strategies.compile
    chooses       validate, launch/train.py and launch/plan.py (plan the candidates first: parallel.planning.auto)
    keys          the strategy's schema (Note [strategy schemas])

# Note [strategy schemas]
Each conf/strategy/<name>.yaml names its own schema first in its defaults list (`/strategy_schema/<name>@_here_`,
stored in Hydra's ConfigStore by parallel.config.register_configs): a dataclass holding only that strategy's keys,
made below from `StrategyConfig` and the row's `keys` (hybrid: the keys of the strategies it combines; auto: the
two it passes to its candidates). The root schema (`ComposedConfig`) leaves the strategy node's type to it, so
Hydra types the node per strategy: a value of the wrong type fails while composing, as in any group. A key the
strategy does not take (`strategy=pipeline strategy.zero=3`) passes composition and is refused by `strategy_config`
in parallel/validate.py, the first thing `to_config` does with the composed config, before any data is read or
worker started: one line naming the key, the strategy and its keys, exit status 2. Hydra would refuse it itself if
the node were closed, but inside `hydra.main`, before the entry wrapper (parallel/entry.py) sees anything: several
lines and exit status 1. So the node is left open, as the TARGET_GROUPS nodes are (Note [instantiate shape]), and
the keys are checked against the strategy that `strategy.name` names (an override of the name alone keeps its
group's schema; the named strategy's keys are the ones that count). A plain dict given to `to_config` (a run's
.hydra/config.yaml read back, which holds every key when rank 0 of a torchrun run wrote it, or a run made before
these schemas) is typed without the refusal. After `to_config` the code sees one `StrategyConfig` holding every key,
those the strategy does not take at their defaults: nothing that reads another strategy's key has to ask whether it is
there, and the config crosses to the workers as before.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import List, Optional

ZERO_LEVELS = (0, 1, 2, 3)
NO_ZERO = (0,)


@dataclass
class StrategyBase:
    """What every strategy's schema has: the strategy's name."""

    name: str = "single"


@dataclass
class StrategyConfig(StrategyBase):
    """Every strategy key: what the code reads after validation (Note [strategy schemas]); each strategy takes
    the keys of its row of SPECS."""

    # Data-parallel degree; None derives it from the world size.
    dp: Optional[int] = None
    # 0: DDP, 1: optimizer state sharded, 2: + gradients (FSDP2, no reshard
    # after forward), 3: + parameters (FSDP2, reshard after forward).
    zero: int = 0
    # Zero 2 and 3 (HSDP): replicas of the sharded group; FSDP2 shards over groups of dp / dp_replicate ranks
    # and all-reduces the gradient shards across the dp_replicate groups. None or 1: one group of all dp ranks
    # (Note [hybrid sharding] in parallel/dims.py).
    dp_replicate: Optional[int] = None
    # Pipeline degree (ranks in one pipeline); None derives it from the world size.
    pp: Optional[int] = None
    # PyTorch schedule name, case-insensitive (see parallel.strategies.pipeline.schedules).
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
    # tensor-parallel layers (the built-in gpt, a Hugging Face model's own plan, or seq_* styles).
    sequence_parallel: bool = False
    # Keep the output head's logits split by the vocabulary over the tp ranks and compute the built-in
    # cross-entropy on the pieces (PyTorch's loss_parallel), instead of gathering them whole on every rank.
    loss_parallel: bool = False
    # Context-parallel degree (ranks splitting each sample's sequence); None: the world size under
    # strategy=context, 1 under hybrid.
    cp: Optional[int] = None
    # Expert-parallel degree (ranks splitting a mixture-of-experts layer's experts); None: the world size under
    # strategy=expert, 1 under hybrid.
    ep: Optional[int] = None
    # Offload (one device): the tier each kind lives on: device, cpu, disk, auto (the
    # tier below the device); activations also checkpoint (recompute in backward),
    # which every other strategy takes too (per block: parallel.strategies.recompute),
    # and, outside offload, selective (part of each block, or some blocks: `selective`).
    params: str = "auto"
    optimizer: str = "auto"
    activations: str = "device"
    # strategy.activations=selective: "op" (the matrix products' and attention's outputs saved in every block,
    # the rest recomputed), "op_alternate" (the same, every second product recomputed: torchtitan's op policy)
    # or a positive integer N (every N-th block recomputed whole; Note [selective recomputation] in
    # parallel/strategies/recompute.py).
    selective: str = "op"
    # Directory for the disk tier; None: <run_dir>/offload. Removed at the end.
    path: Optional[str] = None
    # Blocks read ahead of the one computing.
    prefetch: int = 1
    # Run a model's frozen leading part one batch ahead, on its own thread, while
    # the rest trains (models with frozen_forward/trainable_forward, e.g. stacked).
    lookahead: bool = True
    # strategy=data, or hybrid with dp > 1: BatchNorm statistics over the data-parallel ranks (the global
    # batch) instead of each rank's share (Note [batch norm] in parallel/batchnorm.py).
    sync_batchnorm: bool = False


@dataclass(frozen=True)
class StrategySpec:
    """One row of the strategy table (Note [strategy table])."""

    spreads: tuple[str, ...]  # the mesh dimensions it spreads over (Note [mesh dimensions] in parallel/dims.py)
    zero: tuple[int, ...]  # the strategy.zero levels it takes
    one_device: bool  # runs on one process
    offloads: bool  # streams weights, optimizer state and activations from the tiers below the device
    compiles: bool  # trainer.compile applies (Note [regional compilation] in parallel/strategies/compile.py)
    chooses: bool  # picks one of the others before the workers start, and builds nothing itself (auto)
    keys: tuple[str, ...]  # its keys under `strategy.` besides name (Note [strategy schemas])

    @property
    def combines(self) -> bool:
        """It spreads over several dimensions at once, each where its degree is above 1."""
        return len(self.spreads) > 1

    @property
    def pipelines(self) -> bool:
        """It may split the model into pipeline stages (`pipelined` says whether a resolved config does)."""
        return "pp" in self.spreads

    @property
    def splits_tensors(self) -> bool:
        """It may split layers over tensor-parallel ranks (`tensor_parallel` says whether a config does)."""
        return "tp" in self.spreads


# The keys of each piece; a strategy that composes pieces takes theirs.
# Every strategy that builds: device, checkpoint or selective (offload: its tiers and checkpoint, and no selective)
ACTIVATIONS = ("activations", "selective")
DATA = ("dp", "dp_replicate", "zero", "sync_batchnorm")
PIPELINE = ("pp", "schedule", "microbatches", "stages_per_rank", "split_points", "balance")
TENSOR = ("tp", "tp_plan", "sequence_parallel", "loss_parallel")
CONTEXT = ("cp", "zero")
EXPERT = ("ep", "zero")
OFFLOAD = ("params", "optimizer", "path", "prefetch", "lookahead")


def _keys(*pieces: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(k for piece in pieces for k in piece))


SPECS: dict[str, StrategySpec] = {
    "single": StrategySpec(spreads=(), zero=NO_ZERO, one_device=True, offloads=False, compiles=True,
                           chooses=False, keys=ACTIVATIONS),
    "data": StrategySpec(spreads=("dp",), zero=ZERO_LEVELS, one_device=False, offloads=False, compiles=True,
                         chooses=False, keys=_keys(DATA, ACTIVATIONS)),
    "pipeline": StrategySpec(spreads=("pp",), zero=NO_ZERO, one_device=False, offloads=False, compiles=True,
                             chooses=False, keys=_keys(PIPELINE, ACTIVATIONS)),
    "model": StrategySpec(spreads=("tp",), zero=NO_ZERO, one_device=False, offloads=False, compiles=True,
                          chooses=False, keys=_keys(TENSOR, ACTIVATIONS)),
    # Each sequence split over the cp ranks; the weights data-parallel over them (zero as strategy=data).
    "context": StrategySpec(spreads=("cp",), zero=ZERO_LEVELS, one_device=False, offloads=False, compiles=True,
                            chooses=False, keys=_keys(CONTEXT, ACTIVATIONS)),
    # The experts over the ep ranks, the other weights data-parallel over them.
    "expert": StrategySpec(spreads=("ep",), zero=ZERO_LEVELS, one_device=False, offloads=False, compiles=True,
                           chooses=False, keys=_keys(EXPERT, ACTIVATIONS)),
    # Every dimension on one mesh, tp innermost; each zero level as under strategy=data (parallel.strategies.hybrid).
    "hybrid": StrategySpec(spreads=("dp", "ep", "pp", "cp", "tp"), zero=ZERO_LEVELS, one_device=False,
                           offloads=False, compiles=True, chooses=False,
                           keys=_keys(DATA, EXPERT, PIPELINE, CONTEXT, TENSOR, ACTIVATIONS)),
    # Its blocks' weights and activations move through its own hooks, which compiled blocks do not follow.
    "offload": StrategySpec(spreads=(), zero=NO_ZERO, one_device=True, offloads=True, compiles=False,
                            chooses=False, keys=_keys(OFFLOAD, ACTIVATIONS)),
    # Plans the others (parallel.planning.auto); its candidates take the user's schedule and microbatches.
    "auto": StrategySpec(spreads=(), zero=NO_ZERO, one_device=False, offloads=False, compiles=False,
                         chooses=True, keys=("schedule", "microbatches")),
}


def takers(key: str) -> list[str]:
    """The strategies whose keys hold `key`, in table order."""
    return [name for name, spec in SPECS.items() if key in spec.keys]


def _default(f: dataclasses.Field) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory)
    return field(default=f.default)


def _schema(name: str, spec: StrategySpec) -> type:
    """The dataclass of strategy `name`'s own keys, as StrategyConfig types and defaults them."""
    hints = typing.get_type_hints(StrategyConfig)
    own = [(f.name, hints[f.name], _default(f)) for f in dataclasses.fields(StrategyConfig) if f.name in spec.keys]
    return dataclasses.make_dataclass(f"{name.capitalize()}Strategy", [("name", str, field(default=name)), *own],
                                      bases=(StrategyBase,), namespace={"__module__": __name__})


# Note [strategy schemas]: each strategy's own schema, the base of its conf/strategy/<name>.yaml.
SCHEMAS: dict[str, type] = {name: _schema(name, spec) for name, spec in SPECS.items()}


def pipelined(s: StrategyConfig) -> bool:
    """Whether the model is split into pipeline stages (after the degrees are resolved; Note [strategy table])."""
    spec = SPECS[s.name]
    return spec.pipelines and (not spec.combines or (s.pp or 1) > 1)


def tensor_parallel(s: StrategyConfig) -> bool:
    """Whether layers are split over tensor-parallel ranks (after the degrees are resolved; Note [strategy
    table])."""
    spec = SPECS[s.name]
    return spec.splits_tensors and (not spec.combines or (s.tp or 1) > 1)
