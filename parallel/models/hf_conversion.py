"""A Hugging Face checkpoint read under the names transformers' own loading converts it to.

# Note [checkpoint conversion]
transformers 5 builds some models in another layout than their checkpoints hold, and converts the tensors as
`from_pretrained` reads them: a Mixtral directory (as `save_pretrained` still writes it) holds one tensor per
expert, `block_sparse_moe.experts.N.w1/w2/w3.weight`, and the model holds them fused,
`mlp.experts.gate_up_proj` (E, 2I, H: each expert's w1 then its w3) and `mlp.experts.down_proj`; Qwen3-MoE's
`mlp.experts.N.gate_proj/up_proj/down_proj` likewise; older checkpoints' `LayerNorm.gamma` is `weight`. Its
rules live in its conversion mapping (transformers/conversion_mapping.py: per model type, renamings
`WeightRenaming` and converters `WeightConverter` with their operations, `MergeModulelist`, `Concatenate`,
`Chunk`, ...), collected for a model by `get_model_conversion_mapping(model)`, the function PEFT calls too.

`converted` reads a checkpoint through those same objects rather than a table of our own, so that a
checkpoint lands where `from_pretrained` puts it for every architecture transformers converts, today's and
the next release's: each file key is renamed as transformers renames it (`rename_source_key`: the renamings,
then at most one converter, the base model's prefix added or dropped as the model needs), the keys one
converter gathers for one target are collected in transformers' order (`dot_natural_key`: expert 10 after
expert 9), and the converter's own `convert` builds the target. The result has WeightFiles' interface
(names, shapes, pieces on demand), so everything that reads weight files (FromFiles, the checks before
workers start, the export of a LoRA run's base) reads a converted checkpoint unchanged.

Shapes come from running each converter on meta tensors (no bytes read). A converted tensor is built whole,
from its sources read whole, when a rank first reads a piece of it (a rank holding a shard of one layer's
fused experts reads that layer's experts once); the last one built is kept, so the targets one converter
makes together (q, k and v from a fused qkv) read their sources once. Keys nothing converts keep being read a
piece at a time. A key transformers would convert to a name the model lacks, or that its converter cannot
convert (a group with some of its sources missing), keeps its own name, and is reported as unread like any
other (parallel.models.weights.check_weights).

With a transformers release that has no conversion mapping (4.x, whose models hold the layout their
checkpoints have), or a model that is not a transformers model, or a checkpoint nothing in the mapping
matches, the files are read as they are.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from parallel.init.files import WeightFiles


def _transformers_conversion():
    """transformers' conversion functions, or None for a release without them."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:
        return None
    return get_model_conversion_mapping, WeightConverter, WeightRenaming, dot_natural_key, rename_source_key


class _Group:
    """The file keys one converter turns into one or more of the model's tensors."""

    def __init__(self, converter, first: str):
        self.converter, self.first = converter, first
        self.sources: list[tuple[str, str, str]] = []  # (renamed key, file key, the converter's source pattern)

    def run(self, model: nn.Module, read) -> dict[str, torch.Tensor]:
        """The converter's targets, each source given by `read(file key)`."""
        converter = copy.deepcopy(self.converter)  # convert consumes what was collected
        for renamed, key, pattern in self.sources:
            converter.add_tensor(renamed, key, pattern, lambda k=key: read(k))
        out = converter.convert(self.first, model=model, config=getattr(model, "config", None))
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


class ConvertedFiles:
    """WeightFiles' interface (`path`, `shapes`, `read`, `close`) over `files` under the model's names
    (Note [checkpoint conversion])."""

    def __init__(self, files: WeightFiles, model: nn.Module, renamed: dict[str, str], groups: dict[str, _Group]):
        self.files, self.path, self.model = files, files.path, model
        self.renamed = renamed  # model's name -> file key, for tensors only renamed (or kept)
        self.group_of: dict[str, _Group] = {}
        self.shapes: dict[str, tuple[int, ...]] = {n: files.shapes[k] for n, k in renamed.items()}
        for group in groups.values():
            try:
                meta = group.run(model, lambda k: torch.empty(files.shapes[k], device="meta"))
            except Exception:  # noqa: BLE001 - sources that do not convert (some missing): unread, as they are
                self.renamed.update({key: key for _, key, _ in group.sources})
                self.shapes.update({key: files.shapes[key] for _, key, _ in group.sources})
                continue
            for name, t in meta.items():
                self.group_of[name], self.shapes[name] = group, tuple(t.shape)
        self._built: tuple[_Group | None, dict] = (None, {})

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name` (the model's name), or its piece `index`."""
        if name in self.renamed:
            return self.files.read(self.renamed[name], index)
        group = self.group_of[name]
        if self._built[0] is not group:
            self._built = (None, {})  # the previous one freed before the next is built
            self._built = (group, group.run(self.model, self.files.read))
        full = self._built[1][name]
        return (full if index is None else full[index]).contiguous()

    def close(self) -> None:
        self._built = (None, {})
        self.files.close()


def converted(files: WeightFiles, model: nn.Module, names: set[str]) -> WeightFiles | ConvertedFiles:
    """`files` read as transformers' loading converts them for `model` (Note [checkpoint conversion]); `names`
    the model's own tensor names (without adapters). `files` themselves when nothing converts."""
    found = _transformers_conversion()
    modeling = getattr(model, "config", None) is not None and hasattr(model, "base_model_prefix")
    if found is None or not modeling:
        return files
    get_mapping, WeightConverter, WeightRenaming, natural, rename = found
    mapping = get_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    wanted = dict.fromkeys(names, True)  # transformers asks `.get(name) is not None` of the model's state dict
    prefix = model.base_model_prefix
    renamed, groups, changed = {}, {}, False
    for key in sorted(files.shapes, key=natural):
        target, pattern = rename(key, renamings, converters, prefix, wanted)
        if target not in wanted and key in wanted:  # as transformers: a key the model has is not renamed
            target, pattern = rename(key, [], [], prefix, wanted)
        if target not in wanted:
            renamed[key] = key  # nothing of the model: unread under its own name
            continue
        changed |= target not in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}."))  # beyond the prefix
        if pattern is None:
            renamed[target] = key
            continue
        changed = True
        groups.setdefault(target, _Group(by_pattern[pattern], target)).sources.append((target, key, pattern))
    return ConvertedFiles(files, model, renamed, groups) if changed else files
