"""strategy=context and strategy.cp: each sample's sequence split over the cp ranks (Note [context parallelism]
in parallel/strategies/context/attention.py).

The model keeps its modules and names; what changes is where its attention looks:

  built-in gpt        each block's Attention takes the cp attention as its `attend`
  Hugging Face        a causal decoder following transformers' attention interface (Llama, Mistral, Qwen,
                      GPT-2, ...) runs its attention through a function registered with that interface
                      ("context_parallel"), which reads the cp layout off each attention module

and the engine hands each rank its chunks of every sequence (inputs and targets alike), with the tokens'
global positions as `position_ids` (learned positions in gpt, rotary ones in Hugging Face models).

Which attention runs over the cp ranks depends on the device (`attention_path`): on CUDA PyTorch's own ring
attention (Note [context parallelism on CUDA] in cuda.py), elsewhere the exchange written here for the CPU's
kernels and gloo (Note [context parallelism] in attention.py). Both hand rank r chunks r and 2cp-1-r.

# Note [context parallelism under the pipeline]
strategy=hybrid with pp > 1 and cp > 1 (the built-in gpt, Hugging Face causal LMs). The pipeline traces the
model with torch.export (Note [tracing for the pipeline]), which could not trace the cp exchange
(collectives inside an autograd.Function) and would bake the first stage's `arange(T)` positions into its
graph. Neither reaches the trace: the model is traced on one rank's share of a microbatch, tokens
(b, T / cp) with `position_ids` (b, T / cp) as a second input (`example_microbatch`, given by name:
`by_name` in pipeline/trace.py), so every stage's graph and the shapes crossing stages are those of the
rank's chunks, and the positions (learned ones in gpt, rotary ones in Hugging Face models) come from the
engine at run time. Attention is traced as the model's plain attention. The built-in gpt's runs inside its
blocks, which strategy=hybrid swaps back for the model's own modules before building the stages
(`eager_blocks`), and those take the cp attention (`point_attention`); a Hugging Face model's blocks stay
traced (Note [own or traced blocks] in pipeline/stages.py), and their attention ops are replaced by the cp
attention in the graphs (Note [traced attention over the cp ranks] in traced.py). The engine cuts inputs and
targets to the rank's chunks and hands the positions one row per sample, so the schedule splits them into
microbatches with the tokens. The loss count and the gradient average span dp x ep x cp as without the
pipeline.
"""
from __future__ import annotations

import sys

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel import torch_compat
from parallel.config import Config, cuda_run, fail
from parallel.strategies.context.attention import SequenceShard
from parallel.strategies.context.traced import point_traced_attention, traceable_attention

HF_NAME = "context_parallel"  # the name the cp attention is registered under with transformers


def attention_path(device_type: str) -> str:
    """Which attention over the cp ranks runs on `device_type`: "torch" (PyTorch's ring attention, CUDA
    kernels, nccl) on cuda, "exchange" (the hand-written one, the CPU's flash kernel, gloo) elsewhere."""
    return "torch" if device_type == "cuda" else "exchange"


def sequence_shard(mesh: DeviceMesh) -> SequenceShard | None:
    """This rank's chunks of each sequence, with the attention for the mesh's device; None when cp is 1."""
    cp = mesh["cp"]
    if cp.size() == 1:
        return None
    if attention_path(mesh.device_type) == "torch":
        from parallel.strategies.context.cuda import TorchSequenceShard, enable_torch_context_parallel

        enable_torch_context_parallel()
        return TorchSequenceShard(cp.size(), cp.get_local_rank(), cp.get_group(), mesh=cp)
    return SequenceShard(cp.size(), cp.get_local_rank(), cp.get_group())


def _hf_attention_modules(model: nn.Module) -> list[nn.Module] | None:
    """The causal attention modules of a transformers model that runs attention through its attention
    interface; None for any other model."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    if not model._can_set_attn_implementation():
        return None
    return [m for m in model.modules() if getattr(m, "is_causal", False) is True and hasattr(m, "scaling")]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules context parallelism can split (empty: none it knows)."""
    from parallel.models.gpt import Attention

    found = [m for m in model.modules() if isinstance(m, Attention)]
    return found or _hf_attention_modules(model) or []


