"""What a CUDA run holds that a step of the same code on the CPU does not, for plans of CUDA runs made on any host.

# Note [planning for CUDA]
`launch/plan.py trainer.device=cuda` (or `auto` where a GPU is visible, and
strategy=auto's candidates for such a run) plans the CUDA run without a GPU.
It cannot plan on fake CUDA tensors: on a build of torch without CUDA (the CPU
wheel, 2.13) autograd asks the CUDA device guard of a fake CUDA tensor for its
stream and the process aborts. So the step runs on the CPU device, as every
plan does (Note [planner] in parallel/planning/planner.py), and what differs on CUDA is
put back:

  dtypes     trainer.precision=auto is bf16 autocast on CUDA (parallel.config
             bf16_run), and the step's forward runs under the CPU's bf16
             autocast: the same matrix products cast to bf16, the same cache of
             the bf16 copies of the weights (leaf tensors that require grad,
             kept until the outermost autocast region exits, so a weight used
             twice in forward is cast once), the same bf16 tensors saved for
             backward. CUDA's autocast also runs some functions in fp32 that
             the CPU's leaves in bf16 (softmax, log_softmax, layer_norm,
             rms_norm, exp, pow, sum and more: aten/src/ATen/autocast_mode.h);
             while planning, kernels registered for the CPU's autocast do
             for them what CUDA's does (bf16 inputs cast to fp32, or an fp32
             result asked for), in forward and in recomputed blocks alike, and
             count them in `fp32_on_cuda` (GPT-2's gelu `pow`; `layer_norm`
             where the residual stream is bf16, as under FSDP2's mixed
             precision, which casts each block's inputs; Llama's norms and the
             loss upcast to fp32 themselves).
  allocator  torch.cuda.max_memory_allocated counts the caching allocator's
             blocks, each request rounded up to a multiple of 512 bytes
             (c10/cuda/CUDACachingAllocator.cpp, round_size): every storage is
             counted so rounded (`rounding`: what that adds at the peak).
  cuBLAS     each thread that calls cuBLAS gets a workspace of its own, from
             the caching allocator at its first call and kept for the run
             (aten/src/ATen/cuda/CublasHandlePool.cpp): the thread that runs
             forward, and autograd's device thread, which runs backward
             (recomputed blocks included). The plan adds one at the first
             matrix product of forward and one at the first of backward
             (`workspaces`: those live at the peak). The size is torch's:
             CUBLAS_WORKSPACE_CONFIG (":KiB:COUNT" pairs) when set, else the
             default for the GPU visible here, or without one Hopper's (H100,
             H200) 32 MiB; 8 MiB + 128 KiB on older GPUs. cuBLASLt shares it
             where torch unifies the two (recent releases; else 1 MiB more a
             thread, left out).
  optimizer  torch.optim runs its foreach implementation on CUDA tensors (one
             kernel over a whole group) and the per-tensor loop on CPU ones,
             unless optim.args sets `foreach` or `fused`. Foreach holds a
             temporary of the whole group (AdamW: the square roots of every
             second moment, the size of the weights), so the plan runs it.
  offload    its tiers are chosen as under a GPU (cpu: pinned host memory;
             auto: cpu), moving nothing (parallel.planning.standins.CountingIO).
             Their pinned buffers are host memory, not the device's: counted
             apart (`host_pinned`, at most what was pinned at once, each
             buffer rounded up to a power of two as torch's caching host
             allocator does). The engine's step thread allocates on the device
             and the CUDA counter sees every thread, so that work is planned
             inline and counted (a CPU plan leaves it out, as the CPU's
             per-thread measurement does).

The caching allocator's segments, the cached free blocks and fragmentation
included (max_memory_reserved over max_memory_allocated), are simulated from
the step's requests and frees in order: `reserved` and `reserved_expandable`,
Note [caching allocator] in parallel/planning/allocator.py.

Left out: what takes device memory outside the caching allocator (the CUDA
context, a few hundred MB per process; NCCL's buffers and channels); and what max_memory_allocated counts that no tensor of
the step shows: kernels' scratch (flash attention's fp32 accumulators in
backward, cuDNN workspaces), the rest of a large cached block handed out whole
(up to 1 MB a block), context parallelism's CUDA attention (planned as the CPU's
exchange). Leave the budget room for them (`memory.budget` a few GB under the
card's size).
"""
from __future__ import annotations

import contextlib
import os
import re
from collections import Counter

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from parallel.planning.allocator import AllocatorFeed

BLOCK = 512  # bytes: the caching allocator rounds every request up to a multiple of it
HOPPER_WORKSPACE = 32 * 1024 * 1024  # torch's cuBLAS workspace on sm90 (and Blackwell in recent releases)
OLDER_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8", torch's default before Hopper

LEFT_OUT = ["the CUDA context", "NCCL buffers", "kernel scratch (flash-attention backward, cuDNN workspaces)",
            "the caching allocator's streams (reserved: planned as one)"]

_aten = torch.ops.aten
# Ops that call cuBLAS (and so make the calling thread's workspace), as they reach the dispatcher.
BLAS_OPS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.mv, _aten.addmv, _aten.dot,
            _aten.vdot, _aten._addmm_activation}
