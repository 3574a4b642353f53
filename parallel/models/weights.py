"""The run's initial values (Note [initial values] in parallel/init/values.py): the model's own, built once on
rank 0; pretrained weight files; or names. Also the check that weight files fit the model, before any worker
starts."""
from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist
from torch import nn

from parallel.config import ModelConfig, fail
from parallel.init import InitPlan, init_plan
from parallel.init.files import WeightFileError, WeightFiles, save_weights
from parallel.init.values import ByName, FromFiles, Values
from parallel.memory.host import available_host_memory
from parallel.models.build import build_buffers, build_model
from parallel.models.hf_conversion import converted
from parallel.models.lora import base_name
from parallel.models.recipe import ModelRecipe, pretrained_dir, weights_path
from parallel.units import human_bytes

SHOWN = 8  # names listed per kind of problem; the rest are counted
log = logging.getLogger("parallel")


def weight_files(path: str, model: nn.Module):
    """The weight files at `path` under the names `model` (the meta model, adapters and all) reads them by: as
    they are, or as transformers' loading converts them (Note [checkpoint conversion] in
    parallel/models/hf_conversion.py). Raises WeightFileError."""
    names = {base_name(n) for n, _ in [*model.named_parameters(remove_duplicate=False),
                                       *model.named_buffers(remove_duplicate=False)]}
    return converted(WeightFiles(path), model, names - {None})


def write_own_weights(recipe: ModelRecipe, seed: int, path: Path, whole: bool = True) -> None:
    """Build the model as the user's code does (`build_model` with the seed, on the CPU; not `whole`: with its
    parameters on the meta device, `build_buffers`) and write every real tensor once (a tied one under its first
    name, non-persistent buffers included) to the safetensors file `path`."""
    model = build_model(recipe, seed) if whole else build_buffers(recipe, seed)
    tensors = {fqn: t for fqn, e in init_plan(model).items()
               if fqn == e.canonical and not (t := getattr(e.module, e.local_name)).is_meta}
    save_weights(tensors, str(path))


def _on_rank0(write, path: Path) -> None:
    """`write(path)` on global rank 0 (an error there reaches every rank), then every rank goes on."""
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            write(path)
        except Exception as e:  # noqa: BLE001 - handed to every rank below, then raised on each
            error = f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"building the model's initial weights on rank 0 failed: {error}")


def initial_values(recipe: ModelRecipe, seed: int, run_dir: Path, model: nn.Module, plan: InitPlan) -> Values:
    """This run's `Values` (collective: every rank calls it), the last step of Note [building a model].
    `model` is the meta model `recipe` built, `plan` its names."""
    files = None if recipe.weights is None else weight_files(recipe.weights, model)
    pretrained = None if files is None else \
        FromFiles(files, plan, getattr(model, "base_model_prefix", ""), plain=base_name)
    if recipe.init == "name":
        own: Values = ByName(seed, model)
    else:
        # The whole model where the files leave tensors to its own values (or there are none); else the buffers
        # its constructor computes, which no file holds (non-persistent ones).
        whole = pretrained is None or bool(pretrained.own) or \
            (not recipe.strict and bool(pretrained.problems(plan, {})[0]))
        path = Path(run_dir) / "initial_weights.safetensors"  # removed once every rank has read it (`done`)
        _on_rank0(lambda p: write_own_weights(recipe, seed, p, whole), path)
        own = FromFiles(WeightFiles(str(path)), plan)
    if pretrained is None:
        return own
    pretrained.fallback = own  # what the files lack (non-persistent buffers; with model.strict=false, more)
    return pretrained


def done(run_dir: Path) -> None:
    """Every rank has its values: remove the file rank 0 wrote for them."""
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(run_dir) / "initial_weights.safetensors").unlink(missing_ok=True)


def check_weights(m: ModelConfig, model: nn.Module) -> None:
    """The weight files exist, can be read, and fit `model` (the meta model): names and shapes. With
    model.strict=false, what is missing or ignored is logged."""
    weights = weights_path(m)
    if weights is None:
        return
    key = "model.weights" if m.weights is not None else "model.path"
    try:
        files = weight_files(weights, model)
    except WeightFileError as e:
        fail(key, weights, str(e))
    plan = init_plan(model)
    shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(remove_duplicate=False),
                                              *model.named_buffers(remove_duplicate=False)]}
    missing, unexpected, mismatched = FromFiles(files, plan, getattr(model, "base_model_prefix", ""),
                                                plain=base_name).problems(
        plan, shapes)
    files.close()
    if mismatched:
        fail(key, weights, f"{len(mismatched)} tensors have another shape than the model's: {_listed(mismatched)}")
    if m.strict and (missing or unexpected):
        found = [f"missing {len(missing)}: {_listed(missing)}" if missing else "",
                 f"unexpected {len(unexpected)}: {_listed(unexpected)}" if unexpected else ""]
        fail(key, weights, f"do not fit {type(model).__name__}; " + "; ".join(f for f in found if f),
             "model.strict=false keeps the initial values of missing tensors and ignores unexpected ones")
    _refuse_renamed(key, weights, model, missing, unexpected)
    # model=hf: what the directory lacks is initialised as from_pretrained initialises it (build_model with the seed).
    kept = "from_pretrained's initial values" if pretrained_dir(m) else "initial values kept"
    for what, names in ((f"lack; {kept} for", missing), ("hold, ignored:", unexpected)):
        if names:
            log.warning("the weights %s %s %d tensors (%s)", weights, what, len(names), _listed(names))


def _refuse_renamed(key: str, weights: str, model: nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """The model's own body (not a head, which from_pretrained would initialise too) lacking tensors while the
    files hold tensors nothing reads, after transformers' own conversions (Note [checkpoint conversion] in
    parallel/models/hf_conversion.py): the same weights saved under other names or in a layout nothing here
    converts. Filled with fresh values, a pretrained body would train from random weights with one warning line;
    refused instead, whatever model.strict says."""
    prefix = getattr(model, "base_model_prefix", "")
    body = [n for n in missing if prefix and n.startswith(prefix + ".")]
    if body and unexpected:
        fail(key, weights, f"{len(body)} tensors of {type(model).__name__}'s own body are not in the files "
             f"({_listed(body)}), while {len(unexpected)} of the files' go unread ({_listed(unexpected)}): saved "
             f"under other names or in another layout than the model's (transformers' conversion mapping, "
             f"applied here as from_pretrained applies it, turns none of them into the model's); their pretrained "
             f"values would be replaced by fresh ones",
             ["files that name the tensors as the model does", "model.pretrained=false (fresh values, on purpose)"])


def check_init_memory(m: ModelConfig, model: nn.Module, available: int | None = None) -> None:
    """Under model.init=module without weight files, rank 0 builds the whole model on the CPU at start
    (`write_own_weights`): a config error where its tensors alone exceed the memory this host has available
    (`available`, default MemAvailable), which would end the run at start, killed by the system."""
    if m.init == "name" or weights_path(m) is not None:
        return
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()  # `model` on meta
    need = sum(t.numel() * t.element_size() for t in tensors)
    available = available_host_memory() if available is None else available
    if available is not None and need > available:
        fail("model.init", m.init, f"builds the whole model once in host memory at start, {human_bytes(need)} of "
             f"tensors, and this host has {human_bytes(available)} available",
             "model.init=name: every tensor computed and kept a piece at a time, never the whole model "
             "(docs/models.md#initialization)")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
