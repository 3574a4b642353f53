"""Weights a tensor-parallel plan leaves whole: the same gradient on every rank of the tp group, or wrong training.

# Note [weights left whole]
A plan shards some layers over the tp ranks and leaves every other weight whole
on each of them. A whole weight trains right when every rank computes its
whole gradient: it is applied to activations that are whole on every rank (a
norm before a colwise projection, whose input is replicated), or its style
sums the ranks' parts (torch's SequenceParallel, or a style that all-reduces
the gradient). One applied to a rank's own piece of the activations (a per-head
norm after a colwise q projection, Qwen3's q_norm and k_norm: each rank sees its
own heads) gets on each rank the part of its gradient from that piece, never
summed: the ranks' copies drift apart, and the run trains a model no single
device would, without an error. Nothing in the plan tells the two apart, so the
first step checks the outcome: every whole weight's gradient, reduced to two
numbers (its sum and its sum of squares, in float64), gathered over the tp group
and compared with the group's first rank (relative 1e-3: ranks that compute the
same gradient agree far closer; a part of it differs by tens of percent). The
weights that differ stop the run in one line that names them (parallel/trainer.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

TOLERANCE = 1e-3  # relative (Note [weights left whole])


def whole_weights(modules: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters each tp rank holds whole (not sharded over a mesh dimension named tp)."""
    out, seen = [], set()
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            placement = _over_tp(p)
            if placement is None or placement.is_replicate():
                out.append((name, p))
    return out


def _over_tp(t: torch.Tensor):
    """A DTensor's placement over the mesh dimension named tp; None for a plain tensor or a mesh without tp."""
    names = t.device_mesh.mesh_dim_names or () if isinstance(t, DTensor) else ()
    return t.placements[names.index("tp")] if "tp" in names else None


def unequal_gradients(modules: list[nn.Module], tp_group) -> list[tuple[str, float]]:
    """(name, relative difference) of each whole weight whose gradient differs between the ranks of `tp_group`
    (a collective over it; Note [weights left whole])."""
    # A DTensor gradient that is Partial over tp (a SequenceParallel norm's) is the sum of the ranks' parts by its
    # own type, made whole when the optimizer or the norm uses it: right by construction, so not compared.
    weights = [(n, p) for n, p in whole_weights(modules) if p.grad is not None
               and not (_over_tp(p.grad) is not None and _over_tp(p.grad).is_partial())]
    if not weights:
        return []
    sums = []
    for _, p in weights:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g = g.detach().double()
        sums.append(torch.stack([g.sum(), (g * g).sum()]))
    mine = torch.stack(sums)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(everyone, mine, group=tp_group)
    first = everyone[0]
    scale = first[:, 1].sqrt() * torch.tensor([max(p.grad.numel(), 1) for _, p in weights],
                                              dtype=torch.float64, device=first.device).sqrt()
    out = []
    for i, (name, _) in enumerate(weights):
        worst = 0.0
        for other in everyone[1:]:
            d_sum = abs(float(other[i, 0] - first[i, 0])) / max(float(scale[i]), 1e-30)
            d_square = abs(float(other[i, 1] - first[i, 1])) / max(float(first[i, 1]), 1e-30)
            worst = max(worst, d_sum, d_square)
        if worst > TOLERANCE:
            out.append((name, worst))
    return out


def _pattern(unequal: list[tuple[str, float]]) -> str:
    """The module of the first weight, its layer numbers as `*` (a plan's pattern)."""
    module = unequal[0][0].rpartition(".")[0]
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


def describe(unequal: list[tuple[str, float]], tp: int) -> str:
    """The one line that stops the run (Note [weights left whole])."""
    names = ", ".join(name for name, _ in unequal[:6]) + (f" and {len(unequal) - 6} more" if len(unequal) > 6 else "")
    worst = max(d for _, d in unequal)
    return (f"tensor parallelism: {len(unequal)} weight(s) left whole get different gradients on the {tp} ranks "
            f"of their tp group at the first step (up to {worst:.2g} relative): {names}; each is applied to its "
            f"rank's own piece of the activations, so each rank holds part of its gradient (Note [weights left "
            f"whole] in parallel/strategies/tensor/whole.py): give it the style that sums them, "
            f"strategy.tp_plan=[...,'{_pattern(unequal)}:replicate_grads'] (Hugging Face's "
            f"replicated_with_grad_allreduce), or keep its input whole")