# What CUDA's autocast runs in fp32 (aten/src/ATen/autocast_mode.h): ops whose floating inputs it casts to fp32
# (AT_FORALL_FP32), and ops it asks for an fp32 result (AT_FORALL_FP32_SET_OPT_DTYPE); "name.overload".
FP32_INPUTS = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
               "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
               "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
               "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
               "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
               "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
               "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
               "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
               "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
               "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
FP32_RESULT = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
               "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
_HALF = (torch.bfloat16, torch.float16)


def allocated(nbytes: int) -> int:
    """The bytes the caching allocator counts for a request of `nbytes`: rounded up to 512 (0 stays 0)."""
    return -(-nbytes // BLOCK) * BLOCK


def pinned(nbytes: int) -> int:
    """The bytes torch's caching host allocator pins for `nbytes`: the next power of two (0 stays 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def cublas_workspace(environ=os.environ) -> tuple[int, str]:
    """(bytes of one cuBLAS workspace, where the figure comes from), as torch chooses it."""
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        return sum(int(kib) * 1024 * int(count) for kib, count in pairs), f"CUBLAS_WORKSPACE_CONFIG={config}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        size = HOPPER_WORKSPACE if p.major in (9, 10, 12) else OLDER_WORKSPACE
        return size, f"torch's default on {p.name}"
    return HOPPER_WORKSPACE, "torch's default on Hopper (H100, H200); CUBLAS_WORKSPACE_CONFIG sets it"


class CudaAccount:
    """A rank role's CUDA-only memory over its planned steps, fed each op by the planner's tracker: the cuBLAS
    workspaces (kept from the step that made them on); the caching allocator's segments (`segments`, fed every
    storage made, freed and resized: Note [caching allocator] in parallel/planning/allocator.py); and, under
    `autocast_as_on_cuda`, the ops CUDA's autocast runs in fp32.

    Args:
        fake: the plan's FakeTensorMode (the workspaces are fake tensors, made outside the counters).
        workspace: the bytes of one workspace (`cublas_workspace`).
    """

    def __init__(self, fake, workspace: int):
        self.fake, self.workspace = fake, workspace
        self.workspaces: dict[str, torch.Tensor] = {}  # "forward" / "backward" thread -> its workspace
        self.fp32_on_cuda: Counter[str] = Counter()
        self.segments = AllocatorFeed()  # over both steps: segments are kept from one step to the next

    def see(self, func) -> torch.Tensor | None:
        """Note op `func`; returns the workspace it makes (a tensor to count from now on), or None."""
        if func.overloadpacket not in BLAS_OPS:
            return None
        thread = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if thread in self.workspaces:
            return None
        with _disable_current_modes(), self.fake:  # outside the counters: no op of the step
            self.workspaces[thread] = torch.empty(self.workspace, dtype=torch.uint8)
        return self.workspaces[thread]

    @contextlib.contextmanager
    def autocast_as_on_cuda(self):
        """While open, CPU autocast runs FP32_INPUTS and FP32_RESULT as CUDA's does, each call given a bf16 (or
        fp16) tensor in forward counted in `fp32_on_cuda`: kernels registered with torch.library for the CPU's
        autocast key where it has none of its own, removed on exit. At the dispatcher, as CUDA's autocast is,
        so recomputed blocks (in backward) run them the same way."""
        lib = torch.library.Library("aten", "IMPL")
        try:
            for name in FP32_INPUTS + FP32_RESULT:
                packet, _, overload = name.partition(".")
                op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
                if op is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "AutocastCPU"):
                    lib.impl(name, self._kernel(op, packet, name in FP32_RESULT), "AutocastCPU")
            yield
        finally:
            lib._destroy()

    def _kernel(self, op, name: str, result: bool):
        """CUDA's autocast kernel for `op`: its inputs cast to fp32, or (`result`) an fp32 result asked for."""
        counts = self.fp32_on_cuda
        dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
        below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

        def kernel(*args, **kwargs):
            if torch._C._current_graph_task_id() == -1 and any(
                    isinstance(t, torch.Tensor) and t.dtype in _HALF for t in tree_flatten((args, kwargs))[0]):
                counts[name] += 1
            if result and dtype_at is not None:
                given = args[dtype_at] if dtype_at < len(args) else kwargs.get("dtype")
                first = args[0]
                if given is None and first.is_floating_point() and first.dtype != torch.float64:
                    args, kwargs = args[:dtype_at], {**kwargs, "dtype": torch.float32}
            elif not result:
                args, kwargs = tree_map(_fp32, (args, kwargs))
            with torch._C._ExcludeDispatchKeyGuard(below):  # on to the kernels below autocast
                return op(*args, **kwargs)

        return kernel


def _fp32(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in _HALF else x


def foreach_as_on_cuda(*optimizers) -> None:
    """Have the `optimizers` (a ZeRO-1 optimizer and the local one it wraps) run the implementation torch.optim picks for
    CUDA tensors: foreach, in every group that leaves `foreach` unset and is not fused. Not in a group that mixes
    DTensors with plain tensors (tensor parallelism's sharded and whole weights): foreach cannot take both at once
    (DTensor refuses the mix), so such a group keeps the per-tensor loop."""
    from torch.distributed.tensor import DTensor

    for opt in {id(o): o for o in optimizers}.values():
        for group in getattr(opt, "param_groups", []):
            mixed = len({isinstance(p, DTensor) for p in group["params"]}) > 1
            if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                    and not group.get("differentiable") and not mixed:
                group["foreach"] = True
