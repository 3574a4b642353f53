"""strategy=auto over a cluster: the layouts dp x tp x pp x cp that divide the world, and what rules them out
before anything is planned (Note [auto over a cluster] in parallel/planning/cluster.py).

A layout is one way to run: the four degrees, how the data-parallel ranks shard (zero 0-3, hybrid sharding's
replicas), a pipeline's schedule, stages per rank and microbatches, and the activation policy. Enumerating
them is arithmetic on the degrees and on the model's shape (`ModelShape`: read once from the meta model), so
tens of thousands cost a second; a rule broken here is counted by its reason and never planned.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from parallel.blocks import nested, repeated_blocks
from parallel.config import Config, StrategyConfig
from parallel.strategies.pipeline import schedules

POLICIES = ("device", "selective", "checkpoint")  # strategy.activations: most memory first
MULTI_STAGES = (2, 4)  # stages per rank tried for interleaved and looped schedules (V-shaped: 2)


@dataclass
class Candidate:
    """One strategy auto tries: its name, the strategy overrides that make it, and what planning found."""
    name: str
    overrides: list[str]
    peak: int | None = None  # the largest rank's predicted peak, bytes
    times: dict = field(default_factory=dict)  # compute, bubble, comm, transfers, step (seconds)
    dropped: str | None = None  # why it does not run


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with a fresh strategy section set by `overrides` (strategy=NAME, strategy.KEY=VALUE)."""
    c = copy.deepcopy(cfg)
    c.strategy = StrategyConfig(schedule=cfg.strategy.schedule, microbatches=cfg.strategy.microbatches)
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "strategy":
            c.strategy.name = value
            continue
        attr = key.split(".", 1)[1]
        current = getattr(c.strategy, attr)
        if isinstance(current, bool):
            setattr(c.strategy, attr, value == "true")
            continue
        setattr(c.strategy, attr, int(value) if isinstance(current, int) or current is None and value.isdigit()
                else value)
    return c


@dataclass(frozen=True)
class ModelShape:
    """What the enumeration and the screen read of the model, once, from its meta build."""
    params: int  # trained parameters, all
    block_params: int  # one block's of its list of blocks alike (0: no such list)
    blocks: int  # blocks in that list
    param_bytes: int  # bytes per parameter element (the model's dtype)
    nested: bool  # its blocks sit inside other modules: a pipeline runs them traced (Note [own or traced blocks])
    hidden: int | None = None  # the embedding's width
    vocab: int | None = None  # the embedding's rows
    heads: tuple[int, ...] = ()  # attention head counts tensor parallelism must divide (q, and kv heads)
    # its tensor-parallel plan takes sequence and loss parallelism (probed once, parallel.planning.cluster)
    cuts_sequence: bool = False

    @classmethod
    def of(cls, model: nn.Module, cuts_sequence: bool = False) -> "ModelShape":
        trained = [p for p in model.parameters() if p.requires_grad]
        names = repeated_blocks(model)
        parents = Counter(n.rpartition(".")[0] for n in names)  # the longest list of blocks
        blocks = [n for n in names if n.rpartition(".")[0] == parents.most_common(1)[0][0]] if parents else []
        first = model.get_submodule(blocks[0]) if blocks else None
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        return cls(params=sum(p.numel() for p in trained),
                   block_params=sum(p.numel() for p in first.parameters() if p.requires_grad) if first else 0,
                   blocks=len(blocks), param_bytes=trained[0].element_size() if trained else 4,
                   nested=bool(blocks) and nested(model, blocks[0]),
                   hidden=embedding.embedding_dim if embedding is not None else None,
                   vocab=embedding.num_embeddings if embedding is not None else None, heads=_heads(model),
                   cuts_sequence=cuts_sequence)


def _heads(model: nn.Module) -> tuple[int, ...]:
    """The head counts of the model's attention (Hugging Face's config keys, else an attention module's own)."""
    config = getattr(model, "config", None)
    counts = [getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads")
              if isinstance(getattr(config, k, None), int)]
    if counts:
        return tuple(counts)
    for m in model.modules():
        for k in ("heads", "num_heads"):
            if isinstance(getattr(m, k, None), int) and not isinstance(getattr(m, k), bool):
                return (getattr(m, k),)
    return ()


