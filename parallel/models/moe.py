"""The built-in `moe` model: the `gpt` transformer with mixture-of-experts MLPs, and the MoE layer's pieces.

# Note [moe layer]
A mixture-of-experts layer is a `router` (a module: tokens (n, dim) -> one logit per expert (n, E)), its
`experts` (an nn.ModuleList of E modules, each (m, dim) -> (m, dim)) and `top_k`. It routes with `route`
(top-k of the router's logits, softmax over the chosen k, a per-sequence capacity) and computes the experts
with `run_experts(self.experts, tokens, route)`. `MoE` below is one; a user's layer that holds `router`,
`experts` and `top_k` under these names and calls `run_experts` works under every strategy, expert
parallelism included: `strategy.ep` swaps `experts` for this rank's share (parallel.strategies.expert), whose
`run_experts` sends each token to its expert's rank and back. The experts keep their names (`experts.3.up`)
whatever the sharding, so checkpoints move between degrees.

`run_experts` groups the kept (token, choice) pairs by expert and runs every expert once on its group (an
empty one too: data parallelism's hooks run in every expert on every rank). In a trace (the pipeline's, on
meta or fake tensors) the group sizes are not known, so every expert runs on every token, weighted by a
gate that is 0 where it was not chosen: the same values, E / top_k times the expert work. A pipeline's
traced stages run that way (strategy=pipeline; strategy=hybrid runs the model's own blocks) and keep no
routing figures. The planner (fake tensors, no trace) cannot read the routing either, and plans a
balanced step: the n x top_k choices of a rank spread evenly over the E experts, each expert run on its
share; under expert parallelism the shard's own exchange runs at those sizes (`ExpertShard.exchange`, the
all-to-alls of the real run, so the plan holds their buffers and counts their bytes: Note [auto] in
parallel/planning/auto.py). No choice is dropped, as a balanced router drops none under a capacity factor of 1 or
more (a real router, uneven, may drop some; under 1, the plan is of a larger step than the run's).

# Note [auxiliary loss]
The load-balancing loss (Switch / GShard: E * sum_e f_e * p_e, f_e the fraction of routed choices that went
to expert e, p_e the mean router probability of e) is taken per SEQUENCE and averaged over the sequences of
the global batch (as DeepSeek's sequence-wise balance loss), times `aux_coef`, per layer. A batch-wide f_e
would depend on how the batch is cut into microbatches and ranks, and no split would train what `single`
trains; a sequence's own term does not, so the sum over the global batch is exact under data parallelism,
accumulation and pipelines (parallel/loss.py Note [global loss] holds the same for the main loss).

It reaches the gradients without passing through the model's output: the layer ties its sequences' summed
term to its output with `aux_gradient`, the identity forward whose backward adds the term's gradient times
the weight of one sequence. The engines' losses do not change and the output stays one tensor (a pipeline
stage sends only activations; the aux terms of stage 0 never travel to the last stage). The weight is the
step's, which the engine running it sets in the layer's `aux_weight` buffer (Note [auxiliary weight] in
parallel/aux_weight.py; `Loss.aux_weight`: the loss's gradient-averaging scale over the global batch's sample
count), or 1 / (the forward's sequences) where no engine set it (a plain PyTorch loop). The logged
`loss` is the main loss alone; the aux term is logged as `moe_aux_loss` (parallel.models.moe_stats). The
capacity is per sequence for the same reason: ceil(capacity_factor * seq_len * top_k / E) choices per
expert and sequence, the earlier positions first (every first choice before any second one).

A user's layer adds a term of its own the same way: `register_aux_weight(self)` in its constructor and
`with_aux_loss(out, balance_loss(r), coef, seqs, self.aux_weight)` in a training forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._guards import detect_fake_mode

from parallel.aux_weight import register_aux_weight
from parallel.models.gpt import GPT, Attention, FeedForward


@dataclass
class Route:
    """Where each token goes: `chosen` (n, k) expert ids, `weights` (n, k) their gates (0 where dropped),
    `kept` (n, k) within capacity, `probs` (n, E) the router's softmax, `seqs` the sequences of the n tokens."""

    chosen: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    probs: torch.Tensor
    seqs: int

    @property
    def experts(self) -> int:
        return self.probs.shape[-1]


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None = None) -> Route:
    """Top-k routing of (b, t, E) router logits: softmax over the chosen k; with a capacity factor, each
    expert takes at most ceil(capacity_factor * t * k / E) choices per sequence (Note [auxiliary loss])."""
    b, t, e = logits.shape
    top, chosen = logits.float().topk(top_k, dim=-1)
    weights = top.softmax(-1)
    kept = torch.ones_like(chosen, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * t * top_k / e)
        # Each choice's place in its expert's queue within its sequence: choices in (slot, position) order.
        onehot = F.one_hot(chosen.transpose(1, 2).reshape(b, top_k * t), e)
        place = ((onehot.cumsum(1) - 1) * onehot).sum(-1).view(b, top_k, t).transpose(1, 2)
        kept = place < capacity
        weights = weights * kept
    probs = logits.float().softmax(-1)
    return Route(chosen.reshape(b * t, top_k), weights.reshape(b * t, top_k), kept.reshape(b * t, top_k),
                 probs.reshape(b * t, e), b)


