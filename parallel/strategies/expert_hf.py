"""Expert parallelism for Hugging Face mixture-of-experts layers (Mixtral, Qwen3-MoE, GPT-OSS, ...): their fused
experts split over the ep ranks.

# Note [Hugging Face experts over ep]
transformers 5 holds a layer's E experts fused, as tensors whose first dimension is the expert
(`mlp.experts.gate_up_proj` (E, ...), `down_proj`, GPT-OSS's biases), in one module called by its MoE block as
`experts(tokens (n, H), top_k_index (n, k), top_k_weights (n, k))`, after the block's own router
(parallel.models.hf.grouped_experts finds them). Under `strategy.ep`, `shard_hf_experts` puts an
`HFExpertShard` in that module's place: the same tensors under the same names (`mlp.experts.gate_up_proj`),
each a DTensor split over mesh["ep"] on its expert dimension (Shard(0): ep rank r holds experts
r x E/ep .. (r + 1) x E/ep - 1), so the initial values, pretrained pieces, the gathered final weights and
checkpoints name and place them as the unpartitioned model does, by DTensor's own rules.

Its forward is the exchange of Note [expert parallelism] (parallel/strategies/expert.py) around the layer's
own expert computation: each rank orders its (token, choice) pairs by expert, sends each to its expert's
rank (an all-to-all of the counts, then of the tokens), computes what it received with transformers' own
experts forward on its E/ep experts (`compute`: the module's forward, its `experts_implementation`, its
gate and biases, run on this rank's pieces, each received pair given routing weight 1), sends the outputs
back, and weighs and sums each token's k outputs as transformers does (`(n, k, H).sum(1)`, in choice
order). The gradient scaling by ep of that Note applies alike: the experts' tensors are averaged over dp
only, as their own data-parallel unit over mesh["dp"].

The rest is data-parallel over dp x ep as any dense weight. Not taken (config errors before workers start):
strategy.zero=1 (its optimizer-state layout shards over dp x ep, where each ep rank holds other experts),
pp > 1 (a Hugging Face model's layers stay in the traced stages, whose experts cannot be swapped) and
tp > 1 (the model's own tensor plan splits the experts' tensors differently: `moe_tp_experts`).

On fake tensors (the planner) the routing cannot be read: the pairs are taken as a balanced router spreads
them, n x k / E per expert, as Note [moe layer] plans the built-in layers.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import detect_fake_mode
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from parallel.config import fail
from parallel.models.hf import grouped_experts


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor` (Note [expert parallelism])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def check_hf_experts(model: nn.Module, ep: int, zero: int, pp: int, tp: int) -> bool:
    """Whether `model` has Hugging Face experts; with ep > 1, config errors for what Note [Hugging Face experts
    over ep] does not take and for an ep that does not divide a layer's experts."""
    layers = grouped_experts(model)
    if not layers or ep == 1:
        return bool(layers)
    name = layers[0][0]
    for key, value, valid in (("strategy.zero", zero, [0, 2, 3]), ("strategy.pp", pp, [1]), ("strategy.tp", tp, [1])):
        if value not in valid:
            fail(key, value, f"{name} holds Hugging Face fused experts, which strategy.ep={ep} splits over its ranks "
                 "without it (Note [Hugging Face experts over ep] in parallel/strategies/expert_hf.py)", valid)
    for name, layer in layers:
        if layer.num_experts % ep:
            fail("strategy.ep", ep, f"must divide the number of experts: {name} has {layer.num_experts}",
                 [d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0])
        leading = [n for n, p in layer.named_parameters(recurse=False)
                   if p.dim() == 0 or p.shape[0] != layer.num_experts]
        if leading:
            fail("strategy.ep", ep, f"{name}'s tensors {leading} are not one per expert (first dimension "
                 f"{layer.num_experts}): nothing to split over the expert ranks", [1])
    return True


