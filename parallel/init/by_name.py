"""`model.init=name`: every tensor initialized on its own, from a generator seeded by its name.

# Note [initialization by name]
Every parameter and buffer is filled from its own generator, seeded by
(seed, fully qualified name in the unpartitioned model). The full tensor is
computed on the CPU one at a time and each rank keeps only the piece it owns (a
DTensor shard, or the whole tensor), so the initial weights are the same whatever
the strategy, world size or stage split, and no rank ever holds the whole model.
The values follow PyTorch's own defaults for each layer type; a module with
parameters of its own kind provides `init_parameter(name, tensor, generator)`;
any other module is initialized by its own method, run on a CPU copy of that
module alone under a seed from the name: the model's `_init_weights(module)`
(Hugging Face models) or the module's `reset_parameters()`. The values differ
from the user's own `torch.manual_seed(seed); factory()` (one generator in
construction order); `model.init=module` (parallel.init.values) gives those.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import torch
from torch import nn

from parallel.aux_weight import is_aux_weight
from parallel.seeding import name_seed


def fill_own_kinds(model: nn.Module, seed: int) -> None:
    """Fill, in place, every tensor of each module with parameters of its own kind (`init_parameter`) from a
    generator seeded by its name, as under model.init=name: the values rank 0's own build gives them
    (parallel.models.build.build_model), whatever the module's constructor drew."""
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            if hasattr(module, "init_parameter"):
                for local, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                    fqn = f"{mod_name}.{local}" if mod_name else local
                    module.init_parameter(local, t.data, torch.Generator().manual_seed(name_seed(seed, fqn)))


def _uniform_fan_in(fan_in: int) -> Callable:
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return lambda t, g: t.uniform_(-bound, bound, generator=g)


def _rule(module: nn.Module, local_name: str, root: nn.Module | None = None) -> Callable | None:
    """PyTorch's default initialization of `module.<local_name>`, as (tensor, generator) -> None; else the
    model's or the module's own init method (`_own_method`); None when there is none."""
    if is_aux_weight(module, local_name):  # 0 until an engine sets it (Note [auxiliary weight])
        return lambda t, g: t.zero_()
    if hasattr(module, "init_parameter"):
        return lambda t, g: module.init_parameter(local_name, t, g)
    if root is not None and hasattr(root, "_init_weights"):  # a Hugging Face model: its own rule for every kind
        return _own_method(module, local_name, root)
    if isinstance(module, (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)):
        # kaiming_uniform(a=sqrt(5)) on the weight and the bias bound both reduce to 1/sqrt(fan_in).
        weight = module.weight
        fan_in = weight.shape[1] * math.prod(weight.shape[2:]) if weight.dim() > 1 else weight.shape[0]
        if isinstance(module, nn.modules.conv._ConvTransposeNd):
            fan_in = weight.shape[0] * math.prod(weight.shape[2:])
        return _uniform_fan_in(fan_in)
    if isinstance(module, nn.Embedding):
        return lambda t, g: t.normal_(0.0, 1.0, generator=g)
    norms = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
    if isinstance(module, norms):
        if local_name in ("weight", "running_var"):
            return lambda t, g: t.fill_(1)
        if local_name in ("bias", "running_mean", "num_batches_tracked"):
            return lambda t, g: t.zero_()
    return _own_method(module, local_name, None)


def _own_method(module: nn.Module, local_name: str, root: nn.Module | None) -> Callable | None:
    """The module's tensor as its own init method makes it, run on a CPU copy of the module alone (its
    children left out, so only its own tensors are allocated), under the generator's seed."""
    if root is not None and hasattr(root, "_init_weights"):
        method = root._init_weights  # a Hugging Face PreTrainedModel: one method for every module kind
    elif callable(getattr(module, "reset_parameters", None)):
        method = type(module).reset_parameters
    else:
        return None

    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        alone = copy.copy(module)
        alone._modules = {}
        alone._parameters = {n: None if p is None else nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), p.requires_grad)
                             for n, p in module._parameters.items()}
        alone._buffers = {n: None if b is None else torch.zeros(b.shape, dtype=b.dtype) for n, b in module._buffers.items()}
        # The methods draw from the global generator: seed it from this name, leaving the caller's state as it was.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(int(torch.randint(0, 2**62, (), generator=g)))
            method(alone)
        value = getattr(alone, local_name)
        if value is None or value.shape != t.shape:
            raise ValueError(f"{type(module).__name__}'s own init method left '{local_name}' unset")
        t.copy_(value)

    return fill


def full_init_value(module: nn.Module, local_name: str, fqn: str, shape, dtype, seed: int,
                    root: nn.Module | None = None) -> torch.Tensor:
    """The initial value of one parameter or buffer, computed whole on the CPU (`root`: the whole model,
    whose `_init_weights` a Hugging Face model initializes every module with)."""
    full = torch.empty(shape, dtype=dtype, device="cpu")
    rule = _rule(module, local_name, root)
    if rule is None:
        raise ValueError(
            f"cannot initialize '{fqn}' of {type(module).__name__} by name: no default rule for it and no "
            f"reset_parameters(). Use model.init=module (the model's own initialization), or give "
            f"{type(module).__name__} a method init_parameter(self, name, tensor, generator) "
            "that fills `tensor` in place using `generator`.")
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, fqn))
    with torch.no_grad():
        rule(full, gen)
    return full


def check_initializable(model: nn.Module) -> None:
    """Raise ValueError naming the first parameter or buffer with no rule to initialize it by name."""
    for mod_name, module in model.named_modules():
        for local_name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if _rule(module, local_name, model) is None:
                fqn = f"{mod_name}.{local_name}" if mod_name else local_name
                full_init_value(module, local_name, fqn, (0,), tensor.dtype, 0, model)  # raises with the message
