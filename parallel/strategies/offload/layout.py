"""Where every offloaded weight lives: blocks, each one flat byte buffer with a slot per parameter
(Note [offload engine] in parallel.strategies.offload.engine).

`Layout` replaces the model's meta parameters by real parameter objects that
stay the same for the whole run (their `.data` is bound into a block's buffer
or empty), gives each block's parameters their offsets in its buffer, and
leaves resident the parameters that no single block holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from parallel.strategies.offload.pool import BufferPool
from parallel.strategies.offload.tiers import ALIGN, aligned


@dataclass
class Slot:
    """One parameter's place in its block's flat buffer."""

    param: nn.Parameter
    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass
class Block:
    """One block: its parameters' slots, and where its weights, gradients and state are this step."""

    index: int
    name: str
    module: nn.Module
    slots: list[Slot]  # the trainable parameters first
    nbytes: int
    trained: int = 0  # bytes from the start that hold trainable parameters: what a step writes back
    buffer: torch.Tensor | None = None  # bound or being read
    pending: object = None  # the read into `buffer`, while it runs
    grads_ready: int = 0  # trainable parameters whose gradient is complete this step
    done: bool = False  # gradients handed off this step
    state_ready: bool = False  # AdamW state exists on the optimizer tier
    grad_slots: list[Slot] = field(default_factory=list)  # with clipping: whose gradients wait for the step
    grads_write: object = None  # the write of those gradients to the optimizer tier
    state_reads: object = None  # (pool buffers, their reads): its optimizer state read ahead of its step
    pool: BufferPool | None = None  # where its weights are read into
    group: tuple[int, int] = (0, 0)  # the blocks [lo, hi) that prefetching stays within
    ahead: bool = False  # a frozen block run one batch ahead (Note [frozen lookahead])

    @property
    def trainable(self) -> list[Slot]:
        return [s for s in self.slots if s.param.requires_grad]

    def key(self, kind: str = "w") -> str:
        """This block's key on a tier: weights `w`, AdamW moments `m` and `v`, gradients `g`."""
        return f"{kind}{self.index}"


class Layout:
    """Real parameter objects (empty until bound), blocks and their slots, resident parameters.

    Args:
        model: the model on the meta device.
        names: the blocks' module names, in forward order.
        device: the compute device (where the empty placeholders are).

    The new parameters go into the model only after initialization
    (`install`): the initialization rules read shapes off the meta ones.
    """

    def __init__(self, model: nn.Module, names: list[str], device: torch.device):
        real = self._real_parameters(model, device)
        self.params = [real[id(p)] for p in dict.fromkeys(model.parameters())]  # the single-device order
        self.fqns: dict[nn.Parameter, str] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            self.fqns.setdefault(real[id(p)], fqn)
        self.blocks = self._blocks(model, names, real)
        in_block = {id(s.param) for b in self.blocks for s in b.slots}
        self.resident = [p for p in self.params if id(p) not in in_block]
        self.block_of = {id(s.param): b for b in self.blocks for s in b.slots}

    def _real_parameters(self, model: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
        """id of each meta parameter -> its real one (one per tied weight); records where each goes."""
        real: dict[int, nn.Parameter] = {}
        self.shapes: dict[nn.Parameter, tuple] = {}
        self._slots_to_fill: list[tuple[nn.Module, str, nn.Parameter]] = []
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None:
                    continue
                q = real.get(id(p))
                if q is None:
                    q = real[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype, device=device),
                                                   requires_grad=p.requires_grad)
                    self.shapes[q] = (p.shape, p.dtype)
                self._slots_to_fill.append((module, name, q))
        return real

    def _blocks(self, model: nn.Module, names: list[str], real: dict[int, nn.Parameter]) -> list[Block]:
        holders: dict[nn.Parameter, set[int]] = {}
        mods = [model.get_submodule(n) for n in names]
        for i, m in enumerate(mods):
            for p in m.parameters():
                holders.setdefault(real[id(p)], set()).add(i)
        blocks = []
        for i, (name, m) in enumerate(zip(names, mods)):
            slots, offset, trained = [], 0, 0
            ps = [p for p in dict.fromkeys(real[id(p)] for p in m.parameters()) if len(holders[p]) == 1]
            # (a parameter shared between blocks stays resident) Trainable ones first: a step then writes back
            # one leading range, and the frozen rest of the block (LoRA's base weights) is only ever read.
            for p in sorted(ps, key=lambda p: not p.requires_grad):
                shape, dtype = self.shapes[p]
                nbytes = shape.numel() * dtype.itemsize
                slots.append(Slot(p, self.fqns[p], shape, dtype, offset, nbytes))
                offset += aligned(nbytes)
                trained = offset if p.requires_grad else trained
            blocks.append(Block(i, name, m, slots, max(offset, ALIGN), trained))
        return blocks

    def install(self) -> None:
        """Put the real parameters into the model, in place of the meta ones."""
        for module, name, q in self._slots_to_fill:
            module._parameters[name] = q
        self._slots_to_fill = []
