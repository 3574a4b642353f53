"""Values that follow from shapes alone (positions, causal masks), computed for real while planning.

See Note [planner], "Values from shapes". Fake tensors hold no values, so code
that reads a value (a Python `if` on a tensor) must guess, and Hugging Face
guesses on purpose: it treats a fake tensor as a trace and takes the path that
is right for any values. The planner runs a step of the real code; where the
real run reads a value that it could know without any data, this mode
computes it, so the code takes the real run's branch.
"""
from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

# The most elements one op may compute for real (8 MB of int64): a batch's positions and a sequence's
# causal mask fit; nothing the size of a model's weights or activations is ever made for real.
LIMIT = 1 << 20


class ShapeValues(TorchDispatchMode):
    """Over `fake_mode`: `aten.arange` on the CPU, and every deterministic aten op whose tensor inputs
    all came that way, run on real tensors (up to LIMIT elements each), so their values can be read;
    everything else goes to the fake mode, those real inputs turned fake first (the fake mode would
    compute an op of real tensors alone for real)."""

    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode
        self._real: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def _known(self, t: torch.Tensor) -> bool:
        return self._real.get(id(t)) is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if self._computable(func, tensors) and _small(func, tensors, args, kwargs):
            with _disable_current_modes():  # below this mode there is only the fake one
                out = func(*args, **kwargs)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._real[id(t)] = t
            return out
        known = [t for t in tensors if self._known(t)]
        if not known:  # the common case: nothing computed for real among the inputs, passed on as they are
            return func(*args, **kwargs)
        if func._schema.is_mutable:
            for t in known:  # written with unknown values: the fake mode's copy of it is the one to trust
                self._real.pop(id(t), None)
        args, kwargs = tree_map_only(torch.Tensor, self._fake, (args, kwargs))
        return func(*args, **kwargs)

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        return self.fake_mode.from_tensor(t) if self._known(t) else t

    def _computable(self, func, tensors: list[torch.Tensor]) -> bool:
        if func.namespace != "aten" or torch.Tag.nondeterministic_seeded in func.tags:
            return False  # collectives and random numbers keep their fake kernels
        if tensors:
            return all(self._known(t) for t in tensors)
        return func.overloadpacket is torch.ops.aten.arange


def _small(func, tensors: list[torch.Tensor], args, kwargs) -> bool:
    """Whether every output of `func` has at most LIMIT elements (run on meta copies to find out)."""
    if not tensors and torch.device(kwargs.get("device") or "cpu").type != "cpu":
        return False  # an arange for another device (a meta model) stays as it is
    with _disable_current_modes():
        margs, mkwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        if not tensors:
            mkwargs["device"] = torch.device("meta")
        try:
            out = func(*margs, **mkwargs)
        except (RuntimeError, NotImplementedError):
            # No meta kernel: the op reads values (item, nonzero), and gives no more than it reads.
            return all(t.numel() <= LIMIT for t in tensors)
    return all(t.numel() <= LIMIT for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
