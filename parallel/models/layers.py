"""Locally connected layers: a convolution whose weights are not shared between output positions.

Each output position p has its own weight W_p (out_channels x in_channels x
kernel) and, optionally, its own bias. A per-position loop (or a layer that
slices the input once per position, as some libraries do) keeps one slice and
one partial result per position alive for backward: memory grows with
positions x activation size. Here the input is unfolded once (a strided view:
no copy), the patches are laid out position-major in one tensor, and one
batched matrix product with the stacked weights gives every position at once:

    patches  (P, N, C_in * K)      one copy of the input's patches
    weight   (P, C_in * K, C_out)
    out      (P, N, C_out)         = bmm(patches, weight)

so memory is the weights, the patches (the input times K / stride) and the
output. Backward saves only `patches` and the weight.

Sharding over positions (tensor parallel, style `positions`,
`PositionwiseParallel`): the weight's first dimension is the position, so each
tensor-parallel rank holds the weights of P / tp positions (`Shard(0)`, the
bias `Shard(1)`), computes those positions from the replicated input, and the
outputs are gathered (one all-gather in forward; in backward each rank keeps
its own positions' gradient, and the input's gradient, to which every rank
contributed its positions, is all-reduced).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    if len(v) != 2 or not all(isinstance(i, int) for i in v):
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
    return v


def _out_size(size: int, kernel: int, stride: int, padding: int, what: str) -> int:
    if kernel < 1 or stride < 1 or padding < 0:
        raise ValueError(f"{what}: kernel_size and stride must be >= 1 and padding >= 0 "
                         f"(got kernel_size={kernel}, stride={stride}, padding={padding})")
    out = (size + 2 * padding - kernel) // stride + 1
    if out < 1:
        raise ValueError(f"{what}: input_size {size} with padding {padding} is smaller than kernel_size {kernel}")
    return out


class _LocallyConnected(nn.Module):
    """Shared by the 1-d and 2-d layers: weights (P, C_in * K, C_out), bias (C_out, P)."""

    def _make(self, in_channels: int, out_channels: int, positions: int, kernel_numel: int, bias: bool) -> None:
        self.in_channels, self.out_channels = in_channels, out_channels
        self.weight = nn.Parameter(torch.empty(positions, in_channels * kernel_numel, out_channels))
        self.bias = nn.Parameter(torch.empty(out_channels, positions)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # What a convolution with the same fan-in draws: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        if not self.weight.is_meta:
            nn.init.uniform_(self.weight, -bound, bound)
            if self.bias is not None:
                nn.init.uniform_(self.bias, -bound, bound)

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """The framework's initialization by name (Note [initialization by name])."""
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        tensor.uniform_(-bound, bound, generator=generator)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, input_size={self.input_size}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"bias={self.bias is not None}")

    def _apply_patches(self, patches: torch.Tensor, batch: int, out_shape: tuple[int, ...]) -> torch.Tensor:
        # patches: (P, N, C_in * K), contiguous (the one copy); one batched product for every position.
        if isinstance(self.weight, DTensor):  # PositionwiseParallel: this rank's positions only
            group = self.weight.device_mesh.get_group()
            w = self.weight.to_local()
            start = self.weight.device_mesh.get_local_rank() * w.shape[0]
            patches = _ReduceGrad.apply(patches, group)[start:start + w.shape[0]]
            out = torch.bmm(patches, w)  # (P / tp, N, C_out)
            if self.bias is not None:
                out = out + self.bias.to_local().t().unsqueeze(1)
            out = _GatherPositions.apply(out, group).permute(1, 2, 0)
        else:
            out = torch.bmm(patches, self.weight).permute(1, 2, 0)  # (P, N, C_out) -> (N, C_out, P)
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(batch, self.out_channels, *out_shape)


