"""The routing figures of mixture-of-experts layers for metrics.jsonl: tokens per expert, load imbalance,
dropped tokens and the load-balancing loss, over the training forwards since the last logged step."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn


def moe_record(modules: list[nn.Module], replicas: int = 1) -> dict:
    """The figures of every layer with `stats` (parallel.models.moe.MoE; a user's layer may keep its own with
    parallel.models.moe.record), summed over all ranks, which then clear them. Collective over the world:
    every rank calls it (a pipeline stage without such layers too); {} when no rank has one.

    Args:
        modules: this rank's modules (the engine's state modules).
        replicas: how many ranks see the same tokens in the same layer (the tensor-parallel degree); their
            sum is divided by it.
    """
    mine = {}
    for module in modules:
        for name, m in module.named_modules():
            stats = getattr(m, "stats", None)
            if isinstance(stats, dict) and "tokens" in stats:
                mine[name] = {k: v.tolist() for k, v in stats.items()}
                stats.clear()
    parts = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    layers: dict[str, dict[str, list[float]]] = {}
    for part in parts:
        for name, stats in part.items():
            into = layers.setdefault(name, {k: [0.0] * len(v) for k, v in stats.items()})
            for k, v in stats.items():
                into[k] = [a + b / replicas for a, b in zip(into[k], v)]
    if not layers:
        return {}
    tokens = [s["tokens"] for s in layers.values()]
    imbalance = [max(t) / (sum(t) / len(t)) if sum(t) else 1.0 for t in tokens]
    seqs = sum(s["seqs"][0] for s in layers.values()) / len(layers)
    record = {"moe_load_imbalance": max(imbalance), "moe_load_imbalance_per_layer": imbalance,
              "moe_dropped_tokens": int(sum(s["dropped"][0] for s in layers.values())),
              "moe_aux_loss": sum(s["aux"][0] for s in layers.values()) / seqs if seqs else 0.0}
    if len({len(t) for t in tokens}) == 1:
        record["moe_tokens_per_expert"] = [int(sum(col)) for col in zip(*tokens)]
    return record
