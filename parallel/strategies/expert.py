"""Expert parallelism (`strategy.ep`): each mixture-of-experts layer's experts split over the ep ranks, tokens
sent to their experts' ranks and back with all-to-all.

# Note [expert parallelism]
Every layer that follows the MoE interface (Note [moe layer] in parallel/models/moe.py: `router`, `experts`,
`top_k`, `run_experts`) keeps E / ep of its experts on each ep rank, the contiguous run rank x E/ep ..
(rank + 1) x E/ep - 1, in an `ExpertShard`: a ModuleDict keyed by the experts' own indices, so their names
(`experts.3.up.weight`) are the unpartitioned model's and checkpoints move between degrees. The ep ranks read
different samples (the batch is split over dp x ep, Note [mesh dimensions] in parallel/dims.py), so the dense
weights are data-parallel over dp x ep like any other data-parallel weights; the experts are data-parallel
over dp only (each expert its own unit over mesh["dp"], before the block's unit, which then leaves it out).

A layer's step: each rank groups its (token, choice) pairs by expert (run_experts), tells every ep rank how
many it sends to each of that rank's experts (an all-to-all of counts), sends the tokens (all-to-all with
those split sizes: PyTorch's autograd all-to-all, which runs on gloo), runs each of its experts once on what
every rank sent it, and sends the outputs back the same way. The outputs come back in the order the tokens
left, so the weighted sum per token adds in the same order as on one device.

Gradients: every rank's loss is scaled by the dense weights' averaging degree dp x ep (Note [global loss] in
parallel/loss.py), and an expert sums the tokens of all ep ranks, then is averaged over dp only: its
gradient would be ep times too large. The expert side divides the gradient reaching the experts by ep and
multiplies the one leaving them (to the tokens) by ep again, which is exact for powers of two. The gradient
norm sums the expert part over the ep ranks (and the pipeline's stages), the dense part as before.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from parallel.config import fail
from parallel.engine import LocalEngine
from parallel.models.hf import grouped_experts
from parallel.optim import clip_grads
from parallel.strategies.expert_hf import ScaleGrad as _ScaleGrad
from parallel.strategies.expert_hf import check_hf_experts


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) of every layer with a `router` and an nn.ModuleList (or shard) of `experts`."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "router", None), nn.Module)
            and isinstance(getattr(m, "experts", None), (nn.ModuleList, ExpertShard))]


def has_experts(model: nn.Module) -> bool:
    """Whether `model` has layers whose experts strategy.ep splits: the framework's or Hugging Face's."""
    return bool(moe_layers(model)) or bool(grouped_experts(model))


def check_experts(model: nn.Module, ep: int, cp: int = 1, zero: int = 0, pp: int = 1, tp: int = 1) -> None:
    """strategy.ep > 1 needs MoE layers whose expert count divides by ep (the framework's interface, or Hugging
    Face's fused experts: Note [Hugging Face experts over ep] in parallel/strategies/expert_hf.py, which says
    what they do not take besides); the framework's MoE layers do not take strategy.cp > 1 (their
    load-balancing loss and capacity are per sequence, Note [auxiliary loss], and cp splits sequences).
    Checked before any worker starts."""
    if check_hf_experts(model, ep, zero, pp, tp):
        return
    layers = moe_layers(model)
    if cp > 1 and layers:
        fail("strategy.cp", cp, f"{layers[0][0]} is a mixture-of-experts layer, whose load-balancing loss and "
             "capacity are taken per sequence; context parallelism splits each sequence over ranks", [1])
    if ep == 1:
        return
    if not layers:
        fail("strategy.ep", ep, f"{type(model).__name__} has no mixture-of-experts layer to split over expert "
             "ranks (a module with a `router` and an nn.ModuleList of `experts`, Note [moe layer], or Hugging "
             "Face's fused experts)",
             ["1", "model=moe", "a model whose MoE layers follow that interface"])
    for name, layer in layers:
        if len(layer.experts) % ep:
            fail("strategy.ep", ep, f"must divide the number of experts: {name} has {len(layer.experts)}",
                 [d for d in range(1, len(layer.experts) + 1) if len(layer.experts) % d == 0])


class ExpertShard(nn.ModuleDict):
    """This rank's experts of one layer, keyed by their indices in the whole layer (Note [expert parallelism]).

    Args:
        experts: the layer's nn.ModuleList (all E, on meta); group: the ep process group.
    """

    def __init__(self, experts: nn.ModuleList, group):
        self.total, self.ep, self.rank = len(experts), dist.get_world_size(group), dist.get_rank(group)
        per = self.total // self.ep
        held = range(self.rank * per, (self.rank + 1) * per)
        super().__init__({str(i): experts[i] for i in held})
        self.group, self.per = group, per

    def __len__(self) -> int:
        return self.total  # the layer's expert count, as its ModuleList had

    def grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for `xs`, this rank's tokens grouped by expert (`counts` per expert), in the
        same order; every ep rank calls it together."""
        got = self.counts_in(counts).view(self.ep, self.per).tolist()
        return self.exchange(xs, counts.view(self.ep, self.per).sum(1).tolist(), got)

    def counts_in(self, counts: torch.Tensor) -> torch.Tensor:
        """What every ep rank sends each of this rank's experts, (ep x per) flat in (source, expert) order, from
        what this rank sends each of the layer's experts (`counts`, E): an all-to-all of the counts."""
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        return got

    def exchange(self, xs: torch.Tensor, send: list[int], got: list[list[int]]) -> torch.Tensor:
        """Send `xs` to the experts' ranks (`send[s]` rows to ep rank s, grouped by expert), run each of this
        rank's experts on what it got (`got[s][j]` rows from rank s for expert j) and send the outputs back:
        the outputs of `xs`, in its order. The planner calls it with a balanced step's sizes (Note [moe layer])."""
        ep, per = self.ep, self.per
        sizes = [sum(row) for row in got]
        recv = all_to_all_single_autograd(xs, sizes, send, self.group)
        recv = _ScaleGrad.apply(recv, float(ep))
        pieces = recv.split([c for row in got for c in row])  # (source, expert) order
        outs = []
        for j, expert in enumerate(self.values()):  # every expert, on an empty batch too
            y = expert(torch.cat([pieces[s * per + j] for s in range(ep)]))
            outs.append(_ScaleGrad.apply(y, 1.0 / ep).split([row[j] for row in got]))
        back = torch.cat([outs[j][s] for s in range(ep) for j in range(per)])
        return all_to_all_single_autograd(back, send, sizes, self.group)


