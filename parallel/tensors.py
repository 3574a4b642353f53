"""Small tensor helpers shared by the strategies, the trainer and the memory counts."""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from parallel.torch_compat import settle_autograd_threads

# Note [inputs by name]
# A batch's input is one tensor, passed as `model(x)`, or, when data.input_key lists several fields of the
# samples (data=custom: a Hugging Face encoder-decoder's input_ids, attention_mask, decoder_input_ids,
# labels; a multimodal model's pixel_values), a dict of tensors in that order, passed by name as
# `model(**x)`, every tensor with the samples in its first dimension. The first field is the main one: the
# token count, the sequence length and the task are read from it. What cuts a batch by rows
# (accumulation's micro-steps) cuts every field alike (`split_rows`); what cuts sequences or traces the
# forward into stages (context parallelism, the pipeline) takes one tensor and refuses a dict before the
# workers start (parallel/validate.py).


def call_model(model, x, **named):
    """The model's forward on a batch's input: `model(x)`, or `model(**x)` for inputs by name (Note [inputs
    by name]); `named`: what the strategy adds (context parallelism's position_ids)."""
    return model(**x, **named) if isinstance(x, Mapping) else model(x, **named)


def as_call(x) -> tuple[tuple, dict]:
    """A batch's input as the (positional, by name) arguments of the forward (Note [inputs by name])."""
    return ((), dict(x)) if isinstance(x, Mapping) else ((x,), {})


def split_rows(x, n: int) -> list:
    """A batch's input cut into `n` pieces by rows, every field alike (`torch.chunk`'s pieces)."""
    if not isinstance(x, Mapping):
        return list(x.chunk(n))
    parts = {k: v.chunk(n) for k, v in x.items()}
    return [dict(zip(parts, pieces)) for pieces in zip(*parts.values())]


def to_device(x, device, non_blocking: bool = False):
    """A batch's input on `device`, every field of inputs by name alike."""
    if isinstance(x, Mapping):
        return {k: v.to(device, non_blocking=non_blocking) for k, v in x.items()}
    return x.to(device, non_blocking=non_blocking)


def main_field(x) -> torch.Tensor:
    """The tensor a batch's input is counted by: itself, or the first field of inputs by name."""
    return next(iter(x.values())) if isinstance(x, Mapping) else x


def rank_optimizer(optimizer):
    """The optimizer holding this rank's state: a ShardedOptimizer's own (ZeRO 1 in parallel/optim.py, which
    keeps it as `optim`), else the optimizer itself. Here, below every layer that steps or counts one."""
    return getattr(optimizer, "optim", optimizer)


def in_own_thread(name: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a new thread named `name`, its exception re-raised here. Device meshes made for
    different ranks compare equal (same layout), and DTensor caches its sharding decisions by mesh, so a fake
    rank's step (the planner's, a tensor plan's rehearsal) would be handed meshes whose process groups went
    with the one before it; meshes also compare by the thread that made them, and DTensor's caches are per
    thread, so each run on its own thread starts clean."""
    out: list = []

    def body():
        try:
            out.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # re-raised on the caller's thread
            out.append((False, e))

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (tensor- or data-parallel), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's piece of `t`."""
    t = local(t)
    return t.numel() * t.element_size()


_WRAPPER_TYPES: dict[type, bool] = {}  # type -> whether it is a traceable wrapper subclass (a property of the class)


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold `t`'s memory. A wrapper subclass (DTensor, the async result of a functional
    collective) owns a storage of its full size that holds nothing: what it wraps holds the memory."""
    wrapper = _WRAPPER_TYPES.get(type(t))
    if wrapper is None:  # asked once per class: the planner asks of every tensor an op makes
        wrapper = _WRAPPER_TYPES[type(t)] = is_traceable_wrapper_subclass(t)
    if not wrapper:
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, name) for name in names)
    return [p for i in inner if isinstance(i, torch.Tensor) for p in plain_tensors(i)]


@contextlib.contextmanager
def faking():
    """Meta tensors computed on as fake tensors: a FakeTensorMode, unless one is active already (the planner).

    A library that reads values in its forward (Hugging Face's attention masks test `.all()` of the
    positions) takes its tracing path on fake tensors and fails on plain meta ones.
    """
    if detect_fake_mode() is not None:
        yield
        return
    settle_autograd_threads()  # before a backward on fake tensors: Note [autograd threads and fork]
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def meta_forward(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a meta model and meta inputs, without gradients, as fake tensors (`faking`)."""
    if detect_fake_mode() is not None:
        with torch.no_grad():
            return fn(*args, **kwargs)
    # A failing op is the caller's to report (a shape that does not fit is a config error); the fake mode
    # would also log its traceback.
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    was = quiet.disabled
    quiet.disabled = True
    try:
        with torch.no_grad(), faking():
            return fn(*args, **kwargs)
    finally:
        quiet.disabled = was
