"""BatchNorm under parallelism: statistics over the global batch (`strategy.sync_batchnorm`), the warning when
they are not, and running statistics that recomputation does not update twice.

# Note [batch norm]
A BatchNorm layer in training normalizes by the mean and variance of the
samples it sees, and moves its running statistics (buffers) toward them. One
process sees the whole global batch; under data parallelism each rank sees its
share, under a pipeline each microbatch is normalized on its own, and under
`trainer.grad_accum` each micro-step. Then the numbers differ from
`strategy=single`, and the ranks' running statistics drift apart, each
following its own samples: nothing syncs buffers (the composable DDP of
zero 0/1 is handed a parameter list, and FSDP2 leaves buffers alone), so
final_model.pt keeps rank 0's and a checkpoint one rank's copy of each. The
run says so at start (`batchnorm_warning`).

`strategy.sync_batchnorm=true` (strategy=data, or hybrid with dp > 1) turns
every BatchNorm layer into a `SyncBatchNorm` reducing its statistics over the
data-parallel ranks: the mean and variance of the global batch (of the global
microbatch under a pipeline), the same running statistics on every rank, and
the gradient of the global batch, so `batchnorm` models train as under
`single`. PyTorch's `torch.nn.SyncBatchNorm` runs on CUDA (and XPU, HPU) only:
its forward raises for CPU tensors ("SyncBatchNorm expected input tensor to be
on GPU", torch 2.13), and its kernels (`batch_norm_stats`,
`batch_norm_gather_stats_with_counts`) have no CPU version. `SyncBatchNorm` here is a subclass that
keeps PyTorch's path on those devices and, on the CPU (gloo), reduces the
statistics itself with `all_reduce` (`_SyncStats`): two passes, the sum and
count first, then the squared deviations from the global mean, so the variance
is as exact as one process's; backward reduces the two per-channel sums the
input gradient needs. Parameter and buffer names do not change. (DDP refuses
SyncBatchNorm layers on the CPU when it wraps a module; the composable
`replicate` of strategy=data hands it a parameter list, so that check never
sees them.)

Recomputation (`strategy.activations=checkpoint`, offload's too) runs a
block's forward again in backward; a BatchNorm layer would move its running
statistics a second time. `keep_running_stats(block)` is the recomputation's
context: it puts them back as they were before the block ran again.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import noop_context_fn

from parallel.config import Config, fail, pipelined

log = logging.getLogger("parallel")
NORMS = nn.modules.batchnorm._BatchNorm  # BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones
SYNCABLE = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_PYTORCH_DEVICES = ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


def batchnorms(model: nn.Module) -> list[str]:
    """Names of the BatchNorm layers of `model`."""
    return [name for name, m in model.named_modules() if isinstance(m, NORMS)]


class SyncBatchNorm(nn.SyncBatchNorm):
    """`torch.nn.SyncBatchNorm` that also runs on the CPU (Note [batch norm])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.process_group or dist.group.WORLD
        if x.device.type in _PYTORCH_DEVICES or not self.training or not dist.is_initialized() \
                or dist.get_world_size(group) == 1:
            return super().forward(x)
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as PyTorch's
                factor = 1.0 / float(self.num_batches_tracked)
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        return _SyncStats.apply(x, self.weight, self.bias, *running, self.eps, factor, group)


