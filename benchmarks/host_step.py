"""The offload optimizer's host step: torch's CPU AdamW kernels on the same tensors, and which is exact.

    python benchmarks/host_step.py [--params 48e6] [--blocks 12] [--repeats 5] [--threads 0]

strategy=offload steps AdamW on the host (Note [offload engine] in parallel/strategies/offload/engine.py), one block's
parameters at a time. This measures, on the same fp32 tensors (the model's weights cut into --blocks blocks
of tensors shaped like a transformer block's), each of torch's functional AdamW forms:

    single    foreach=False: what torch.optim.AdamW runs on CPU tensors by default (the reference)
    foreach   foreach=True: the multi-tensor kernel (the offload step's)
    fused     fused=True: one fused kernel per dtype

Each form steps every block --repeats times; the figure is the median block-pass time, as parameters
per second and as bytes touched per second (weights, gradients and the two moments read, three written:
28 bytes per parameter), and its ratio to `single`. "exact" says whether the weights and moments after the
steps are bit-equal to `single`'s. Forms alternate within each repeat (single, foreach, fused, single, ...)
so that drift hits all alike. Prints a table, writes benchmarks/results/host_step.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.optim.adamw import adamw

ROOT = Path(__file__).resolve().parents[1]
FORMS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
HYPER = dict(amsgrad=False, beta1=0.9, beta2=0.95, lr=3e-4, weight_decay=0.1, eps=1e-8, maximize=False)


def blocks(params: int, count: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """`count` blocks of 4 square-ish weight matrices (attention and MLP shapes) with `params` weights in all."""
    per = params // count
    width = int((per / 12) ** 0.5)  # q, k, v, o: 4 w^2; MLP up and down: 8 w^2
    shapes = [(width, width)] * 4 + [(4 * width, width), (width, 4 * width)]
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(count)]


def state(weights: list[list[torch.Tensor]], seed: int = 1):
    """Gradients, both moments and the step counts of every block (the same values for every form)."""
    g = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(w.shape, generator=g) * 1e-2 for w in b] for b in weights]
    m = [[torch.randn(w.shape, generator=g) * 1e-3 for w in b] for b in weights]
    v = [[torch.rand(w.shape, generator=g) * 1e-5 for w in b] for b in weights]
    steps = [[torch.tensor(10.0) for _ in b] for b in weights]
    return grads, m, v, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=48e6)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: every core)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host_step.json"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    base = blocks(int(a.params), a.blocks)
    n = sum(w.numel() for b in base for w in b)
    runs = {}
    for name in FORMS:
        weights = [[w.clone() for w in b] for b in base]
        runs[name] = (weights, *state(weights))
    times: dict[str, list[float]] = {name: [] for name in FORMS}
    for _ in range(a.repeats):
        for name, kwargs in FORMS.items():  # alternating: each repeat runs every form once
            weights, grads, m, v, steps = runs[name]
            t0 = time.perf_counter()
            for i in range(len(weights)):
                adamw(weights[i], grads[i], m[i], v[i], [], steps[i], **HYPER, **kwargs)
            times[name].append(time.perf_counter() - t0)
    ref = runs["single"]
    rows = []
    for name in FORMS:
        t = statistics.median(times[name])
        exact = all(torch.equal(x, y) for k in (0, 2, 3) for bx, by in zip(runs[name][k], ref[k])
                    for x, y in zip(bx, by))
        rows.append({"form": name, "step_s": t, "params_per_s": n / t, "bytes_per_s": 28 * n / t,
                     "speed_vs_single": statistics.median(times["single"]) / t, "exact": exact})
    print(f"AdamW host step, {n / 1e6:.1f}M parameters in {a.blocks} blocks, {torch.get_num_threads()} threads, "
          f"{a.repeats} alternating repeats (torch {torch.__version__})")
    print(f"{'form':<8} {'step':>9} {'Mparams/s':>10} {'GB/s':>7} {'vs single':>10}  exact")
    for r in rows:
        print(f"{r['form']:<8} {r['step_s'] * 1e3:7.1f}ms {r['params_per_s'] / 1e6:10.1f} "
              f"{r['bytes_per_s'] / 1e9:7.2f} {r['speed_vs_single']:9.2f}x  {r['exact']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"params": n, "blocks": a.blocks, "threads": torch.get_num_threads(),
                                       "repeats": a.repeats, "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