def shard_experts(module: nn.Module, mesh: DeviceMesh, zero: int, policy: MixedPrecisionPolicy) -> list[ExpertShard]:
    """Swap each MoE layer's experts in `module` for this rank's `ExpertShard` and make each of its experts a
    data-parallel unit over mesh["dp"] (replicated for zero 0 and 1, sharded otherwise; FSDP2's mixed-precision
    `policy`, Note [mixed precision] in parallel/strategies/data.py); returns the shards."""
    group, dp_mesh = mesh["ep"].get_group(), mesh["dp"]
    shards = []
    for _, layer in moe_layers(module):
        layer.experts = ExpertShard(layer.experts, group)
        # A unit per expert (FSDP2 takes modules with a forward, not containers), even over one dp rank: the
        # block's unit over dp x ep must leave the experts out. Every expert runs at every step (run_experts).
        for expert in layer.experts.values():
            if zero <= 1:
                replicate(expert, mesh=dp_mesh, mp_policy=policy)
            else:
                fully_shard(expert, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=zero == 3)
        shards.append(layer.experts)
    return shards


def expert_params(modules: list[nn.Module]) -> set[int]:
    """ids of the parameters held in ExpertShards."""
    return {id(p) for module in modules for m in module.modules() if isinstance(m, ExpertShard)
            for p in m.parameters()}


@torch.no_grad()
def clip_with_experts(modules: list[nn.Module], max_norm: float, ep_group, sum_group=None,
                      skip: set[int] = frozenset()) -> torch.Tensor:
    """The global gradient norm (clipped to `max_norm` when > 0) of `modules` holding ExpertShards (Note [expert
    parallelism]): the experts' squares summed over `ep_group`, then everything over `sum_group` (a pipeline's
    stages); `skip`: ids of parameters whose gradients are clipped but not counted (a tied weight's copies)."""
    experts = expert_params(modules)
    params = [p for m in modules for p in m.parameters() if p.grad is not None]
    dense = clip_grads([p.grad for p in params if id(p) not in experts and id(p) not in skip], 0)
    mine = clip_grads([p.grad for p in params if id(p) in experts], 0, sum_group=ep_group)
    square = dense.float() ** 2 + mine.float() ** 2
    if sum_group is not None and dist.get_world_size(sum_group) > 1:
        dist.all_reduce(square, group=sum_group)
    norm = square.sqrt()
    if max_norm > 0:  # as clip_grads scales them
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
    return norm


class ExpertEngine(LocalEngine):
    """LocalEngine with expert-sharded layers: the gradient norm and the gathered weights take every ep rank's
    experts (Note [expert parallelism])."""

    def __init__(self, *args, mesh: DeviceMesh, **kwargs):
        super().__init__(*args, **kwargs)
        self.ep_group = mesh["ep"].get_group()

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_with_experts([self.model], max_norm, self.ep_group)

    def full_state_dict(self) -> dict:
        """The unpartitioned weights on rank 0: the dense ones gathered by torch, the experts from every ep rank."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        mine = {}
        for prefix, m in self.model.named_modules():
            if isinstance(m, ExpertShard):
                for k, v in m.state_dict(prefix=f"{prefix}.").items():
                    mine[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return {}
        for part in parts:
            state.update(part)
        return state


def expert_engine(mesh: DeviceMesh, *args, **kwargs) -> LocalEngine:
    """The engine of a model without a pipeline (LocalEngine's arguments): ExpertEngine when ep > 1."""
    if mesh["ep"].size() == 1:
        return LocalEngine(*args, **kwargs)
    return ExpertEngine(*args, mesh=mesh, **kwargs)
