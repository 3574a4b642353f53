"""How a strategy runs one step: forward/backward over the global batch, the grad norm, its metrics.

Every strategy returns an engine; the training loop only talks to this interface
(`model`, `forward_backward`, `clip`, `metrics`, `loss_group`, `holds_loss`,
`state_modules` or `checkpoint_state` for checkpoints), so
strategy-specific work stays out of the loop.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from parallel.config import Config
from parallel.optim import clip_grad_norm


def autocast(cfg: Config, device: torch.device):
    # bf16 autocast on CUDA only: on the CPU the run stays fp32 so that every
    # strategy can be checked against `single` to 1e-4.
    use_bf16 = device.type == "cuda" and cfg.trainer.precision in ("auto", "bf16")
    return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


class LocalEngine:
    """The whole model on every rank (single, data): forward and backward with gradient accumulation.

    Args:
        model: the parallelized, materialized model.
        cfg: the run config.
        loss_fn: (output, target) -> mean loss.
        loss_group: the group whose ranks each hold a slice of the batch (data parallel).
    """

    holds_loss = True

    def __init__(self, model: nn.Module, cfg: Config, loss_fn, loss_group, device: torch.device):
        self.model, self.cfg, self.loss_fn, self.loss_group, self.device = model, cfg, loss_fn, loss_group, device

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's mean loss over its slice; gradients left in .grad."""
        accum = self.cfg.trainer.grad_accum
        total = torch.zeros((), device=x.device)
        for i, (xs, ys) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            # Gradients are reduced across data-parallel ranks only on the last micro-step.
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(i == accum - 1)
            with autocast(self.cfg, self.device):
                loss = self.loss_fn(self.model(xs).float(), ys) / accum
            loss.backward()
            total += loss.detach()
        return total

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model, max_norm)

    def metrics(self) -> dict:
        return {}

    def state_modules(self) -> list[nn.Module]:
        """The modules whose state dicts hold this rank's tensors under their unpartitioned names."""
        return [self.model]

    def full_state_dict(self) -> dict:
        """The unpartitioned state dict, gathered on rank 0 (CPU tensors; {} elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)
