"""What the planner hands a run through its Runtime (Note [runtime]) in place of the real things, which cannot
run on fake tensors: the offload engine's threads run inline, its tiers count the bytes they would move (and,
planning for CUDA, the pinned host memory they would hold), and DDP is a stand-in that adds its gradient buckets
(Note [planner] in parallel/planning/planner.py)."""
from __future__ import annotations

import contextlib
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from parallel.planning.cuda import pinned
from parallel.strategies.offload.activations import ActivationStore
from parallel.strategies.offload.engine import OffloadIO
from parallel.strategies.offload.tiers import DiskTier
from parallel.tensors import local, local_bytes


class InlineExecutor:
    """Runs what the offload engine hands its threads at once, on the calling thread: fake tensors
    cannot be used by two threads at a time. Outside the trackers, as on a thread of its own, where the
    trainer's measurement (thread-local) does not see it either; `watched`: inside them, as CUDA's
    allocator counts what every thread allocates (Note [planning for CUDA] in parallel/planning/cuda.py)."""

    def __init__(self, *args, watched: bool = False, **kwargs):
        self.watched = watched

    def submit(self, fn, *args, **kwargs):
        future = Future()
        try:
            with contextlib.nullcontext() if self.watched else _disable_current_modes():
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
    counted (for strategy=auto's cost model), and so is the pinned host memory the cpu tier would hold under
    a GPU (`pinned`: now and at most; Note [planning for CUDA] in parallel/planning/cuda.py)."""

    def __init__(self):
        self.moved = [0]
        self.pinned = [0, 0]  # pinned host bytes: now, at most
        count, pin, unpin = self.count, self.pin, self.unpin

        class Disk(DiskTier):
            def write(self, key, src):
                count(src)

            def read(self, key, dst):
                count(dst)

        class Host:
            """The cpu tier under a GPU (parallel.strategies.offload.tiers.HostTier): a pinned buffer per key."""

            name = "cpu"

            def __init__(self, device, counters):
                self.host: dict[str, int] = {}

            def write(self, key, src):
                if key not in self.host:
                    self.host[key] = pin(src.numel() * src.element_size())
                count(src)

            def read(self, key, dst):
                count(dst)

            def close(self):
                for nbytes in self.host.values():
                    unpin(nbytes)
                self.host.clear()

        class Activations(ActivationStore):
            def _write(self, h, src):
                count(src)
                if self.fd is None:  # pinned host memory under a GPU, until read back
                    self.host[h.offset] = pin(h.nbytes)

            def _start_read(self, h):
                h.tensor, h.pending = torch.empty(h.shape, dtype=h.dtype, device=self.device), None
                count(h.tensor)
                if self.fd is None:
                    unpin(self.host.pop(h.offset))

            def close(self):
                for nbytes in self.host.values():  # pinned copies never read back
                    unpin(nbytes)
                self.host.clear()
                super().close()

        self.disk_tier, self.host_tier, self.activation_store = Disk, Host, Activations

    def count(self, t: torch.Tensor) -> None:
        """`t`'s bytes would move."""
        self.moved[0] += t.numel() * t.element_size()

    def pin(self, nbytes: int) -> int:
        """A pinned host buffer of `nbytes` is made (returns `nbytes`)."""
        self.pinned[0] += pinned(nbytes)
        self.pinned[1] = max(self.pinned[1], self.pinned[0])
        return nbytes

    def unpin(self, nbytes: int) -> None:
        """A pinned host buffer of `nbytes` is let go."""
        self.pinned[0] -= pinned(nbytes)


class DDPStandIn:
    """DDP cannot run on fake tensors (its C++ reducer checks and hooks read tensor data), so while
    planning its `replicate` (the runtime's) leaves the model as it is and the plan adds what DDP itself holds: its gradient
    buckets, one flat copy of the trainable parameters' gradients, alive for the whole run, and what it
    sends: the buckets all-reduced over the group it was given (in bf16 under trainer.reduce_precision=bf16:
    half the bytes, Note [mixed precision] in parallel/strategies/data.py), and the work of its copies
    (`copy_gradients`)."""

    def __init__(self):
        self.models: list[tuple[nn.Module, int, int]] = []  # each with its group's size and the bytes it sends per 4

    def replicate(self, model: nn.Module, device_mesh=None, reduce_dtype: torch.dtype = torch.float32,
                  **kwargs) -> nn.Module:
        world = device_mesh.size() if device_mesh is not None else dist.get_world_size()
        self.models.append((model, world, torch.empty((), dtype=reduce_dtype).element_size()))
        return model

    def _bytes(self, model: nn.Module) -> int:
        return sum(local_bytes(p) for p in model.parameters() if p.requires_grad)

    def buckets(self) -> list[tuple[int, int]]:
        """(bytes all-reduced, the group's size) per replicated model."""
        return [(self._bytes(m) * size // 4, world) for m, world, size in self.models]

    def bucket_bytes(self) -> int:
        """The buckets DDP holds: fp32, as the gradients."""
        return sum(self._bytes(m) for m, _, _ in self.models)

    def bucket_sizes(self, cap: int = 25 << 20) -> list[int]:
        """The buckets' bytes one by one, as DDP's caching allocator requests them: each model's of `cap`
        (bucket_cap_mb's default, 25 MiB) but the last."""
        out = []
        for m, _, _ in self.models:
            n = self._bytes(m)
            out += [cap] * (n // cap) + ([n % cap] if n % cap else [])
        return out

    def copy_gradients(self, counter) -> None:
        """Run, under the dispatch mode `counter` (the planner's parallel.planning.work.Work), what DDP's reducer does
        to each gradient in a step, its buckets being copies and not views of the gradients: the gradient
        scaled by 1 / the group's size into its bucket (a product into an output), and the bucket's reduced
        values copied back (on meta tensors of the gradients' local shapes: the work is what is counted)."""
        for model, world, _ in self.models:
            grads = [torch.empty(local(p).shape, dtype=p.dtype, device="meta") for p in model.parameters()
                     if p.requires_grad]
            buckets = [torch.empty_like(g) for g in grads]
            with counter:
                for g, b in zip(grads, buckets):
                    torch.mul(g, 1 / world, out=b)
                    g.copy_(b)