class LocallyConnected1d(_LocallyConnected):
    """(N, in_channels, input_size) -> (N, out_channels, L_out), one weight per output position.

    Args:
        in_channels, out_channels: channels in and out.
        input_size: the input's length L.
        kernel_size, stride, padding: as for Conv1d (zero padding);
            L_out = (L + 2 * padding - kernel_size) // stride + 1.
        bias: a bias per output channel and position.
    """

    def __init__(self, in_channels: int, out_channels: int, input_size: int, kernel_size: int, stride: int = 1,
                 padding: int = 0, bias: bool = True):
        super().__init__()
        self.input_size, self.kernel_size, self.stride, self.padding = input_size, kernel_size, stride, padding
        self.output_size = _out_size(input_size, kernel_size, stride, padding, type(self).__name__)
        self._make(in_channels, out_channels, self.output_size, kernel_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if x.shape[1:] != (self.in_channels, self.input_size):
            raise ValueError(f"{type(self).__name__} expects (N, {self.in_channels}, {self.input_size}), "
                             f"got {tuple(x.shape)}")
        if self.padding:
            x = F.pad(x, (self.padding, self.padding))
        # (N, C, P, K), a strided view -> (P, N, C * K), copied once: channel-major, kernel-minor, as the weight.
        patches = x.unfold(2, self.kernel_size, self.stride).permute(2, 0, 1, 3)
        patches = patches.reshape(self.output_size, n, self.in_channels * self.kernel_size)
        return self._apply_patches(patches, n, (self.output_size,))


class LocallyConnected2d(_LocallyConnected):
    """(N, in_channels, H, W) -> (N, out_channels, H_out, W_out), one weight per output position.

    Args: as LocallyConnected1d, with input_size, kernel_size, stride and
    padding each an int or an (h, w) pair.
    """

    def __init__(self, in_channels: int, out_channels: int, input_size, kernel_size, stride=1, padding=0,
                 bias: bool = True):
        super().__init__()
        self.input_size = _pair(input_size, "input_size")
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = _pair(stride, "stride")
        self.padding = _pair(padding, "padding")
        name = type(self).__name__
        self.output_size = tuple(_out_size(s, k, st, p, name) for s, k, st, p in
                                 zip(self.input_size, self.kernel_size, self.stride, self.padding))
        kh, kw = self.kernel_size
        self._make(in_channels, out_channels, self.output_size[0] * self.output_size[1], kh * kw, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if x.shape[1:] != (self.in_channels, *self.input_size):
            raise ValueError(f"{type(self).__name__} expects (N, {self.in_channels}, {self.input_size[0]}, "
                             f"{self.input_size[1]}), got {tuple(x.shape)}")
        ph, pw = self.padding
        if ph or pw:
            x = F.pad(x, (pw, pw, ph, ph))
        (kh, kw), (sh, sw), (ho, wo) = self.kernel_size, self.stride, self.output_size
        # (N, C, Ho, Wo, kh, kw), a strided view -> (Ho * Wo, N, C * kh * kw), copied once.
        patches = x.unfold(2, kh, sh).unfold(3, kw, sw).permute(2, 3, 0, 1, 4, 5)
        patches = patches.reshape(ho * wo, n, self.in_channels * kh * kw)
        return self._apply_patches(patches, n, self.output_size)


# Hand-written because PyTorch's autograd collectives sum the output gradient
# over ranks in all-gather's backward (right when each rank's loss differs, as
# in data parallelism); here every tensor-parallel rank computes the same loss
# from the gathered output, so each keeps its own slice.
class _GatherPositions(torch.autograd.Function):
    """Forward: all-gather position chunks along dim 0. Backward: this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(group), local.shape[0]
        chunks = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, local.contiguous(), group=group)
        return torch.cat(chunks)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


class _ReduceGrad(torch.autograd.Function):
    """Forward: the identity. Backward: the gradient summed over the group (each rank's positions add theirs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class PositionwiseParallel(ParallelStyle):
    """Tensor parallelism for LocallyConnected1d/2d: output positions split over the mesh (style `positions`).

    The positions must divide by the mesh size. The input is expected
    replicated (the same on every rank) and the output is whole on every rank.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, _LocallyConnected):
            raise TypeError(f"PositionwiseParallel shards LocallyConnected1d/2d, not {type(module).__name__}")

        def partition(name, mod, mesh):
            if mod is not module:
                return
            for pname, dim in (("weight", 0), ("bias", 1)):
                param = getattr(mod, pname)
                if param is not None:
                    mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)]),
                                                               requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, partition)