class HFExpertShard(nn.Module):
    """This rank's experts of one Hugging Face experts module, its tensors DTensors over mesh["ep"] (Note
    [Hugging Face experts over ep]).

    Args:
        experts: the layer's experts module (all E, on meta); mesh: the ep mesh (1D).
    """

    def __init__(self, experts: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.mesh, self.group = mesh, mesh.get_group()
        self.total, self.ep = experts.num_experts, mesh.size()
        self.per = self.total // self.ep
        for name, p in list(experts.named_parameters(recurse=False)):
            piece = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(name, nn.Parameter(piece, requires_grad=p.requires_grad))
        self._template = [experts]  # in a list: not a submodule (its tensors are the ones above, split)

    def compute(self, tokens: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """transformers' own forward of the layer on this rank's experts: `tokens` (m, H), each for this rank's
        expert `local` (m,), routing weight 1."""
        template = self._template[0]
        shim = copy.copy(template)  # the module's attributes (config, activation, gate), this rank's tensors
        shim.__dict__["_parameters"] = {n: p.to_local() if isinstance(p, DTensor) else p
                                        for n, p in self.named_parameters(recurse=False)}
        shim.num_experts = self.per
        ones = torch.ones(local.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
        return type(template).forward(shim, tokens, local.unsqueeze(1), ones)

    # Not compiled (as the framework's own run_experts): the exchange's sizes are read from the routing.
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        n, k = top_k_index.shape
        order, send, got = self._routes(top_k_index.reshape(-1))
        sizes = [sum(row) for row in got]
        recv = all_to_all_single_autograd(hidden_states[order // k], sizes, send, self.group)
        recv = ScaleGrad.apply(recv, float(self.ep))
        local = torch.repeat_interleave(torch.arange(self.per, device=recv.device).repeat(self.ep),  # its expert
                                        torch.tensor([c for row in got for c in row], device=recv.device),
                                        output_size=sum(sizes))
        ys = ScaleGrad.apply(self.compute(recv, local), 1.0 / self.ep)
        back = all_to_all_single_autograd(ys, send, sizes, self.group)
        pairs = back.new_zeros(n * k, back.shape[-1]).index_copy(0, order, back)  # each pair in choice order
        weighted = pairs * top_k_weights.reshape(-1, 1)
        return weighted.view(n, k, -1).sum(dim=1).to(hidden_states.dtype)

    def _routes(self, flat: torch.Tensor) -> tuple[torch.Tensor, list[int], list[list[int]]]:
        """(this rank's pairs ordered by expert, how many it sends each ep rank, how many it gets from each
        rank for each of its experts): an all-to-all of the counts. On fake tensors a balanced router's
        (every rank routes alike), the counts' all-to-all still run (the planner holds its buffers)."""
        if _static(flat):
            share = [flat.numel() // self.total + (i < flat.numel() % self.total) for i in range(self.total)]
            order, counts = torch.arange(flat.numel(), device=flat.device), torch.tensor(share, device=flat.device)
            mine = self.mesh.get_local_rank() * self.per
            dist.all_to_all_single(torch.empty_like(counts), counts, group=self.group)
            return order, [sum(share[s * self.per:(s + 1) * self.per]) for s in range(self.ep)], \
                [share[mine:mine + self.per]] * self.ep
        order, counts = torch.argsort(flat, stable=True), torch.bincount(flat, minlength=self.total)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        return order, counts.view(self.ep, self.per).sum(1).tolist(), got.view(self.ep, self.per).tolist()


def _static(t: torch.Tensor) -> bool:
    """The routing cannot be read: fake or meta tensors."""
    return t.is_meta or detect_fake_mode(t) is not None


def shard_hf_experts(module: nn.Module, mesh: DeviceMesh, zero: int, policy: MixedPrecisionPolicy) -> list:
    """Put an HFExpertShard in place of each Hugging Face experts module of `module`, each its own data-parallel
    unit over mesh["dp"] (replicated for zero 0, sharded otherwise; FSDP2's mixed-precision `policy`); returns
    the shards."""
    shards = []
    for name, experts in grouped_experts(module):
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        shard = HFExpertShard(experts, mesh["ep"])
        setattr(parent, attr, shard)
        if zero == 0:
            replicate(shard, mesh=mesh["dp"], mp_policy=policy)
        else:
            fully_shard(shard, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=zero == 3)
        shards.append(shard)
    return shards
