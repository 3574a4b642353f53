"""Which modules of a model are its blocks: the units a pipeline stage begins at, offload streams, and
recomputation checkpoints (Note [pipeline partitioning] in parallel/strategies/pipeline/partition.py).

# Note [nested blocks]
A model's blocks are its top-level children, with the items of a top-level ModuleList / Sequential /
ModuleDict (torchtitan keeps its layers in one, keyed "0", "1", ...) counted one by one. Hugging Face models keep their repeated blocks one or two levels down (`model.layers.N` in
Llama, `transformer.h.N` in GPT-2, `bert.encoder.layer.N` in BERT, `vit.encoder.layer.N` in ViT), under a
wrapper whose forward also embeds, builds the attention mask, computes rotary embeddings once and normalizes.
A top-level child that holds the repeated blocks is therefore replaced by its own children, recursively,
down to the list of blocks, whose items count one by one: Llama gives `model.embed_tokens`,
`model.rotary_emb`, `model.layers.0`, ..., `model.norm`, `lm_head`. The repeated blocks are a ModuleList /
Sequential / ModuleDict whose items are all of one class: a class the model names in `_no_split_modules` (Hugging Face's
list of modules never to cut through) when it names any, else any class with at least two items. The built-in
models keep their lists at the top, so their blocks are what they were.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_map

from parallel.tensors import meta_forward

LISTS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _no_split_classes(model: nn.Module) -> set[str]:
    """Class names that Hugging Face models (the model or any module in it) declare in `_no_split_modules`."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def _repeated(module: nn.Module, block_classes: set[str]) -> bool:
    """A list of blocks of one class: one of `block_classes` (then one block is enough), or any class, two or more."""
    if not isinstance(module, LISTS) or len(module) < (1 if block_classes else 2):
        return False
    classes = {type(m).__name__ for m in module.children()}
    return len(classes) == 1 and (not block_classes or classes <= block_classes)


def _holds_blocks(module: nn.Module, block_classes: set[str]) -> bool:
    return any(_repeated(m, block_classes) for m in module.modules())


def _expand(name: str, module: nn.Module, block_classes: set[str]) -> list[str]:
    """`name`, or its blocks when `module` is or holds the repeated blocks (Note [nested blocks])."""
    if _repeated(module, block_classes):
        return [f"{name}.{sub}" for sub, _ in module.named_children()]
    if not _holds_blocks(module, block_classes):
        return [name]
    return [n for sub, child in module.named_children() for n in _expand(f"{name}.{sub}", child, block_classes)]


def block_names(model: nn.Module) -> list[str]:
    """Every block of `model` in module order (Note [nested blocks]); forward order is `candidates`'."""
    block_classes = _no_split_classes(model)
    names = []
    for name, child in model.named_children():
        if isinstance(child, LISTS):
            names += [f"{name}.{sub}" for sub, _ in child.named_children()]
        else:
            names += _expand(name, child, block_classes)
    return names


def repeated_blocks(model: nn.Module) -> list[str]:
    """The blocks of `model` that are items of a ModuleList / Sequential (a transformer's layers, an MLP's
    hidden layers), in module order: the model's repeated structure, without its embeddings, norms and head."""
    def in_list(name: str) -> bool:
        parent, _, _ = name.rpartition(".")
        return isinstance(model.get_submodule(parent) if parent else model, LISTS)

    return [name for name in block_names(model) if in_list(name)]


def nested(model: nn.Module, name: str) -> bool:
    """Whether the block `name` sits below the top level (Note [nested blocks]): not a top-level child, nor an
    item of a top-level ModuleList / Sequential. The model's forward calls it from inside another module."""
    parent, _, _ = name.rpartition(".")
    return bool(parent) and ("." in parent or not isinstance(model.get_submodule(parent), LISTS))


def _plain_meta(t):
    """A meta tensor of `t`'s shape, dtype and strides, outside any fake mode (what meta_forward saw was fake)."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def candidates(model: nn.Module, example: tuple, named: dict | None = None) -> tuple[list[str], dict[str, tuple]]:
    """Candidate block names in forward order, and each one's example (args, kwargs) on meta.

    Args:
        model: the unpartitioned model on the meta device.
        example: the positional inputs of one microbatch (meta tensors).
        named: inputs by name besides them (context parallelism's `position_ids`).
    """
    order, inputs, handles = [], {}, []
    for name in block_names(model):
        def hook(mod, args, kwargs, name=name):
            if name not in inputs:
                order.append(name)
                inputs[name] = tree_map(_plain_meta, (args, kwargs))
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        meta_forward(model, *example, **(named or {}))
    finally:
        for h in handles:
            h.remove()
    return order, inputs


# Note [blocks alike]
# Many models are a list of blocks alike between an embedding and a head: one class, the same parameters and
# buffers (names, shapes, dtypes) and the same plain settings but those that number the block (Hugging Face's
# `layer_idx`). What is true of one such block is true of every other: it costs the same FLOPs, saves the same
# activations, and the values crossing the boundary before it are those crossing before the next. Code that
# asks something of every block (the planner: Note [planning by depth] in parallel/planning/depth.py; the
# pipeline's split: Note [a split by blocks alike] in parallel/strategies/pipeline/split.py) asks it of a few
# and extends the answer, on the model with its list cut short (`shortened`).
def alike_blocks(model: nn.Module, deeper_than: int) -> tuple[str, nn.Module] | None:
    """The name and module of `model`'s one list of blocks alike (Note [blocks alike]) when it holds more than
    `deeper_than` blocks, or None."""
    names = repeated_blocks(model)
    parents = {name.rpartition(".")[0] for name in names}
    if len(parents) != 1:
        return None
    parent = parents.pop()
    blocks = model.get_submodule(parent)
    children = list(blocks.children())
    if len(children) <= deeper_than:
        return None
    signatures = [_signature(m) for m in children]
    if len({(kind, tensors) for kind, tensors, _ in signatures}) != 1:
        return None
    settings = [dict(s) for _, _, s in signatures]
    for key in set().union(*settings):
        values = [s.get(key) for s in settings]
        if len(set(values)) > 1 and values != list(range(len(children))):  # one that numbers the blocks may differ
            return None
    return parent, blocks


def _signature(block: nn.Module) -> tuple:
    """What two blocks alike share: class, parameter and buffer shapes, plain settings (Note [blocks alike])."""
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in block.named_parameters()) + \
        tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_buffers())
    settings = tuple(((name, key), value) for name, m in block.named_modules() for key, value in sorted(vars(m).items())
                     if not key.startswith("_") and isinstance(value, (bool, int, float, str)))
    return type(block), tensors, settings


def cut(model: nn.Module, parent: str, depth: int) -> None:
    """`model` with its list of blocks `parent` cut to its first `depth` blocks, in place."""
    owner_name, _, attr = parent.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    blocks = owner.get_submodule(attr)
    items = list(blocks.named_children())[:depth]
    if isinstance(blocks, nn.ModuleDict):
        shorter = nn.ModuleDict(items)
    elif isinstance(blocks, nn.Sequential):
        shorter = nn.Sequential(dict(items))
    else:
        shorter = nn.ModuleList(m for _, m in items)
    assert isinstance(blocks, LISTS)
    setattr(owner, attr, shorter)


@contextlib.contextmanager
def shortened(model: nn.Module, parent: str, depth: int):
    """`model` with its list of blocks `parent` cut to its first `depth` blocks while inside, whole again after."""
    owner_name, _, attr = parent.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    whole = getattr(owner, attr)
    cut(model, parent, depth)
    try:
        yield model
    finally:
        setattr(owner, attr, whole)