class _SyncStats(torch.autograd.Function):
    """Batch normalization with the mean and variance of every rank's samples in `group`."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group):
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        sums = torch.cat([x.sum(dims), x.new_full((1,), x.numel() // x.shape[1])])
        dist.all_reduce(sums, group=group)
        mean, n = sums[:-1] / sums[-1], sums[-1]
        centered = x - mean.view(shape)
        var = (centered * centered).sum(dims)
        dist.all_reduce(var, group=group)
        var = var / n
        invstd = torch.rsqrt(var + eps)
        xhat = centered * invstd.view(shape)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                running_var.mul_(1 - factor).add_(var * (n / (n - 1).clamp(min=1)), alpha=factor)
        ctx.save_for_backward(xhat, invstd, weight, n)
        ctx.group = group
        return xhat if weight is None else xhat * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx, grad):
        xhat, invstd, weight, n = ctx.saved_tensors
        dims = [0, *range(2, grad.dim())]
        shape = [1, -1] + [1] * (grad.dim() - 2)
        gxhat = grad if weight is None else grad * weight.view(shape)
        # The input's gradient needs the means of gxhat and gxhat * xhat over every rank's samples (each
        # rank's loss gradient is its own; the data-parallel average of the parameters' gradients follows).
        sums = torch.cat([gxhat.sum(dims), (gxhat * xhat).sum(dims)])
        dist.all_reduce(sums, group=ctx.group)
        c = xhat.shape[1]
        mean_g, mean_gx = (sums[:c] / n).view(shape), (sums[c:] / n).view(shape)
        gx = (gxhat - mean_g - xhat * mean_gx) * invstd.view(shape)
        gw = (grad * xhat).sum(dims) if weight is not None and ctx.needs_input_grad[1] else None
        gb = grad.sum(dims) if weight is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None, None, None


def sync_batchnorm(model: nn.Module, group) -> int:
    """Turn every BatchNorm layer of `model` into a `SyncBatchNorm` over `group`, in place, before DDP or FSDP
    wrap them. Returns how many were turned.

    The module itself changes class (as torch.nn.utils.parametrize and FSDP2 do), rather than being replaced:
    its parameters, buffers, hooks (recomputation's) and identity stay, so it may run after the pipeline split
    and the recomputation hooks. Only PyTorch's own BatchNorm classes are turned (`check_sync_batchnorm`
    refuses a subclass with a forward of its own)."""
    turned = 0
    for module in model.modules():
        if type(module) in SYNCABLE:
            module.__class__ = SyncBatchNorm
            module.process_group = group
            turned += 1
    return turned


@contextlib.contextmanager
def keep_running_stats(block: nn.Module):
    """Put back the running statistics of `block`'s BatchNorm layers on exit: the context of a recomputation
    (Note [batch norm]), which must not move them a second time."""
    norms = [m for m in block.modules() if isinstance(m, NORMS) and m.track_running_stats and m.training]
    saved = [{k: b.clone() for k, b in m._buffers.items() if b is not None} for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for k, value in buffers.items():
                    m._buffers[k].copy_(value)


def recompute_contexts(block: nn.Module):
    """`context_fn` for torch's checkpoint of `block`: nothing around the forward, `keep_running_stats` around
    the recomputation (the default, nothing around either, for a block without BatchNorm layers)."""
    if not any(isinstance(m, NORMS) and m.track_running_stats for m in block.modules()):
        return noop_context_fn
    return lambda: (contextlib.nullcontext(), keep_running_stats(block))


def batchnorm_warning(model: nn.Module, cfg: Config) -> str | None:
    """What the run says at start when its BatchNorm layers see less than the global batch (Note [batch
    norm]); None when they see all of it or there are none."""
    names = batchnorms(model)
    t, s = cfg.trainer, cfg.strategy
    if not names:
        return None
    samples, why = t.batch_size // t.grad_accum, []
    if (s.dp or 1) > 1 and not s.sync_batchnorm:
        samples //= s.dp
        why.append(f"per data-parallel rank (strategy.sync_batchnorm=true reduces them over the {s.dp} ranks)")
    if pipelined(s) and (s.microbatches or 1) > 1:
        samples //= s.microbatches
        why.append(f"per pipeline microbatch (strategy.microbatches={s.microbatches})")
    if t.grad_accum > 1:
        why.append(f"per accumulation micro-step (trainer.grad_accum={t.grad_accum})")
    if not why:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"BatchNorm statistics ({shown}) are computed {', '.join(why)}: over {samples} samples, not the "
            f"global batch of {t.batch_size}, so training differs from strategy=single")


def check_sync_batchnorm(cfg: Config, model: nn.Module) -> None:
    """strategy.sync_batchnorm=true needs data-parallel ranks (after the degrees are resolved) and a model with
    BatchNorm layers (`model` on meta). Raises ConfigError naming the key."""
    s = cfg.strategy
    if not s.sync_batchnorm:
        return
    if (s.dp or 1) < 2:  # only a strategy that spreads over dp has dp > 1 (Note [strategy table])
        fail("strategy.sync_batchnorm", True, f"reduces BatchNorm statistics over data-parallel ranks, and "
             f"strategy={s.name} has none (dp={s.dp})", "strategy=data, or strategy=hybrid with strategy.dp > 1")
    names = batchnorms(model)
    if not names:
        fail("strategy.sync_batchnorm", True, f"{type(model).__name__} has no BatchNorm layer to sync")
    own = [f"{n} ({type(model.get_submodule(n)).__name__})" for n in names
           if type(model.get_submodule(n)) not in SYNCABLE + (SyncBatchNorm,)]
    if own:
        fail("strategy.sync_batchnorm", True, f"cannot sync BatchNorm layers of classes with a forward of their "
             f"own: {', '.join(own[:3])}", "torch.nn.BatchNorm1d/2d/3d or torch.nn.SyncBatchNorm")
