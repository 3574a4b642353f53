"""A user's own model, outside the package, reached through model._target_."""
import torch
from torch import nn


class TwoTower(nn.Module):
    def __init__(self, features: int, width: int, out: int):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(features, width), nn.Tanh())
        self.right = nn.Sequential(nn.Linear(features, width), nn.ReLU())
        self.head = nn.Linear(2 * width, out)

    def forward(self, x):
        return self.head(torch.cat([self.left(x), self.right(x)], dim=-1))


def two_tower(features: int = 32, width: int = 16, out: int = 4) -> nn.Module:
    return TwoTower(features, width, out)


def not_a_module(features: int = 32):
    return {"features": features}


class Exploding(nn.Linear):
    """Fails in forward on rank 1 only: a worker error the launcher must report."""

    def forward(self, x):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise RuntimeError("boom from the user's forward")
        return super().forward(x)


def exploding(features: int = 32, out: int = 4) -> nn.Module:
    return Exploding(features, out)


class Custom(nn.Module):
    """A parameter of the module's own kind, initialized by its own rule."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))

    def init_parameter(self, name, tensor, generator):
        tensor.fill_(2.0)

    def forward(self, x):
        return x[:, :4] * self.scale


class NoRule(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))

    def forward(self, x):
        return x[:, :4] * self.scale


def no_rule() -> nn.Module:
    return NoRule()


class SkipNet(nn.Module):
    """A residual from the first block to the head: under a pipeline it crosses every stage boundary."""

    def __init__(self, features: int, width: int, out: int, depth: int):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, out)

    def forward(self, x):
        first = self.inp(x)
        h = first
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h + first)


def skip_net(features: int = 32, width: int = 16, out: int = 4, depth: int = 4) -> nn.Module:
    return SkipNet(features, width, out, depth)


class Branchy(nn.Module):
    """Data-dependent Python control flow: cannot be traced into pipeline stages."""

    def __init__(self, features: int = 32, out: int = 4):
        super().__init__()
        self.a = nn.Linear(features, out)
        self.b = nn.Linear(features, out)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


class Heavy(nn.Module):
    """A heavy first block (four Linears in a row: 4x the cost) then `light` single Linears (for the balancer)."""

    def __init__(self, width: int = 32, light: int = 8):
        super().__init__()
        heavy = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
        self.blocks = nn.ModuleList([heavy] + [nn.Linear(width, width) for _ in range(light)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def heavy(width: int = 32, light: int = 8) -> nn.Module:
    return Heavy(width, light)


class FeedForwards(nn.Module):
    """Residual-free up/down pairs: a user model sharded by a tp_plan given in the config."""

    def __init__(self, features: int, width: int, out: int, pairs: int):
        super().__init__()
        self.pairs = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(features, width), "down": nn.Linear(width, features)})
                                   for _ in range(pairs))
        self.head = nn.Linear(features, out)

    def forward(self, x):
        for pair in self.pairs:
            x = pair["down"](torch.relu(pair["up"](x)))
        return self.head(x)


def feed_forwards(features: int = 32, width: int = 16, out: int = 4, pairs: int = 2) -> nn.Module:
    return FeedForwards(features, width, out, pairs)


class FailsLate(nn.Module):
    """Linear blocks whose forward raises on its `at`-th call: a run that fails mid-training."""

    def __init__(self, features: int = 32, out: int = 4, at: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(features, features), nn.Linear(features, out)])
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom in the middle of training")
        for block in self.blocks:
            x = block(x)
        return x


def fails_late(features: int = 32, out: int = 4, at: int = 3) -> nn.Module:
    return FailsLate(features, out, at)


def ahead_probe(steps: int = 6, wait_s: float = 10) -> nn.Module:
    """The built-in stacked model, whose head refuses to train on batch k until the frozen
    part has started on batch k+1 (waiting up to `wait_s`): it trains only if the two really overlap."""
    import threading

    from parallel.models.stacked import Stacked

    class AheadProbe(Stacked):
        def __init__(self):
            super().__init__(in_features=32, out_features=4, hidden=64, frozen_depth=3, head_depth=2)
            self.started, self.trained = 0, 0
            self.cond = threading.Condition()

        def frozen_forward(self, x):
            if not x.is_meta:  # meta: the framework tracing the model before training
                with self.cond:
                    self.started += 1
                    self.cond.notify_all()
            return super().frozen_forward(x)

        def trainable_forward(self, features):
            if not features.is_meta:
                self.trained += 1
                if self.trained < steps:
                    with self.cond:
                        if not self.cond.wait_for(lambda: self.started > self.trained, timeout=wait_s):
                            raise RuntimeError(f"the frozen part did not start on batch {self.trained + 1} "
                                               f"while the head trained on batch {self.trained}")
            return super().trainable_forward(features)

    return AheadProbe()


def gc_probe(features: int = 32, width: int = 16, out: int = 4) -> nn.Module:
    """two_tower, having written what the garbage collector watches in the process that builds it
    (`gc_probe-<pid>.json` in the working directory: RANK, the objects frozen, the objects tracked)."""
    import gc
    import json
    import os
    from pathlib import Path

    Path(f"gc_probe-{os.getpid()}.json").write_text(json.dumps(
        {"rank": os.environ.get("RANK"), "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}))
    return TwoTower(features, width, out)


class DiesOnce(nn.Sequential):
    """A small MLP whose rank 1 process is killed (SIGKILL) in the forward of step `die_at`, at torchrun's
    first start of the workers only: a worker lost mid-run, for the elastic restart test."""

    def __init__(self, features: int, width: int, out: int, die_at: int):
        super().__init__(nn.Linear(features, width), nn.Tanh(), nn.Linear(width, out))
        self.die_at, self.calls = die_at, 0

    def forward(self, x):
        import os
        import signal

        import torch.distributed as dist

        self.calls += 1
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.calls == self.die_at and first_start and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def dies_once(features: int = 32, width: int = 64, out: int = 4, die_at: int = 0) -> nn.Module:
    return DiesOnce(features, width, out, die_at)


class UserMoE(nn.Module):
    """A user's own mixture-of-experts layer on the documented interface (Note [moe layer]): `router`,
    `experts` (a ModuleList), `top_k`, routed with `route` and computed with `run_experts`; its load-balancing
    term weighed by its `aux_weight` buffer, which the engine sets for each step (Note [auxiliary weight])."""

    def __init__(self, width: int, experts: int, top_k: int):
        from parallel.aux_weight import register_aux_weight

        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width))
                                     for _ in range(experts))
        self.top_k = top_k
        register_aux_weight(self)

    def forward(self, x):
        from parallel.models.moe import balance_loss, route, run_experts, with_aux_loss

        r = route(self.router(x).unsqueeze(1), self.top_k)  # each sample a sequence of one token
        out = run_experts(self.experts, x, r)
        if not (self.training and torch.is_grad_enabled()):
            return out
        return with_aux_loss(out, balance_loss(r), 0.1, x.shape[0], self.aux_weight)


def moe_regressor(features: int = 32, width: int = 16, experts: int = 4, top_k: int = 1, out: int = 4):
    """A regression model with one user-written MoE layer between two linears."""
    return nn.Sequential(nn.Linear(features, width), UserMoE(width, experts, top_k), nn.Linear(width, out))


class _OutOfMemoryInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (raised by the test)")


class OutOfMemoryAt(nn.Linear):
    """Runs out of GPU memory, as a full GPU would (CUDA's own error, which the CPU build raises too), in its
    `at`-th forward or in the backward of it, on rank `rank` (-1: every rank); phase `allocate`: in its forward,
    by asking the device for a petabyte (a real out-of-memory, on CUDA only)."""

    def __init__(self, features: int, out: int, at: int, phase: str, rank: int):
        super().__init__(features, out)
        self.at, self.phase, self.rank, self.calls = at, phase, rank, 0

    def forward(self, x):
        import torch.distributed as dist

        self.calls += 1
        y = super().forward(x)
        if self.calls != self.at or (self.rank != -1 and self.rank != dist.get_rank()):
            return y
        if self.phase == "backward":
            return _OutOfMemoryInBackward.apply(y)
        if self.phase == "allocate":
            return y + torch.empty(1 << 50, dtype=torch.uint8, device=y.device).sum()
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (raised by the test)")


def out_of_memory_at(features: int = 32, width: int = 16, out: int = 4, at: int = 3, phase: str = "forward",
                     rank: int = -1) -> nn.Module:
    """A small MLP whose last layer (`2`) runs out of memory at step `at` (one forward a step): OutOfMemoryAt."""
    return nn.Sequential(nn.Linear(features, width), nn.Tanh(), OutOfMemoryAt(width, out, at, phase, rank))


class TimeoutProbe(nn.Linear):
    """At each training forward in a worker, appends the collective timeouts of its process's groups (seconds,
    each value once) as a line of timeouts-rank<R>.txt in the working directory: Note [two timeouts] read back."""

    def forward(self, x):
        import json

        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _world

        if dist.is_initialized() and self.training and x.device.type != "meta":
            seconds = sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                              for g in _world.pg_map if dist.get_rank(g) >= 0})
            with open(f"timeouts-rank{dist.get_rank()}.txt", "a") as f:
                f.write(json.dumps(seconds) + "\n")
        return super().forward(x)


def timeout_probe(features: int = 32, out: int = 4) -> nn.Module:
    return TimeoutProbe(features, out)


class NeedsAMask(nn.Linear):
    """A forward with a second required argument, which a batch (one input tensor) cannot fill."""

    def forward(self, x, mask):
        return super().forward(x) * mask


def needs_a_mask(features: int = 32, out: int = 4) -> nn.Module:
    return NeedsAMask(features, out)


class HeadNorm(nn.Module):
    """A projection, a norm over each head's features (one weight for every head, as Qwen3's q_norm), an output
    projection: under tensor parallelism with `q` colwise each rank's norm sees its own heads alone."""

    def __init__(self, features: int = 32, heads: int = 4, out: int = 4):
        super().__init__()
        self.head_dim = features // heads
        self.q = nn.Linear(features, features)
        self.norm = nn.RMSNorm(self.head_dim)
        self.o = nn.Linear(features, out)

    def forward(self, x):
        q = self.q(x)
        q = self.norm(q.view(*q.shape[:-1], -1, self.head_dim)).flatten(-2)
        return self.o(q)


