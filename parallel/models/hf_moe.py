"""Hugging Face mixture-of-experts models (Mixtral, Qwen3-MoE, GPT-OSS, ...): where their fused experts are.
Their grouped matrix products on fake tensors: Note [grouped matmul on fake tensors] in parallel/torch_patches.py.
"""
from __future__ import annotations

from torch import nn


def grouped_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformers experts modules of `model` that dispatch on `config._experts_implementation` (made by
    transformers' `use_experts_implementation`: `is_concatenated`, `has_gate` set on them), by name."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "is_concatenated") and hasattr(m, "has_gate") and hasattr(m, "num_experts")]
