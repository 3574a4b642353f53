"""A hand-written single-device training loop of a Hugging Face Llama: the baseline of benchmarks/gpu.py.

    python benchmarks/gpu_loop.py [--device cuda] [--bf16] [--layers 12] [--hidden 2048] [--heads 16]
                                  [--kv-heads 8] [--ffn 5632] [--vocab 32000] [--seq 2048] [--batch 8] [--steps 12]

What a user writes without the framework, on the model `benchmarks.hf_loop.llama`
builds (also the framework's `model._target_` in gpu.py): the same seed (so the
same initial weights, made on the CPU and moved to the device), the same
batches (the framework's synthetic lm data), torch's AdamW with the framework's
defaults (lr 5e-3, weight decay 0.01) at a constant learning rate, no gradient
clipping (gpu.py runs the framework with trainer.clip_grad_norm=0), and with
--bf16 the forward and the loss under bf16 autocast (fp32 weights and optimizer
state), as trainer.precision=bf16 does.

Prints, as one JSON line: the mean time of steps 2..N-1 (the first warms up;
the framework leaves out its first and last, where it counts memory), each
synchronized on CUDA and counted from the batch read to the optimizer step's
end as the framework counts it, the last loss, tokens/s and, on CUDA, the
allocator's peak (torch.cuda.max_memory_allocated).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from benchmarks.hf_loop import llama, lm_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast over the forward and the loss")
    for name, default in [("vocab", 32000), ("seq", 2048), ("hidden", 2048), ("layers", 12), ("heads", 16),
                          ("kv-heads", 8), ("ffn", 5632), ("batch", 8), ("steps", 12)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    from parallel.config import DataConfig
    from parallel.data import SyntheticData

    device = torch.device(a.device)
    torch.manual_seed(0)
    model = llama(a.vocab, a.seq, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    data = SyntheticData(DataConfig(task="lm", vocab_size=a.vocab, seq_len=a.seq), 0, a.batch)
    cast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if a.bf16 else contextlib.nullcontext
    times, loss = [], None
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        x, y = data.batch(step, device)
        with cast():
            loss = lm_loss(model(x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    kept = times[1:-1] or times
    step_time = sum(kept) / len(kept)
    out = {"step_time_s": step_time, "loss": loss.item(), "tokens_per_s": a.batch * a.seq / step_time}
    if device.type == "cuda":
        out["mem_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
