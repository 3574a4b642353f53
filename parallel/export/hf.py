"""The files beside a Hugging Face model's weights, so that `AutoModel*.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load the export: config.json, generation_config.json, the tokenizer's files;
and the names `save_pretrained` leaves out (the second names of a tied weight)."""
from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from parallel.config import ModelConfig

# Files of a model directory that a tokenizer (or a chat template) is read from, copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
GENERATION = "generation_config.json"


def is_hf(model: nn.Module) -> bool:
    """Whether the run's model is a transformers PreTrainedModel (model=hf, or a factory returning one)."""
    transformers = sys.modules.get("transformers")  # imported by whatever built the model, if it is one
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def left_out(model: nn.Module) -> set[str]:
    """The names `save_pretrained` leaves out: the class's `_keys_to_ignore_on_save`, and of each weight held
    under several names (an output head tied to the embedding) all but one; the one kept is the tie's source
    (transformers' `all_tied_weights_keys` maps each tied name to its source), which from_pretrained reads and
    ties the others to."""
    held: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        held.setdefault(id(p), []).append(name)
    targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    names_out = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    for names in held.values():
        if len(names) > 1:
            kept = next((n for n in names if n not in targets), names[0])
            names_out.update(n for n in names if n != kept)
    return names_out


def write_hf_files(model: nn.Module, m: ModelConfig, out: Path, dtype: torch.dtype) -> list[str]:
    """config.json (the run's, its `model.config` overrides included), generation_config.json and the tokenizer
    files of `model.path`, into `out`. Returns the names written.

    The run trained with the key/value cache off (`use_cache=False`); the export says what the model's
    directory says (else the config class's default), which generation wants.
    """
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]  # what from_pretrained's Auto classes build
    config.dtype = str(dtype).removeprefix("torch.")  # as save_pretrained records the weights' dtype
    source = Path(m.path) if m.path else None
    if hasattr(config, "use_cache"):
        config.use_cache = _use_cache(config, source)
    config.save_pretrained(out)
    written = ["config.json"]
    if source is not None and (source / GENERATION).is_file():
        shutil.copyfile(source / GENERATION, out / GENERATION)
        written.append(GENERATION)
    elif getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)
        written.append(GENERATION)
    for name in TOKENIZER_FILES if source is not None else ():
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            written.append(name)
    return written


def _use_cache(config, source: Path | None) -> bool:
    saved = source / "config.json" if source is not None else None
    if saved is not None and saved.is_file():
        value = json.loads(saved.read_text()).get("use_cache")
        if isinstance(value, bool):
            return value
    try:
        return bool(getattr(type(config)(), "use_cache", True))
    except Exception:  # noqa: BLE001 - a config class that cannot be built without arguments (a composite one)
        return True
