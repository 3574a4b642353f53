"""Which tensors an export writes, under which names, made from which of the checkpoint's tensors: the one place
where a run's names become the exported ones (Note [export names]).

# Note [export names]
A checkpoint and final_model.pt hold the unpartitioned model's state dict, a
tied weight under each of its names (Note [checkpoint layout]). An export is a
list of `Entry`s, each an exported name, the checkpoint names it is made from
and its shape and dtype (the file headers are written before any tensor is
read: Note [reading a tensor at a time]).
- Without LoRA every name is written as it is, checked first against the
  model the run's config builds (the same names and shapes, or a one-line
  error). A Hugging Face model leaves out the second names of a tied weight, as
  `save_pretrained` does (from_pretrained ties them again); any other model
  keeps every name of its state dict, as final_model.pt has them.
- LoRA (`model.lora`, `model.peft`; Note [LoRA]): `lora=merged` (the default)
  writes the model without adapters under its own names (`.base_layer` taken
  off, a module to save's trained copy under the module's name, its untrained
  original and the adapters left out), each adapted weight an Entry made from
  the base weight and both adapter matrices, `W + scale * B @ A` as PEFT's
  merge computes it; `lora=adapter` writes only the adapters (and
  `modules_to_save`) under the names PEFT's own save gives them, beside an
  adapter_config.json, for `PeftModel.from_pretrained(base, DIR)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel.config import ConfigError, ModelConfig, fail
from parallel.export.hf import left_out
from parallel.export.source import Spec
from parallel.models.lora import ADAPTER, exported_name, mergeable, merged_delta, wanted

LORA_MODES = ("merged", "adapter")
SHOWN = 3  # names listed per kind of mismatch


@dataclass(frozen=True)
class Entry:
    """One tensor of the export."""

    name: str  # in the exported files
    sources: tuple[str, ...]  # the checkpoint's names (the unpartitioned model's) it is made from
    spec: Spec  # its shape and dtype
    make: Callable[..., torch.Tensor] | None = None  # the sources' tensors -> this one; None: the one source

    def value(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        tensors = [read(s) for s in self.sources]
        return tensors[0] if self.make is None else self.make(*tensors)


trained_lora = wanted  # whether the run trained adapters (model.lora.r > 0, or model.peft)


def exported_tensors(model: nn.Module, saved: dict[str, Spec], m: ModelConfig, lora: str, hf: bool,
                     where: str, adapters: dict[str, str] | None = None) -> list[Entry]:
    """The export's tensors (Note [export names]).

    Args:
        model: the run's model, built on the meta device from its config.
        saved: the checkpoint's model tensors (their unpartitioned names) with shapes and dtypes.
        m: the run's model config (whether it trained LoRA adapters).
        lora: `merged` or `adapter`.
        hf: the model is a Hugging Face PreTrainedModel (tied names left out).
        where: the `checkpoint=` value, for errors.
        adapters: with `lora=adapter`, PEFT's saved name of each adapter tensor -> its name here.
    Raises:
        ConfigError: `lora=adapter` for a run without adapters; a checkpoint of another model.
    """
    if lora not in LORA_MODES:
        fail("lora", lora, "how LoRA adapters are exported", list(LORA_MODES))
    if lora == "adapter" and not trained_lora(m):
        fail("lora", lora, "the run trained no LoRA adapters")
    sources = _sources(model, saved, where)
    dropped = left_out(model) if hf else set()
    if not trained_lora(m):
        return [Entry(name, (source,), saved[source]) for name, source in sources.items() if name not in dropped]
    if lora == "adapter":
        return [Entry(name, (sources[ours],), saved[sources[ours]]) for name, ours in adapters.items()]
    bad = mergeable(model)
    if bad:
        fail("lora", lora, f"merges LoRA adapters of Linear layers into their weights; {bad[:SHOWN]} are "
             "another kind (DoRA, an embedding's, another PEFT method's): export them with lora=adapter")
    entries = []
    for name, source in sources.items():
        out = exported_name(name)
        if out is None or name in dropped:
            continue  # an adapter's own tensor, a module to save's untrained original, a tie's second name
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner and leaf == "weight":
            module = model.get_submodule(owner)
            a, b = (f"{owner}.{which}.{ADAPTER}.weight" for which in ("lora_A", "lora_B"))
            entries.append(Entry(out, (source, sources[a], sources[b]), saved[source],
                                 make=lambda w, a, b, module=module: (w.float() + merged_delta(module, a, b)).to(w.dtype)))
        else:
            entries.append(Entry(out, (source,), saved[source]))
    return entries


def _sources(model: nn.Module, saved: dict[str, Spec], where: str) -> dict[str, str]:
    """Every tensor name of the model's state dict -> the checkpoint name it is read from (itself, or another
    name of the same tied weight); a ConfigError when the checkpoint is not of this model."""
    twins: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        twins.setdefault(id(p), []).append(name)
    names_of = {n: names for names in twins.values() for n in names}
    want = {k: Spec(tuple(v.shape), v.dtype) for k, v in model.state_dict(keep_vars=True).items()
            if torch.is_tensor(v)}
    sources, missing, shapes = {}, [], []
    for name, spec in want.items():
        source = next((n for n in names_of.get(name, [name]) if n in saved), None)
        if source is None:
            missing.append(name)
        elif saved[source].shape != spec.shape:
            shapes.append(f"{name} {saved[source].shape} saved, {spec.shape} in the model")
        else:
            sources[name] = source
    extra = sorted(set(saved) - set(want))
    if missing or extra or shapes:
        parts = [f"{len(missing)} missing (e.g. {missing[:SHOWN]})" if missing else "",
                 f"{len(extra)} not in the model (e.g. {extra[:SHOWN]})" if extra else "",
                 "shapes differ: " + ", ".join(shapes[:SHOWN]) if shapes else ""]
        raise ConfigError(f"checkpoint={where!r}: saved from another model than its run's config builds ("
                          f"{type(model).__name__}): " + "; ".join(p for p in parts if p))
    return sources
