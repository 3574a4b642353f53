"""Causal attention over a sequence split across the context-parallel ranks (Note [context parallelism]).

# Note [context parallelism]
Each sample's sequence of T tokens is cut into 2 x cp chunks of L = T / (2 cp); cp rank r holds chunks r and
2cp-1-r, in that order. Under a causal mask a chunk's queries look at every earlier chunk, so the first
chunks cost little and the last ones much; pairing chunk r with its mirror gives every rank the same work
(the load balancing of Megatron-LM's and PyTorch's context parallelism). Everything but attention is local
to a token: embeddings (at the rank's own positions), norms, MLPs, the head and the loss run on the rank's
2L tokens as they would on the whole sequence.

Attention needs the keys and values of the whole sequence. PyTorch's own context parallelism
(`torch.distributed.tensor.experimental.context_parallel`, ring attention) does not run here: it handles the
CUDA kernels (flash, efficient, cuDNN) only, and torch 2.13 fails on the CPU's
`_scaled_dot_product_flash_attention_for_cpu` ("does not have a sharding strategy registered"). On CUDA it
is what runs (Note [context parallelism on CUDA] in cuda.py, same chunks); for the CPU and gloo the exchange is
written here, exactly:

  forward   the keys and values of all ranks are all-gathered over the cp group and put back in sequence
            order; each local query chunk c attends to each chunk before it (no mask) and to itself (causal),
            one chunk at a time with the CPU flash kernel, which returns the log-sum-exp of each row; the
            partial results are merged through it (the blockwise softmax of flash and ring attention). Only the rank's own
            q, k, v, output and log-sum-exp are saved: the gathered keys and values are dropped, so the
            activation memory of a rank stays that of its 2L tokens.
  backward  the keys and values are gathered again; the kernel's backward runs per block with the merged
            output and log-sum-exp (so each block's gradients are those of the whole softmax); the
            gradients of all keys and values are summed over the cp ranks with one all-reduce and each rank
            keeps its own chunks (gloo has no reduce-scatter).

The loss of a step is normalized over the tokens of the whole global batch: cp ranks hold different tokens of
the same samples, so the count is summed over dp x ep x cp and the dense gradients are averaged over the same
ranks (Note [global loss] in parallel/loss.py, Note [mesh dimensions] in parallel/dims.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

aten = torch.ops.aten


class SequenceShard:
    """This rank's chunks of every sequence (Note [context parallelism]).

    Args:
        cp: the context-parallel degree.
        rank: this rank's place in the cp group.
        group: the cp process group (None when cp is 1).
    """

    def __init__(self, cp: int, rank: int, group=None):
        self.cp, self.rank, self.group = cp, rank, group

    def owner(self, chunk: int) -> tuple[int, int]:
        """(the rank holding global chunk `chunk`, which of its two chunks it is)."""
        return (chunk, 0) if chunk < self.cp else (2 * self.cp - 1 - chunk, 1)

    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.cp - 1 - self.rank

    def positions(self, length: int, device=None) -> torch.Tensor:
        """The global positions of this rank's tokens in a sequence of `length` (its two chunks, in order)."""
        n = length // (2 * self.cp)
        return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in self.chunks()])

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of `t` (whole sequences along `dim`)."""
        return t.index_select(dim, self.positions(t.shape[dim], t.device))

    def position_ids(self, local: torch.Tensor) -> torch.Tensor:
        """The positions of a local batch `local` (B, 2L): what the model's position embedding reads."""
        return self.positions(local.shape[1] * self.cp, local.device).unsqueeze(0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence: q, k, v (B, H, 2L, D), k and v with
        as many heads as q."""
        return _ContextAttention.apply(q, k, v, self, scale)


def _gather(shard: SequenceShard, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """The keys and values of the whole sequence, one (2, B, H, L, D) tensor per global chunk, in order."""
    local = torch.stack([k, v]).contiguous()
    parts = [torch.empty_like(local) for _ in range(shard.cp)]
    dist.all_gather(parts, local, group=shard.group)
    n = local.shape[3] // 2
    return [parts[r].narrow(3, half * n, n) for r, half in map(shard.owner, range(2 * shard.cp))]


class _ContextAttention(torch.autograd.Function):
    """Note [context parallelism]: forward and backward of causal attention over the cp ranks."""

    @staticmethod
    def forward(ctx, q, k, v, shard: SequenceShard, scale):
        chunks = _gather(shard, k, v)
        n = q.shape[2] // 2
        outs, lses = [], []
        for i, c in enumerate(shard.chunks()):
            qc = q.narrow(2, i * n, n)
            out = lse = None
            for j in range(c + 1):  # every chunk up to this one; causal within itself
                o, s = aten._scaled_dot_product_flash_attention_for_cpu(qc, chunks[j][0], chunks[j][1], 0.0, j == c,
                                                                        scale=scale)
                if out is None:
                    out, lse = o, s
                else:  # merge two softmaxes over disjoint keys by their log-sum-exps
                    total = torch.logaddexp(lse, s)
                    out = out * (lse - total).exp().unsqueeze(-1) + o * (s - total).exp().unsqueeze(-1)
                    lse = total
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.scale = shard, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        shard, scale = ctx.shard, ctx.scale
        chunks = _gather(shard, k, v)
        grad = grad.contiguous()
        n = q.shape[2] // 2
        dq = torch.zeros_like(q)
        # The gradients of every chunk's keys and values: (chunk, k or v, B, H, L, D).
        dkv = q.new_zeros((2 * shard.cp, 2, *k.shape[:2], n, k.shape[3]))
        for i, c in enumerate(shard.chunks()):
            rows = slice(i * n, (i + 1) * n)
            for j in range(c + 1):
                gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad[:, :, rows], q[:, :, rows], chunks[j][0], chunks[j][1], out[:, :, rows], lse[:, :, rows],
                    0.0, j == c, scale=scale)
                dq[:, :, rows] += gq
                dkv[j, 0] += gk
                dkv[j, 1] += gv
        del chunks  # the gathered keys and values are not needed for the reduction
        dist.all_reduce(dkv, group=shard.group)  # every rank's queries' share of each chunk's gradient
        mine = torch.cat([dkv[c] for c in shard.chunks()], dim=3)
        return dq, mine[0], mine[1], None, None
