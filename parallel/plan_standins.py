"""What the planner hands a run through its Runtime (Note [runtime]) in place of the real things, which cannot
run on fake tensors: the offload engine's threads run inline, its tiers count the bytes they would move, and DDP
is a stand-in that adds its gradient buckets (Note [planner] in parallel/planner.py)."""
from __future__ import annotations

from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from parallel.offload.activations import ActivationStore
from parallel.offload.engine import OffloadIO
from parallel.offload.tiers import DiskTier
from parallel.tensors import local_bytes


class InlineExecutor:
    """Runs what the offload engine hands its threads at once, on the calling thread: fake tensors
    cannot be used by two threads at a time. Outside the trackers, as on a thread of its own, where the
    trainer's measurement (thread-local) does not see it either."""

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, fn, *args, **kwargs):
        future = Future()
        try:
            with _disable_current_modes():
                future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, as a thread's future would
            future.set_exception(e)
        return future

    def shutdown(self, *args, **kwargs):
        pass


class CountingIO(OffloadIO):
    """strategy=offload with its transfers left out: fake tensors have no bytes to write or read. What
    stays on the device (its buffer pool, what the step allocates) is what the plan counts; an activation
    read back is a new tensor of its shape, as the real read allocates one. Bytes that would move are
    counted (for strategy=auto's cost model)."""

    def __init__(self):
        moved = self.moved = [0]

        def count(t: torch.Tensor) -> None:
            moved[0] += t.numel() * t.element_size()

        class Disk(DiskTier):
            def write(self, key, src):
                count(src)

            def read(self, key, dst):
                count(dst)

        class Activations(ActivationStore):
            def _write(self, h, src):
                count(src)

            def _start_read(self, h):
                h.tensor, h.pending = torch.empty(h.shape, dtype=h.dtype, device=self.device), None
                count(h.tensor)

        self.disk_tier, self.activation_store = Disk, Activations


class DDPStandIn:
    """DDP cannot run on fake tensors (its C++ reducer checks and hooks read tensor data), so while
    planning its `replicate` (the runtime's) leaves the model as it is and the plan adds what DDP itself holds: its gradient
    buckets, one flat copy of the trainable parameters' gradients, alive for the whole run, and what it
    sends: the buckets all-reduced over the group it was given."""

    def __init__(self):
        self.models: list[tuple[nn.Module, int]] = []  # each with the size of its data-parallel group

    def replicate(self, model: nn.Module, device_mesh=None, **kwargs) -> nn.Module:
        self.models.append((model, device_mesh.size() if device_mesh is not None else dist.get_world_size()))
        return model

    def buckets(self) -> list[tuple[int, int]]:
        """(bucket bytes, the group's size) per replicated model."""
        return [(sum(local_bytes(p) for p in m.parameters() if p.requires_grad), world) for m, world in self.models]

    def bucket_bytes(self) -> int:
        return sum(size for size, _ in self.buckets())
