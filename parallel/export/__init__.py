"""Export a run's trained weights for use outside the framework (launch/export.py, `trainer.export=true`).

# Note [export]
    python launch/export.py checkpoint=PATH out=DIR [overwrite=true] [lora=merged|adapter] [max_shard_size=5GB]

PATH is a run directory (its final_model.pt, else its newest complete
checkpoint), a checkpoint directory (`<run>/checkpoints/step-N`, written by
any strategy and world size) or a run's final_model.pt; the run's
`.hydra/config.yaml` says what model it trained, built on the meta device.
- A Hugging Face model (model=hf, or a `_target_` returning a PreTrainedModel)
  becomes a directory `AutoModel*.from_pretrained(DIR)` loads: config.json,
  safetensors shards of at most max_shard_size with their index (transformers'
  names), generation_config.json, and the tokenizer's files of `model.path`.
- Any other model: one `model.safetensors` of the unpartitioned state dict,
  every name final_model.pt has.
Everything is checked before anything is written (the path, `out`, the
options, the checkpoint's names against the model: one line, exit 2). The
files are written into `DIR.partial` and renamed to DIR at the end, so a
failed export leaves no half directory under DIR. Tensors are read and
written one at a time (Note [reading a tensor at a time]); names map as Note
[export names] says, where LoRA's modes hook in.
"""
from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from parallel.checkpoint import newest_complete
from parallel.config import Config, ConfigError, RunError, fail
from parallel.export.files import shards, unsupported, write_weights
from parallel.export.hf import is_hf, write_hf_files
from parallel.export.names import LORA_MODES, exported_tensors, trained_lora
from parallel.export.source import FINAL, Located, WithBase, locate, open_weights, run_config
from parallel.models.build import build_model, meta_model
from parallel.models.lora import adapter_names
from parallel.models.recipe import model_recipe
from parallel.units import human_bytes, parse_bytes

OPTIONS = ("checkpoint", "out", "overwrite", "lora", "max_shard_size")
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's names
PARTIAL = ".partial"
EXPORT_DIR = "export"  # trainer.export=true writes <run_dir>/export


@dataclass
class ExportOptions:
    checkpoint: str
    out: str
    overwrite: bool = False
    lora: str = "merged"
    max_shard_size: int = 5 * 10**9  # bytes per safetensors shard of a Hugging Face model


def parse_options(argv: list[str]) -> ExportOptions:
    """launch/export.py's `key=value` arguments; a ConfigError for an unknown or bad one."""
    given: dict[str, str] = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            raise ConfigError(f"{arg!r}: not an option (key=value; valid keys: {list(OPTIONS)})")
        if key not in OPTIONS:
            fail(key, value, "unknown option", list(OPTIONS))
        given[key] = value
    for key in ("checkpoint", "out"):
        if not given.get(key):
            fail(key, given.get(key), "required: checkpoint=PATH out=DIR")
    options = ExportOptions(given["checkpoint"], given["out"])
    if "overwrite" in given:
        if given["overwrite"].lower() not in ("true", "false"):
            fail("overwrite", given["overwrite"], "must be true or false")
        options.overwrite = given["overwrite"].lower() == "true"
    if "lora" in given:
        if given["lora"] not in LORA_MODES:
            fail("lora", given["lora"], "how LoRA adapters are exported", list(LORA_MODES))
        options.lora = given["lora"]
    if "max_shard_size" in given:
        try:
            options.max_shard_size = parse_bytes(given["max_shard_size"])
            if options.max_shard_size < 1:
                raise ValueError
        except ValueError:
            fail("max_shard_size", given["max_shard_size"], "must be a size > 0", ["5GB", "500MB", "bytes"])
    return options


