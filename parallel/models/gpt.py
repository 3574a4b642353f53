"""A small decoder-only transformer: token + position embedding, blocks, final norm, head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    # q, k and v are separate Linears (not one fused qkv) so that a tensor-parallel
    # plan can shard each column-wise without splitting a fused weight by hand.

    # Context parallelism sets `attend` to causal attention over the cp ranks (q, k, v) -> y
    # (parallel.strategies.context); None: the whole sequence is here.
    attend = None

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        # No biases: a key bias has an exactly zero gradient (softmax ignores a
        # shift shared by all keys), so AdamW would only amplify rounding noise.
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 rather than dim // heads: under tensor parallelism each rank holds
        # heads / tp of them, and the local width is what it sees.
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.attend is not None:
            y = self.attend(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))

    @property
    def head_dim(self) -> int:
        return self.q.out_features // self.heads


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, mlp_ratio * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, dim: int, heads: int, layers: int, mlp_ratio: int,
                 tie_embeddings: bool = False):
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.args.dim={dim} must divide by model.args.heads={heads}")
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie_embeddings:
            # One matrix for the input embedding and the output head.
            self.head.weight = self.tok.weight

    def tp_plan(self, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
        """Tensor-parallel plan: q, k, v colwise (each rank a subset of the heads), the
        attention output rowwise; MLP up colwise, down rowwise; the head's vocabulary
        split and gathered for the loss (kept whole when tied to the embedding).
        Embeddings stay whole.

        With sequence parallelism the residual stream between blocks holds each
        rank's shard of the sequence: the first block cuts it, norms run on the
        shards, attention and MLP gather it on entry and their rowwise outputs
        reduce-scatter back into shards, and the head gathers it at the end.
        """
        heads = self.blocks[0].attn.heads
        if heads % tp:
            raise ValueError(f"model.args.heads={heads} must divide by tp {tp}")
        if sequence_parallel and self.pos.num_embeddings % tp:
            raise ValueError(f"data.seq_len={self.pos.num_embeddings} must divide by tp {tp} "
                             f"for sequence parallelism")
        row = "rowwise_seq" if sequence_parallel else "rowwise"
        plan = {}
        for i in range(len(self.blocks)):
            p = f"blocks.{i}"
            plan.update({f"{p}.attn.q": "colwise", f"{p}.attn.k": "colwise", f"{p}.attn.v": "colwise",
                         f"{p}.attn.out": row, f"{p}.mlp.up": "colwise", f"{p}.mlp.down": row})
            if sequence_parallel:
                plan.update({f"{p}.norm1": "sequence", f"{p}.norm2": "sequence", f"{p}.attn": "seq_gather",
                             f"{p}.mlp": "seq_gather"})
        tied = self.head.weight is self.tok.weight
        if sequence_parallel:
            plan["blocks.0"] = "seq_split"
            plan["norm"] = "sequence"
            plan["head"] = "seq_gather" if tied else "colwise_seq_gather"
        else:
            plan["head"] = "replicate" if tied else "colwise_gather"
        return plan

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits of `tokens` (B, T); `position_ids` (1 or B, T): the tokens' places in their
        sequences (context parallelism hands each rank chunks from inside them), 0..T-1 by default."""
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_gpt(vocab_size: int = 64, seq_len: int = 32, dim: int = 64, heads: int = 4,
              layers: int = 2, mlp_ratio: int = 4, tie_embeddings: bool = False) -> GPT:
    """The built-in `gpt` model (token ids in, next-token logits out)."""
    return GPT(vocab_size, seq_len, dim, heads, layers, mlp_ratio, tie_embeddings)