def _hf_attend(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface, over the cp ranks: q (B, H, 2L, D), k and v with the model's key/value
    heads; returns (B, 2L, H, D) as the interface's own functions do. The causal mask is the cp layout's
    (transformers makes none for an implementation it has no mask for); attention dropout is 0 (checked before
    the run: check_context)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = module.context_shard.attend(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def point_attention(module: nn.Module, shard: SequenceShard) -> None:
    """Point the built-in gpt attention modules inside `module` (a model or a pipeline stage) at the cp ranks,
    in place."""
    for attention in attention_modules(module):
        attention.attend = shard.attend


def point_stage_attention(stage: nn.Module, shard: SequenceShard, model: nn.Module) -> None:
    """Point a pipeline stage's attention at the cp ranks, in place (Note [context parallelism under the
    pipeline]): the built-in gpt's own blocks take it as their `attend`, the traced attention of a Hugging
    Face model's blocks is replaced in their graphs (every attention module of `model` the stage holds)."""
    point_attention(stage, shard)
    hf = {id(m) for m in _hf_attention_modules(model) or ()}
    point_traced_attention(stage, shard, [name for name, m in model.named_modules() if id(m) in hf])


def apply_context(model: nn.Module, mesh: DeviceMesh) -> SequenceShard | None:
    """Point `model`'s attention at the cp ranks, in place; returns the layout the engine splits batches by
    (None when cp is 1)."""
    shard = sequence_shard(mesh)
    if shard is None:
        return None
    hf = _hf_attention_modules(model)
    if hf:
        from transformers import AttentionInterface

        AttentionInterface.register(HF_NAME, _hf_attend)
        for module in hf:
            module.context_shard = shard
        model.set_attn_implementation(HF_NAME)
        return shard
    point_attention(model, shard)
    return shard


def _check_cuda(cfg: Config) -> None:
    """What PyTorch's ring attention takes on CUDA (Note [context parallelism on CUDA] in cuda.py)."""
    s, key = cfg.strategy, "strategy.cp"
    torch_compat.require("cuda_context_parallel", key, s.cp, ["trainer.device=cpu", "1"])  # Note [torch versions]
    if cfg.trainer.compile:
        fail(key, s.cp, "trainer.compile=true with context parallelism on CUDA (PyTorch's ring attention) is not "
             "supported yet", ["trainer.compile=false", "trainer.device=cpu", "1"])
    chunk = cfg.data.seq_len // (2 * s.cp)
    if cfg.trainer.precision == "fp32" and chunk % 32:
        # fp32 attention runs the memory-efficient kernel, whose log-sum-exp is padded to 32 rows; torch's ring
        # merges blocks through it, so every chunk must be whole rows of 32.
        fail(key, s.cp, f"in fp32 on CUDA each of the 2 x cp chunks must hold a multiple of 32 tokens (PyTorch's "
             f"ring attention on the memory-efficient kernel); data.seq_len={cfg.data.seq_len} gives {chunk}",
             [f"data.seq_len={64 * s.cp * max(1, -(-chunk // 32))}", "trainer.precision=bf16", "1"])


def sliding_window(config) -> int | None:
    """The window of a Hugging Face config's sliding-window attention layers (Mistral's `sliding_window`; Qwen2's
    with `use_sliding_window`; per-layer `layer_types` naming "sliding_attention"), None when it has none. The cp
    attention is plain causal attention (the model's mask is not read), which equals a window only as long as
    the sequence."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return window


def check_context(cfg: Config, model: nn.Module) -> None:
    """strategy.cp > 1 (resolved degrees): a model whose attention can be split, per-token targets, and
    sequences of a length that divides into 2 x cp chunks (Note [context parallelism])."""
    s = cfg.strategy
    if s.cp == 1:
        return
    key = "strategy.cp"
    if not attention_modules(model):
        fail(key, s.cp, f"context parallelism splits causal self-attention, and {type(model).__name__} has none "
             "it knows (the built-in gpt, or a Hugging Face causal decoder using transformers' attention interface)",
             ["model=gpt", "a Hugging Face causal LM (Llama, Mistral, Qwen, GPT-2, ...)", "1"])
    config = getattr(model, "config", None)
    dropout = max((getattr(config, k, 0) or 0 for k in ("attention_dropout", "attn_pdrop")), default=0)
    if dropout:
        fail(key, s.cp, f"the attention over the cp ranks has no dropout, and {type(model).__name__}'s attention "
             f"dropout is {dropout}", ["+model.config.attention_dropout=0 (or attn_pdrop=0)", "1"])
    window = sliding_window(config)
    if window is not None and window < cfg.data.seq_len:
        fail(key, s.cp, f"the attention over the cp ranks is causal over the whole sequence, and "
             f"{type(model).__name__} attends over a sliding window of {window} tokens, shorter than data.seq_len="
             f"{cfg.data.seq_len}", [f"data.seq_len<={window}", "+model.config.sliding_window=null", "1"])
    if cfg.data.task != "lm":
        fail(key, s.cp, f"context parallelism splits sequences with a target per token; data.task="
             f"{cfg.data.task} has one per sample", ["data.task=lm", "1"])
    if cfg.data.seq_len % (2 * s.cp):
        fail(key, s.cp, f"data.seq_len={cfg.data.seq_len} must divide into 2 x cp = {2 * s.cp} chunks (load "
             "balancing pairs the first and last chunks)",
             [c for c in range(1, cfg.data.seq_len // 2 + 1) if cfg.data.seq_len % (2 * c) == 0][:8])
    if cuda_run(cfg.trainer.device):
        _check_cuda(cfg)
    from parallel.models.gpt import GPT

    if s.pp > 1 and not isinstance(model, GPT) and not _hf_attention_modules(model):  # forward(tokens, position_ids)
        fail(key, s.cp, f"context parallelism composes with pipeline parallelism for the built-in gpt and Hugging "
             f"Face causal LMs; {type(model).__name__}'s pipeline stages would need positions as a traced input "
             "(Note [context parallelism under the pipeline])",
             ["strategy.pp=1", "model=gpt", "a Hugging Face causal LM", "1"])
    if s.pp > 1:
        try:  # what the workers do before tracing (Note [traced attention over the cp ranks])
            traceable_attention(model)
        except ValueError as e:  # transformers' refusal: the model has no "sdpa" attention
            fail(key, s.cp, f"with pipeline parallelism {type(model).__name__} is traced with its \"sdpa\" "
                 f"attention, which it does not take ({str(e).split('. ')[0]})", ["strategy.pp=1", "1"])
    if s.sequence_parallel:
        fail("strategy.sequence_parallel", True, "does not compose with context parallelism yet (strategy.cp="
             f"{s.cp})", [False])