def head_norm(features: int = 32, heads: int = 4, out: int = 4) -> nn.Module:
    return HeadNorm(features, heads, out)


class SwiGLUBlock(nn.Module):
    """The MLP of most current language models: w2(silu(w1(x)) * w3(x)), with a residual."""

    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(features, hidden, bias=False), nn.Linear(features, hidden, bias=False)
        self.w2 = nn.Linear(hidden, features, bias=False)

    def forward(self, x):
        return x + self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class SwiGLU(nn.Module):
    def __init__(self, features: int = 32, hidden: int = 64, out: int = 4, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(SwiGLUBlock(features, hidden) for _ in range(depth))
        self.head = nn.Linear(features, out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def swiglu(features: int = 32, hidden: int = 64, out: int = 4, depth: int = 2) -> nn.Module:
    return SwiGLU(features, hidden, out, depth)


class DictLayers(nn.Module):
    """Its layers in an nn.ModuleDict keyed "0", "1", ... (torchtitan's layout), called in the dict's order."""

    def __init__(self, features: int = 32, width: int = 32, out: int = 4, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(width, width), nn.GELU()) for i in range(depth)})
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers.values():
            x = x + layer(x)
        return self.head(self.norm(x))


def dict_layers(features: int = 32, width: int = 32, out: int = 4, depth: int = 4) -> nn.Module:
    return DictLayers(features, width, out, depth)


