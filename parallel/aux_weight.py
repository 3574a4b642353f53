"""The weight of a layer's auxiliary loss in a step, handed from the engine that runs the step to the layers
that add such a term (the load-balancing loss of parallel.models.moe: Note [auxiliary loss] there).

# Note [auxiliary weight]
A layer whose auxiliary term joins the gradients without passing through the model's output weighs one
sequence's term as the step's loss weighs one sample (Note [global loss] in parallel/loss.py): a figure of the
whole step (`Loss.aux_weight`), not of the forward the layer sees. The layer holds it in a non-persistent
scalar buffer named `aux_weight` (`register_aux_weight`; float64, so the weight times the layer's coefficient
rounds once, to the term's dtype, as the Python figure it is). The engine finds those buffers in the modules
it runs, once, when it is built (`AuxWeights`), and fills them at the start of every step, before the first
forward; the layer's backward reads its own buffer. A buffer rather than a Python attribute or a global: a
traced pipeline stage (parallel/strategies/pipeline/trace.py) keeps the model's buffers, under their names,
and reads them when it runs, where an attribute is fixed at the trace and the stage has no layer objects.
The buffer is in no state dict (checkpoints, exported weights); its initial value is 0, also under
`model.init=name` (parallel/init/by_name.py), and 0 means that no engine set it: a plain PyTorch loop, where
a layer weighs its terms by the sequences of each forward.
"""
from __future__ import annotations

import torch
from torch import nn

AUX_WEIGHT = "aux_weight"


def register_aux_weight(module: nn.Module) -> None:
    """Give `module` (a layer with an auxiliary term) its `aux_weight` buffer, 0 until an engine sets it."""
    module.register_buffer(AUX_WEIGHT, torch.zeros((), dtype=torch.float64), persistent=False)


def is_aux_weight(module: nn.Module, local_name: str) -> bool:
    """Whether `module.<local_name>` is an auxiliary weight (a non-persistent buffer of that name)."""
    return local_name == AUX_WEIGHT and local_name in module._non_persistent_buffers_set


class AuxWeights:
    """The auxiliary weights of the layers in `modules` (this rank's model, or its pipeline stages), which the
    engine sets for each step (Note [auxiliary weight]). The holders are kept, not the tensors: materializing
    a meta model replaces its buffers."""

    def __init__(self, modules: list[nn.Module]):
        self.holders = [m for module in modules for m in module.modules() if AUX_WEIGHT in m._buffers]

    def set(self, weight: float) -> None:
        """Every layer's weight for the step about to run."""
        with torch.no_grad():
            for m in self.holders:
                m._buffers[AUX_WEIGHT].fill_(weight)
