"""The patches of PyTorch's private internals the planner and the pipeline's evaluation need, in one place,
and why (checked on torch 2.11-2.15: Note [torch versions] in parallel/torch_compat.py).

The planner (Note [planner] in parallel/planner.py) runs the real training step
on fake tensors and a fake process group. Everything of the project's that must
behave differently there is passed in through the run's Runtime (Note
[runtime]); the three places below are inside PyTorch, with no argument to pass
a stand-in through, so they are patched for the duration of a plan and
restored after. The fourth (`forward_only_actions`) changes one schedule
object's action list for the duration of an evaluation. Nothing else patches
anything at run time.
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
    """Device meshes made while building (FSDP over tensor-parallel parameters joins two) compute their
    coordinates with tensor ops on real values: `DeviceMesh.__init__` runs outside the fake mode."""
    init = DeviceMesh.__init__

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init
    try:
        yield
    finally:
        DeviceMesh.__init__ = init


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