def export(options: ExportOptions, cfg: Config | None = None) -> str:
    """Export the weights `options.checkpoint` names into `options.out` (Note [export]); returns a line saying
    what was written.

    Args:
        options: what to export, where, and how.
        cfg: the run's config; None: read from the run directory.
    Raises:
        ConfigError: a bad path, `out` or option, or a checkpoint of another model than the run's config;
            nothing is written.
    """
    t0 = time.perf_counter()
    located = locate(options.checkpoint)
    cfg = cfg if cfg is not None else run_config(located.run_dir, options.checkpoint)
    out = _check_out(options, located)
    recipe = model_recipe(cfg.model)
    model = meta_model(recipe)
    hf = is_hf(model)
    lora = trained_lora(cfg.model)
    adapter = lora and options.lora == "adapter"
    names = peft_config = None
    if adapter:
        with torch.device("meta"):
            base = build_model(dataclasses.replace(recipe, adapters=None))
            peft_config, names = adapter_names(base, recipe.adapters)
    reader = open_weights(located)
    if lora:  # a checkpoint holds no frozen weights (Note [LoRA]): they come from where the run took them
        reader = WithBase(reader, model, recipe, cfg.trainer.seed)
    entries = exported_tensors(model, reader.specs, cfg.model, options.lora, hf, options.checkpoint, names)
    bad = unsupported(entries)
    if bad:
        fail("checkpoint", options.checkpoint, f"safetensors cannot hold the dtype of {bad[:3]}")
    max_bytes = options.max_shard_size if hf and not adapter else None  # any other model: one file
    partial = out.with_name(out.name + PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)  # left by an export that stopped
    partial.mkdir(parents=True)
    try:
        if adapter:  # a PEFT directory: PeftModel.from_pretrained(base, DIR)
            written = write_weights(partial, entries, reader.read, None, single=ADAPTER_WEIGHTS)
            peft_config.base_model_name_or_path = cfg.model.path
            peft_config.save_pretrained(str(partial))
            written.append(ADAPTER_CONFIG)
        else:
            written = write_weights(partial, entries, reader.read, max_bytes)
        if hf and not adapter:
            dtype = next((e.spec.dtype for e in entries if e.spec.dtype.is_floating_point), torch.float32)
            written += write_hf_files(model, cfg.model, partial, dtype)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        reader.close()
    if out.exists():  # empty, or overwrite=true
        shutil.rmtree(out)
    partial.rename(out)
    size = sum(e.spec.nbytes for e in entries)
    skipped = "".join(f"; skipped {line}" for line in located.skipped)
    return (f"exported {type(model).__name__} from {located.weights}: {len(entries)} tensors, {human_bytes(size)}, "
            f"in {len(shards(entries, max_bytes))} file(s), to {out} ({', '.join(written)}) in "
            f"{time.perf_counter() - t0:.1f} s{skipped}")


def _check_out(options: ExportOptions, located: Located) -> Path:
    """`out` as a path to write: not a file, empty unless overwrite=true, and never the run being exported."""
    out = Path(options.out).expanduser().resolve()
    if out.is_file():
        fail("out", options.out, "is a file; name a directory")
    if out == located.run_dir or out in located.weights.parents or out == located.weights:
        fail("out", options.out, f"would replace the run being exported ({located.run_dir}); name another directory")
    if out.is_dir() and any(out.iterdir()) and not options.overwrite:
        fail("out", options.out, "exists and is not empty; overwrite=true replaces it")
    return out


def export_finished_run(cfg: Config, run_dir: Path) -> str:
    """`trainer.export=true`: export what the finished run saved last (its final_model.pt with
    trainer.save_final, else its last checkpoint) into <run_dir>/export, replacing an earlier export."""
    source = run_dir / FINAL if cfg.trainer.save_final else newest_complete(run_dir)[0]
    try:
        return export(ExportOptions(str(source), str(run_dir / EXPORT_DIR), overwrite=True), cfg)
    except ConfigError as e:  # the run itself is done and saved: a failed export is not a config error
        raise RunError(f"trainer.export: the run finished and saved its weights in {run_dir}, but their export "
                       f"failed: {e}") from None