class FusedAttention(nn.Module):
    """torchtitan's Llama 3 attention with fuse_qkv=true: one `wqkv` laid out by kv group (each group's q heads, then
    its k and its v), grouped-query attention, complex rotary embeddings from the model's `freqs_cis`, and the
    forward's extra arguments (freqs_cis, attention_masks, positions) from the model's layer loop. `stock_names`:
    saved and loaded as the unfused wq, wk and wv, by state-dict hooks (torchtitan's FusedQKVLinear)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, stock_names: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        if stock_names:
            self.register_state_dict_post_hook(self._split_on_save)
            self.register_load_state_dict_pre_hook(self._merge_on_load)

    def _groups(self, t):
        return t.reshape(self.n_kv_heads, -1, self.head_dim, t.shape[-1])

    @staticmethod
    def _split_on_save(module, state_dict, prefix, local_metadata):
        per_kv = module.n_heads // module.n_kv_heads
        w = module._groups(state_dict.pop(prefix + "wqkv.weight"))
        for name, part in zip(("wq", "wk", "wv"), w.split([per_kv, 1, 1], dim=1)):
            state_dict[f"{prefix}{name}.weight"] = part.reshape(-1, w.shape[-1])

    @staticmethod
    def _merge_on_load(module, state_dict, prefix, *args):
        if prefix + "wq.weight" in state_dict:
            parts = [module._groups(state_dict.pop(f"{prefix}{n}.weight")) for n in ("wq", "wk", "wv")]
            state_dict[prefix + "wqkv.weight"] = torch.cat(parts, dim=1).flatten(0, 2)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        b, t, _ = x.shape
        per_kv = self.n_heads // self.n_kv_heads
        qkv = self.wqkv(x).view(b, t, -1, per_kv + 2, self.head_dim)  # -1: the kv groups this rank holds
        q, k, v = (s.reshape(b, t, -1, self.head_dim) for s in qkv.split([per_kv, 1, 1], dim=-2))
        rotate = freqs_cis[:t].view(1, t, 1, -1)
        q, k = (torch.view_as_real(torch.view_as_complex(z.float().reshape(*z.shape[:-1], -1, 2)) * rotate)
                .flatten(3).type_as(z) for z in (q, k))
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(SwiGLUBlock):
    """torchtitan's SwiGLU feed-forward: w2(silu(w1(x)) * w3(x)), the residual the block's."""

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, stock_names: bool):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = FusedAttention(dim, n_heads, n_kv_heads, stock_names)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan's Llama 3 (before its rotary cache moved into each layer): the layers in an nn.ModuleDict, called
    with the model's `freqs_cis` buffer, which is no parameter and is not saved."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, hidden: int = 64,
                 depth: int = 2, stock_names: bool = False, max_seq: int = 64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        freqs = 1.0 / (10000.0 ** (torch.arange(0, dim // n_heads, 2).float() / (dim // n_heads)))
        angles = torch.outer(torch.arange(max_seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, n_heads, n_kv_heads, hidden, stock_names)
                                     for i in range(depth)})
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, attention_masks=None, positions=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks, positions)
        return self.lm_head(self.norm(h))


def titan_llama(vocab: int = 64, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, hidden: int = 64,
                depth: int = 2, stock_names: bool = False) -> nn.Module:
    return TitanLlama(vocab, dim, n_heads, n_kv_heads, hidden, depth, stock_names)