@dataclass(frozen=True)
class Layout:
    """One way to run on the world (its product): degrees, sharding, pipeline schedule, activation policy."""
    dp: int
    tp: int
    pp: int
    cp: int
    zero: int
    replicate: int = 1  # strategy.dp_replicate (hybrid sharding's replicas); 1: none
    activations: str = "device"
    schedule: str | None = None  # pp > 1
    stages: int = 1  # stages per rank
    microbatches: int = 1
    sequence: bool = False  # strategy.sequence_parallel and loss_parallel (tp > 1, no pipeline, no cp)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def degrees(self) -> tuple[int, int, int, int]:
        return self.dp, self.tp, self.pp, self.cp

    @property
    def name(self) -> str:
        text = f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp} zero {self.zero}"
        if self.replicate > 1:
            text += f" r{self.replicate}"
        if self.pp > 1:
            text += f" {self.schedule} v{self.stages} m{self.microbatches}"
        if self.sequence:
            text += " sp"
        return text + ("" if self.activations == "device" else f", {self.activations}")

    @property
    def overrides(self) -> list[str]:
        """The strategy settings that run it: strategy=data when only dp spreads, else hybrid."""
        hybrid = (self.tp, self.pp, self.cp) != (1, 1, 1)
        out = ["strategy=hybrid" if hybrid else "strategy=data"]
        if hybrid:
            out += [f"strategy.dp={self.dp}", f"strategy.tp={self.tp}", f"strategy.pp={self.pp}",
                    f"strategy.cp={self.cp}"]
        out.append(f"strategy.zero={self.zero}")
        if self.replicate > 1:
            out.append(f"strategy.dp_replicate={self.replicate}")
        if self.pp > 1:  # balanced by parameters, so the run cuts where the plan did (Note [auto])
            out += [f"strategy.schedule={self.schedule}", f"strategy.stages_per_rank={self.stages}",
                    f"strategy.microbatches={self.microbatches}", "strategy.balance=params"]
        if self.activations != "device":
            out.append(f"strategy.activations={self.activations}")
        if self.sequence:
            out += ["strategy.sequence_parallel=true", "strategy.loss_parallel=true"]
        return out

    def candidate(self) -> Candidate:
        return Candidate(self.name, self.overrides)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(world: int, shape: ModelShape, cfg: Config, per_node: int) -> tuple[list[Layout], Counter]:
    """Every layout of `world` ranks the rules allow (tp within a node of `per_node` devices and dividing the
    heads, pp over the blocks, the batch over dp and the microbatches, the sequence over 2 x cp), and the
    count of the degree combinations (dp, tp, pp, cp) and pipeline settings ruled out, by reason. With tp > 1
    and neither pp nor cp, a model whose plan takes them (`shape.cuts_sequence`) runs with sequence and loss
    parallelism where tp divides the sequence, as torchtitan's tensor parallelism does."""
    out, refused = [], Counter()
    t = cfg.trainer
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for cp in divisors(world // tp // pp):
                dp = world // (tp * pp * cp)
                why = _degrees_refused(dp, tp, pp, cp, shape, cfg, per_node)
                if why:
                    refused[why] += 1
                    continue
                per_rank = t.batch_size // dp
                pipes = [(None, 1, 1)] if pp == 1 else _pipelines(pp, per_rank, shape, cfg.strategy, refused)
                sp = shape.cuts_sequence and tp > 1 and pp == cp == 1 and cfg.data.seq_len % tp == 0
                for schedule, stages, m in pipes:
                    # a backward in two halves recomputes twice, which torch's checkpoint cannot (check_pipeline)
                    policies = ("device",) if schedule in schedules.SPLIT_BACKWARD else POLICIES
                    for zero, r in _shardings(dp * cp, dp):
                        out += [Layout(dp, tp, pp, cp, zero, r, a, schedule, stages, m, sp) for a in policies]
    return out, refused


def _degrees_refused(dp: int, tp: int, pp: int, cp: int, shape: ModelShape, cfg: Config, per_node: int) -> str | None:
    """Why the degrees cannot run the model on this data, or None."""
    t, seq = cfg.trainer, cfg.data.seq_len
    if tp > per_node or per_node % tp:
        return f"tp not a divisor of the {per_node} devices of a node"
    if tp > 1 and any(h % tp for h in shape.heads):
        return f"tp does not divide the heads {'/'.join(map(str, shape.heads))}"
    if t.batch_size % dp:
        return f"dp does not divide the batch {t.batch_size}"
    if pp == 1 and (t.batch_size // dp) % t.grad_accum:
        return f"trainer.grad_accum {t.grad_accum} does not divide the per-rank batch"
    if cp > 1 and (cfg.data.task != "lm" or seq % (2 * cp)):
        return f"cp: data.seq_len {seq} does not split into 2 x cp chunks" if cfg.data.task == "lm" else \
            "cp needs data.task=lm"
    if pp > 1:
        if pp > shape.blocks:
            return f"pp above the model's {shape.blocks} blocks"
        if t.grad_accum != 1:
            return "pp with trainer.grad_accum != 1"
    return None


def _pipelines(pp: int, per_rank: int, shape: ModelShape, s: StrategyConfig, refused: Counter) -> list[tuple]:
    """(schedule, stages per rank, microbatches) of a pp-stage pipeline over a per-rank batch: every schedule,
    m = p, 2p, 4p (or strategy.microbatches), the refused ones counted in `refused` by reason."""
    out = []
    for name in schedules.SCHEDULES:
        multi = schedules.is_multi_stage(name)
        for v in ((2,) if name in schedules.V_SHAPED else MULTI_STAGES) if multi else (1,):
            if pp * v > shape.blocks:
                refused[f"pp x stages per rank above the model's {shape.blocks} blocks"] += 1
                continue
            for m in (s.microbatches,) if s.microbatches else (pp, 2 * pp, 4 * pp):
                why = "microbatches do not divide the per-rank batch" if per_rank % m else \
                    schedules.check(name, pp, v, m)
                if why:
                    refused[why if per_rank % m else f"{name}: {why}"] += 1
                else:
                    out.append((name, v, m))
    return out


def _shardings(n: int, dp: int) -> list[tuple[int, int]]:
    """(zero, dp_replicate) over `n` data-parallel ranks (dp x cp): zero 0 alone when n is 1 (nothing to shard),
    else 0-3 and zero 3 in R groups for each divisor 1 < R < dp of dp (Note [hybrid sharding])."""
    if n == 1:
        return [(0, 1)]
    return [(z, 1) for z in range(4)] + [(3, r) for r in divisors(dp) if 1 < r < dp]
