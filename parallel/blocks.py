"""Which modules of a model are its blocks: the units a pipeline stage begins at, offload streams, and
recomputation checkpoints (Note [pipeline partitioning] in parallel/strategies/pipeline/partition.py)."""
from __future__ import annotations

from torch import nn

from parallel.tensors import meta_forward


def candidates(model: nn.Module, example: tuple) -> tuple[list[str], dict[str, tuple]]:
    """Candidate block names in forward order, and each one's example (args, kwargs) on meta.

    Args:
        model: the unpartitioned model on the meta device.
        example: the positional inputs of one microbatch (meta tensors).
    """
    names = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            names += [f"{name}.{sub}" for sub, _ in child.named_children()]
        else:
            names.append(name)
    order, inputs, handles = [], {}, []
    for name in names:
        def hook(mod, args, kwargs, name=name):
            if name not in inputs:
                order.append(name)
                inputs[name] = (args, kwargs)
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        meta_forward(model, *example)
    finally:
        for h in handles:
            h.remove()
    return order, inputs
