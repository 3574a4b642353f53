"""Hand-written training loops of a Hugging Face Llama: the baselines for benchmarks/hf.py.

    torchrun --nproc-per-node 2 benchmarks/hf_loop.py --loop fsdp [--layers 12 --hidden 768 ...]
    torchrun --nproc-per-node 2 benchmarks/hf_loop.py --loop pipeline --microbatches 4

What a user writes without the framework, on the model `llama` builds (also the
framework's `model._target_`): the same seed (so the same initial weights), the
same batches (the framework's synthetic lm data, each rank its slice), AdamW,
a constant learning rate and global gradient-norm clipping at 1.0.

    fsdp      FSDP2: fully_shard on every decoder layer, then the root (what
              strategy=data strategy.zero=3 does)
    pipeline  torch.distributed.pipelining: rank r runs decoder layers
              [r*L/2, (r+1)*L/2), the first also the embedding, the last also
              the final norm and the head; 1F1B over --microbatches

Prints the mean time of steps 2..N-1 (the first warms up; the framework leaves
out its first and last, where it counts memory) and the last loss as JSON on rank 0.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def llama(vocab_size: int = 32000, seq_len: int = 128, dim: int = 768, layers: int = 12, heads: int = 12,
          kv_heads: int = 4, ffn: int = 2048):
    """A LlamaForCausalLM from its config (nothing downloaded): 12 x 768 with ffn 2048 is ~125M parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                      use_cache=False)
    return LlamaForCausalLM(cfg)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class Stage(nn.Module):
    """Decoder layers [lo, hi) of a Llama, with the embedding (first stage) or the norm and head (last)."""

    def __init__(self, model, lo: int, hi: int):
        super().__init__()
        inner = model.model
        first, last = lo == 0, hi == len(inner.layers)
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.rotary = inner.rotary_emb
        self.norm, self.head = (inner.norm, model.lm_head) if last else (None, None)

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.rotary(h, positions)
        for layer in self.layers:  # no mask: SDPA's is_causal, as the whole model runs it
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
        return self.head(self.norm(h)) if self.head is not None else h


def build(a, rank: int, world: int):
    """(the module this rank trains, a step function(x, y) -> loss or None)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = llama(a.vocab, a.seq, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn)
    model.train()
    if a.loop == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)

        def step(x, y):
            loss = lm_loss(model(x).logits, y)
            loss.backward()
            return loss
        return model, step
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    per = a.layers // world
    stage = Stage(model, rank * per, a.layers if rank == world - 1 else (rank + 1) * per)
    pipe = PipelineStage(stage, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(pipe, n_microbatches=a.microbatches, loss_fn=lm_loss)

    def step(x, y):
        losses = [] if pipe.is_last else None
        schedule.step(*((x,) if pipe.is_first else ()), target=y if pipe.is_last else None, losses=losses)
        return torch.stack(losses).mean().detach() if losses else None
    return stage, step


def clip(module: nn.Module, max_norm: float, pipeline: bool) -> None:
    params = [p for p in module.parameters() if p.grad is not None]
    if not pipeline:
        torch.nn.utils.clip_grad_norm_(params, max_norm)  # DTensor gradients: the global norm
        return
    square = sum(p.grad.pow(2).sum() for p in params)
    dist.all_reduce(square)  # the stages hold different gradients
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, square.sqrt())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", choices=["fsdp", "pipeline"], default="fsdp")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="global")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=4)
    a = ap.parse_args()
    from parallel.config import DataConfig
    from parallel.data import SyntheticData

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module, step = build(a, rank, world)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.01)
    data_cfg = DataConfig(task="lm", vocab_size=a.vocab, seq_len=a.seq)
    # Data parallel: each rank its slice; a pipeline: every rank the whole batch (the ends use it).
    data = SyntheticData(data_cfg, 0, a.batch, *((rank, world) if a.loop == "fsdp" else (0, 1)))
    times, loss = [], None
    for i in range(1, a.steps + 1):
        t0 = time.perf_counter()
        x, y = data.batch(i, torch.device("cpu"))
        loss = step(x, y)
        clip(module, 1.0, a.loop == "pipeline")
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if a.loop == "fsdp":  # each rank's mean over its slice: the global mean is their mean
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world
    if (rank == 0 and a.loop == "fsdp") or (rank == world - 1 and a.loop == "pipeline"):
        kept = times[1:-1] or times
        print(json.dumps({"step_time_s": sum(kept) / len(kept), "loss": float(loss)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
