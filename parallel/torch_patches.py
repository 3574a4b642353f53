"""The patches of PyTorch's private internals the planner and the pipeline's evaluation need, in one place,
and why (checked on torch 2.11-2.15: Note [torch versions] in parallel/torch_compat.py).

The planner (Note [planner] in parallel/planning/planner.py) runs the real training step
on fake tensors and a fake process group. Everything of the project's that must
behave differently there is passed in through the run's Runtime (Note
[runtime]); the three places below are inside PyTorch, with no argument to pass
a stand-in through, so they are patched for the duration of a plan and
restored after. The fourth (`forward_only_actions`) changes one schedule
object's action list for the duration of an evaluation. The fifth
(`register_grouped_mm_fake`) gives one op a fake kernel of its own, for fake
tensors only, for the whole process. Nothing else patches anything at run time.

# Note [grouped matmul on fake tensors]
transformers 5 holds a MoE layer's experts fused (`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj` (E, H, I))
and computes them with `torch._grouped_mm` (its `experts_implementation` "grouped_mm", the default where
torch has the op; `_can_use_grouped_mm` in transformers/integrations/moe.py). The op's kernels take fp32,
bf16 and fp16 operands, on the CPU ("Expected mat_a to be Float32, BFloat16 or Float16 matrix") and on CUDA
(bf16 through the grouped GEMM, the others through the op's fallback of one product per group), so a real
fp32 run on the CPU takes that path and trains. torch's fake kernel of the op (`meta_grouped_mm` in
torch/_meta_registrations.py, torch 2.11-2.15) is written from the CUDA fast path alone and refuses
anything but bf16 ("Expected inputs of BF16 type"). Every pass the framework runs on fake tensors (the
check that the model takes the data, the FLOP count, the pipeline's trace through torch.export, the
planner's step, the offload engine's block shapes) then fails on a model a real run trains.

So the op gets a fake kernel that accepts what its real kernels accept (`register_grouped_mm_fake`, through
torch.library's public `register_fake`, which overrides a built-in op's fake kernel for fake tensors only:
meta tensors and real kernels are untouched): the same output shapes as torch's own for the four operand
layouts, the dtype `out_dtype` or the operands'. Every pass then takes the path the real run takes, the
grouped product itself (traced into the pipeline's stages as `aten._grouped_mm`, run there on the real
operands). It is registered once per process, when a model whose experts compute this way is made ready to
train (parallel.models.hf.for_training), before any of those passes.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import schedules

from parallel import torch_compat


@contextlib.contextmanager
def static_pipeline_warmup():
    """Pipeline schedules of torch 2.12-2.14 begin a step with a warm-up vote between neighbouring stages that
    reads a received value (`_PipelineSchedule._warmup_p2p`); under a fake process group nothing is received.
    The planner's stages are given their shapes (Runtime.static_shapes), so every stage is told its shapes are
    static instead. torch 2.11 and 2.15 hold no such vote (Note [torch versions]): nothing is patched."""
    if not torch_compat.has("pipeline_warmup_vote"):
        yield
        return
    inference_mode = torch_compat.find("torch.distributed.pipelining._utils:InferenceMode")

    def warmup(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = inference_mode.STATIC

    saved = schedules._PipelineSchedule._warmup_p2p
    schedules._PipelineSchedule._warmup_p2p = warmup
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = saved


class HeldSend:
    """A send's work that keeps the sent tensors alive for as long as the schedule keeps the work, as a
    real process group's work does (the fake one's holds nothing, so sent activations and gradients
    would be freed at once: an interleaved schedule keeps its sends until the end of the step)."""

    def __init__(self, work, tensors: list[torch.Tensor]):
        self.work, self.tensors = work, tensors

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self.work.is_completed()


@contextlib.contextmanager
def sends_held_by_their_works():
    """See HeldSend: the schedules' point-to-point batches (`schedules._batch_p2p`) return works that hold
    their sent tensors."""
    batch = schedules._batch_p2p

    def held(p2p_ops, desc=None):
        sent = [op.tensor for op in p2p_ops if op.op is dist.isend]
        return [HeldSend(w, sent) for w in batch(p2p_ops, desc)]

    schedules._batch_p2p = held
    try:
        yield
    finally:
        schedules._batch_p2p = batch


@contextlib.contextmanager
def meshes_outside_fake():
    """Device meshes made while building (FSDP over tensor-parallel parameters joins two; hybrid sharding
    unflattens the data-parallel ranks, Note [hybrid sharding] in parallel/dims.py) compute their coordinates and
    their process groups' ranks with tensor ops on real values: `DeviceMesh.__init__` and `DeviceMesh._unflatten`
    (which makes its mesh's groups after `__init__`) run outside the fake mode."""
    init, unflatten = DeviceMesh.__init__, DeviceMesh._unflatten

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def real_unflatten(self, *args, **kwargs):
        with unset_fake_temporarily():
            return unflatten(self, *args, **kwargs)

    DeviceMesh.__init__, DeviceMesh._unflatten = real_init, real_unflatten
    try:
        yield
    finally:
        DeviceMesh.__init__, DeviceMesh._unflatten = init, unflatten


@contextlib.contextmanager
def forward_only_actions(schedule):
    """The V-shaped schedules (ZBV, DualPipeV) run their whole action list in `eval()` too, backward actions
    included, and a backward between two stages of one rank fails without a backward ("can't steal_bwd_input
    if this stage doesn't have backward"). For the enclosed evaluation the schedule's lowered action list
    keeps only the forward work: forwards (those inside an overlapped forward-backward as well), their sends
    (and, on torch 2.15, the sends' waits) and receives, and FSDP's unshard and reshard. Dropping actions only removes waits, so the forward order
    stays free of deadlocks. Other schedules' `eval()` works as it is."""
    t = schedules._ComputationType
    keep = {t.FORWARD, t.SEND_F, t.RECV_F, t.UNSHARD, t.RESHARD}
    if hasattr(t, "WAIT_SEND_F"):  # torch 2.15 waits for each send in an action of its own
        keep.add(t.WAIT_SEND_F)

    def forward(actions):
        for a in actions:
            if a is not None and a.computation_type == t.OVERLAP_F_B:
                yield from (s for s in a.sub_actions if s.computation_type == t.FORWARD)
            elif a is not None and a.computation_type in keep:
                yield a

    saved = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: list(forward(actions)) for rank, actions in saved.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = saved


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the op's CPU and CUDA kernels take
_registered = []  # the torch.library fragment holding the grouped products' fake kernel, once registered


def _grouped_mm_fake(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The shape of `torch._grouped_mm(mat_a, mat_b, offs=offs)`: 2D x 3D (tokens grouped by expert, one
    weight per expert: forward and input gradient), 2D x 2D (the contraction grouped: weight gradient),
    3D x 2D, 3D x 3D (a batch)."""
    torch._check(mat_a.dtype in GROUPED_MM_DTYPES and mat_a.dtype == mat_b.dtype,
                 lambda: f"Expected mat_a and mat_b of one dtype among {GROUPED_MM_DTYPES}, got {mat_a.dtype} "
                         f"and {mat_b.dtype}")
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "grouped_mm takes 2D or 3D operands")
    torch._check(bias is None, lambda: "grouped_mm takes no bias")
    if mat_a.dim() == 3 or mat_b.dim() == 3:
        torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "contraction dimensions of mat_a and mat_b differ")
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        shape = (offs.size(0), mat_a.size(0), mat_b.size(1))
    elif mat_a.dim() == 2:
        shape = (mat_a.size(0), mat_b.size(-1))
    elif mat_b.dim() == 2:
        shape = (mat_a.size(1), mat_b.size(1))
    else:
        shape = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return mat_a.new_empty(shape, dtype=out_dtype or mat_a.dtype)


def register_grouped_mm_fake() -> None:
    """Give `aten._grouped_mm` a fake kernel that takes every dtype its kernels take (Note [grouped matmul on
    fake tensors]); once per process."""
    if _registered:
        return
    lib = torch.library.Library("aten", "FRAGMENT")  # kept alive: the registration lasts as long as it
    torch.library.register_fake("aten::_grouped_mm", _grouped_mm_fake, lib=lib)
    _registered.append(lib)