def balance_loss(r: Route) -> torch.Tensor:
    """The load-balancing term summed over the sequences: sum_s E * sum_e f_se * p_se (Note [auxiliary loss])."""
    e, k = r.experts, r.chosen.shape[1]
    counts = torch.zeros(r.seqs, r.chosen.shape[0] // r.seqs * k, e, device=r.probs.device)
    share = counts.scatter_(2, r.chosen.view(r.seqs, -1, 1), 1.0).mean(1)  # f_se: (s, E)
    mean_prob = r.probs.view(r.seqs, -1, e).mean(1)  # p_se
    return e * (share * mean_prob).sum()


# A custom op rather than an autograd.Function: torch.export (the pipeline's trace) keeps a custom op as one
# call with its backward, where it inlines a Function's forward and drops its backward. The op copies `out`
# (an op's output may not alias its input); the weight is a tensor, the layer's buffer, read in backward at
# run time, not at the trace (Note [auxiliary weight] in parallel/aux_weight.py).
@torch.library.custom_op("parallel::aux_gradient", mutates_args=())
def aux_gradient(out: torch.Tensor, aux: torch.Tensor, weight: torch.Tensor, coef: float, seqs: int) -> torch.Tensor:
    """`out` unchanged; backward also gives `aux` the gradient coef x the weight of a sequence (Note
    [auxiliary loss]): `weight` where an engine has set it (> 0), else 1 / seqs."""
    return out.clone()


@aux_gradient.register_fake
def _(out, aux, weight, coef, seqs):
    return torch.empty_like(out)


def _aux_setup(ctx, inputs, output):
    _, aux, weight, ctx.coef, ctx.seqs = inputs
    ctx.aux_meta = (aux.shape, aux.dtype)
    ctx.save_for_backward(weight)


def _aux_backward(ctx, grad):
    shape, dtype = ctx.aux_meta
    (weight,) = ctx.saved_tensors
    # On the device, without reading the weight back; 0: no engine set it (a plain loop). In float64 until
    # the one rounding to the term's dtype (Note [auxiliary weight]).
    weight = torch.where(weight > 0, weight, 1.0 / ctx.seqs)
    return grad, (ctx.coef * weight).to(device=grad.device, dtype=dtype).expand(shape), None, None, None


aux_gradient.register_autograd(_aux_backward, setup_context=_aux_setup)


def with_aux_loss(out: torch.Tensor, aux_sum: torch.Tensor, coef: float, seqs: int,
                  weight: torch.Tensor) -> torch.Tensor:
    """`out` carrying `coef x aux_sum` (summed over `seqs` sequences) into backward (Note [auxiliary loss]).

    Args:
        weight: the layer's `aux_weight` buffer (`parallel.aux_weight.register_aux_weight(layer)` in its
            constructor), which the engine running a step sets (Note [auxiliary weight]).
    """
    return aux_gradient(out, aux_sum.float(), weight, float(coef), int(seqs))


def _static(t: torch.Tensor) -> bool:
    """Group sizes cannot be read: fake or meta tensors, or a trace (Note [moe layer])."""
    return t.is_meta or torch.compiler.is_exporting() or detect_fake_mode(t) is not None


# Not compiled (torch.compile of a block runs it eagerly, between the graphs before and after): the groups'
# sizes are read from the routing, and expert parallelism's all-to-all takes them as Python ints.
@torch.compiler.disable
def run_experts(experts: nn.Module, tokens: torch.Tensor, r: Route) -> torch.Tensor:
    """sum_k weight_k x expert_k(token) for every token of `tokens` (n, dim) (Note [moe layer]).

    Args:
        experts: the layer's nn.ModuleList, or this rank's share of it under expert parallelism.
    """
    if _static(tokens):  # a trace computes the real values; the planner, a balanced step's shapes
        return _dense(experts, tokens, r) if tokens.is_meta or torch.compiler.is_exporting() \
            else _balanced(experts, tokens, r)
    k = r.chosen.shape[1]
    pick = r.kept.flatten().nonzero().squeeze(1)  # the kept (token, choice) pairs
    flat = r.chosen.flatten()
    order = pick[torch.argsort(flat[pick], stable=True)]  # grouped by expert, token order within
    token_of = order // k
    counts = torch.bincount(flat[order], minlength=r.experts)
    grouped = getattr(experts, "grouped", None)
    if grouped is not None:  # this rank's share under expert parallelism
        ys = grouped(tokens[token_of], counts)
    else:
        chunks = tokens[token_of].split(counts.tolist())
        ys = torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])
    ys = ys * r.weights.flatten()[order].unsqueeze(1).to(ys.dtype)
    return torch.zeros_like(tokens).index_add(0, token_of, ys)


def _held(experts: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index in the layer, expert) of the experts this rank holds: all of a ModuleList, a shard's own."""
    return [(int(i), e) for i, e in experts.items()] if isinstance(experts, nn.ModuleDict) else list(enumerate(experts))


def _dense(experts: nn.Module, tokens: torch.Tensor, r: Route) -> torch.Tensor:
    """Every expert on every token, weighted by a gate that is 0 where it was not chosen: the routed values
    without reading any (Note [moe layer])."""
    gates = torch.zeros(r.chosen.shape[0], r.experts, device=tokens.device, dtype=r.weights.dtype)
    gates = gates.scatter_add(1, r.chosen, r.weights).to(tokens.dtype)
    out = torch.zeros_like(tokens)
    for i, expert in _held(experts):
        out = out + gates[:, i:i + 1] * expert(tokens)
    return out


def _balanced(experts: nn.Module, tokens: torch.Tensor, r: Route) -> torch.Tensor:
    """The planner's stand-in for the routed computation (fake tensors: the shapes of a step, not its values):
    a balanced router's choices, n x top_k spread evenly over the E experts, run as the routed path runs them:
    under expert parallelism through the shard's own all-to-all exchange at those sizes (every rank routes
    alike, so each sends this rank's experts what this rank sends them), else each expert on its share; the
    outputs are added back per token (Note [moe layer])."""
    n, k = r.chosen.shape
    e = r.experts
    share = [n * k // e + (i < n * k % e) for i in range(e)]  # a balanced router's choices per expert
    token_of = torch.arange(n * k, device=tokens.device) % n  # a token per choice, grouped by expert
    xs = tokens[token_of]
    if hasattr(experts, "exchange"):  # this rank's share under expert parallelism (its ExpertShard)
        ep, per, mine = experts.ep, experts.per, experts.rank * experts.per
        experts.counts_in(torch.tensor(share, device=tokens.device))  # the counts' all-to-all (values unread)
        ys = experts.exchange(xs, [sum(share[s * per:(s + 1) * per]) for s in range(ep)],
                              [share[mine:mine + per]] * ep)
    else:
        ys = torch.cat([expert(chunk) for expert, chunk in zip(experts, xs.split(share))])
    ys = ys * r.weights.flatten().unsqueeze(1).to(ys.dtype)
    return torch.zeros_like(tokens).index_add(0, token_of, ys)


class MoE(nn.Module):
    """A mixture-of-experts MLP (Note [moe layer]): `router`, E `experts` (gpt's FeedForward), top-k gating,
    the load-balancing loss (Note [auxiliary loss]) and an optional capacity factor.

    Args:
        dim: the model width; hidden: each expert's hidden width; experts: E; top_k: experts per token;
        capacity_factor: None (no token dropped) or > 0; aux_coef: the load-balancing loss's weight.
    """

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 2,
                 capacity_factor: float | None = None, aux_coef: float = 0.01):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(experts))
        self.top_k, self.capacity_factor, self.aux_coef = top_k, capacity_factor, aux_coef
        self.stats: dict[str, torch.Tensor] = {}  # what moe_stats reads at a logged step (training only)
        register_aux_weight(self)  # the step's weight of a sequence's term, set by the engine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        r = route(self.router(x), self.top_k, self.capacity_factor)
        out = run_experts(self.experts, x.reshape(b * t, d), r).view(b, t, d)
        if not self.training or not torch.is_grad_enabled():
            return out
        aux = balance_loss(r)
        record(self.stats, r, aux.detach() * self.aux_coef)
        return with_aux_loss(out, aux, self.aux_coef, b, self.aux_weight) if self.aux_coef else out


@torch.compiler.disable
def record(stats: dict, r: Route, aux: torch.Tensor) -> None:
    """Add a training forward's routing to `stats`: choices per expert, dropped choices, sequences and their
    summed (weighted) aux term; moe_stats reads and clears them. Nothing in a trace or a plan (fake values)."""
    if _static(r.probs):
        return
    with torch.no_grad():
        add = {"tokens": torch.bincount(r.chosen[r.kept], minlength=r.experts).double(),
               "dropped": (~r.kept).sum().double().view(1), "seqs": torch.full((1,), r.seqs, dtype=torch.float64),
               "aux": aux.double().view(1)}
        for key, value in add.items():
            value = value.to(r.probs.device)
            stats[key] = stats[key] + value if key in stats else value


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int, experts: int, top_k: int,
                 capacity_factor: float | None, aux_coef: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MoE(dim, mlp_ratio * dim, experts, top_k, capacity_factor, aux_coef)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MoEGPT(GPT):
    """gpt with MoE blocks (token ids in, next-token logits out)."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int, heads: int, layers: int, mlp_ratio: int,
                 experts: int, top_k: int, capacity_factor: float | None, aux_coef: float,
                 tie_embeddings: bool = False):
        super().__init__(vocab_size, seq_len, dim, heads, 0, mlp_ratio, tie_embeddings)
        self.blocks = nn.ModuleList(MoEBlock(dim, heads, mlp_ratio, experts, top_k, capacity_factor, aux_coef)
                                    for _ in range(layers))

    def tp_plan(self, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
        """gpt's plan for the attention and the head; the experts and routers stay whole (replicated)."""
        if sequence_parallel:
            raise ValueError("strategy.sequence_parallel is not supported by model=moe")
        plan = super().tp_plan(tp)
        return {k: v for k, v in plan.items() if ".mlp." not in k}


def build_moe(vocab_size: int = 64, seq_len: int = 32, dim: int = 64, heads: int = 4, layers: int = 2,
              mlp_ratio: int = 2, experts: int = 4, top_k: int = 2, capacity_factor: float | None = None,
              aux_coef: float = 0.01, tie_embeddings: bool = False) -> MoEGPT:
    """The built-in `moe` model: gpt whose MLPs are mixtures of `experts` experts, `top_k` per token."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"model.args.top_k={top_k} must be in [1, model.args.experts={experts}]")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"model.args.capacity_factor={capacity_factor} must be > 0 (or null: no capacity)")
    return MoEGPT(vocab_size, seq_len, dim, heads, layers, mlp_ratio, experts, top_k, capacity_factor, aux_coef,
                  tie_embeddings)
