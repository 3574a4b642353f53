"""What `checkpoint=PATH` names (a run, a checkpoint, a final_model.pt), the run's config, and the weights read
one tensor at a time (Note [reading a tensor at a time]).

# Note [reading a tensor at a time]
An export never holds the model: it learns every tensor's name, shape and
dtype first (a checkpoint's DCP metadata; final_model.pt's pickle, loaded
memory-mapped, which reads no tensor's bytes), then reads one tensor, writes
it and lets it go before the next. So its memory is a few times the largest
tensor, not the model, and a model larger than the host's memory exports
within it.
- A checkpoint (Note [checkpoint layout]): each tensor is asked of
  torch.distributed.checkpoint alone, `dcp.load({"model.<name>": empty})`
  into a tensor allocated for it, in this process with no process group
  (`no_dist`). DCP reads the pieces every rank wrote (FSDP shards,
  tensor-parallel slices, pipeline stages), whatever the strategy and world
  size, and assembles the whole tensor: the same resharding as a resume.
- final_model.pt: `torch.load(mmap=True)` maps the file; a tensor's pages are
  read when it is written. A mapped page counts in the process's RSS until
  its mapping goes, so the mapping is dropped and made again after every
  window of bytes read (a load of the pickle alone: ~80 us per tensor of the
  file): 1/64 of the file, at least 32 MiB. The pages held stay under the
  window plus one tensor, and the file's pickle is loaded at most ~64 times.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from parallel.checkpoint import META, incomplete, newest_complete
from parallel.config import Config, ConfigError, RunError, error_text, fail
from parallel.init import init_plan
from parallel.init.values import FromFiles
from parallel.models.build import build_model
from parallel.models.lora import base_name
from parallel.models.recipe import ModelRecipe, derive_auto_class
from parallel.models.weights import weight_files

FINAL = "final_model.pt"
RUN_CONFIG = Path(".hydra", "config.yaml")  # written at the start of every run (Note [one run directory])
# Bytes read through one mapping of final_model.pt: the largest of these (Note [reading a tensor at a time]).
WINDOW, MAPPINGS = 32 * 2**20, 64
PREFIX = "model."  # a checkpoint's model tensors (Note [checkpoint layout])


@dataclass(frozen=True)
class Spec:
    """A tensor's shape and dtype, known before its bytes are read."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class Located:
    """What `checkpoint=PATH` names: the run directory (its config) and the weights to read."""

    run_dir: Path
    weights: Path  # final_model.pt, or a checkpoint directory
    skipped: list[str]  # newer checkpoints that were not complete


def locate(value: str) -> Located:
    """A run directory (its final_model.pt, else its newest complete checkpoint), a checkpoint directory
    (`<run>/checkpoints/step-N`, its run two levels up) or a run's final_model.pt.

    Raises:
        ConfigError: `checkpoint=...` names none of these, or its run has no config.
    """
    path = Path(value).expanduser().resolve()
    skipped: list[str] = []
    if path.is_file() and path.name == FINAL:
        run_dir, weights = path.parent, path
    elif (path / META).exists() or path.name.startswith("step-"):
        why = incomplete(path) if path.is_dir() else "no such directory"
        if why is not None:
            fail("checkpoint", value, f"this checkpoint cannot be exported: {why}; name its run directory to take "
                 "the newest complete one")
        run_dir, weights = path.parent.parent, path
    elif path.is_dir() and (path / RUN_CONFIG).is_file():
        run_dir = path
        if (path / FINAL).is_file():
            weights = path / FINAL
        else:
            weights, skipped = newest_complete(path)
            if weights is None:
                fail("checkpoint", value, f"this run holds no {FINAL} and no complete checkpoint (runs write them "
                     "with trainer.save_final=true or trainer.checkpoint_every=N)")
    else:
        what = "no such file or directory" if not path.exists() else "neither a run directory (with " \
            f"{RUN_CONFIG}) nor a checkpoint"
        fail("checkpoint", value, what, ["a run directory", "<run>/checkpoints/step-N", f"<run>/{FINAL}"])
    if not (run_dir / RUN_CONFIG).is_file():
        fail("checkpoint", value, f"its run directory {run_dir} has no {RUN_CONFIG} (the run's config, which says "
             "what model it trained)")
    return Located(run_dir, weights, skipped)


def run_config(run_dir: Path, value: str) -> Config:
    """The run's config as its workers had it: .hydra/config.yaml typed as launch/train.py types it (a
    data=shards or data=custom run reads its data's sizes again, for a model whose sizes follow them)."""
    from parallel.validate import to_config

    try:
        raw = OmegaConf.to_container(OmegaConf.load(run_dir / RUN_CONFIG), resolve=False)
        cfg = to_config(raw)
        derive_auto_class(cfg.model, cfg.data.task)  # as validate resolved it for the run's workers
        return cfg
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - OmegaConf and a user's dataset raise many kinds
        fail("checkpoint", value, f"its run's config {run_dir / RUN_CONFIG} cannot be read: {error_text(e)}")


class TorchFile:
    """final_model.pt, read through a memory mapping made again after every `window` bytes read."""

    def __init__(self, path: Path):
        self.path = path
        self._state: dict | None = None
        self._read = 0
        self.specs = {k: Spec(tuple(v.shape), v.dtype) for k, v in self._map().items()}
        self.window = max(WINDOW, sum(s.nbytes for s in self.specs.values()) // MAPPINGS)

    def _map(self) -> dict:
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - torch.load raises many kinds for a file that is not a state dict
            raise RunError(f"cannot read {self.path}: {error_text(e)}") from None
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise RunError(f"{self.path} is not a state dict of tensors")
        self._state, self._read = state, 0
        return state

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` (backed by the mapping: let it go once written)."""
        if self._state is None or self._read >= self.window:
            self._state = None  # the old mapping goes once the tensors read through it are gone
            self._map()
        t = self._state[name]
        self._read += t.nbytes
        return t

    def close(self) -> None:
        self._state = None


class Checkpoint:
    """A DCP checkpoint's model tensors, each loaded whole on its own (Note [reading a tensor at a time])."""

    def __init__(self, path: Path):
        self.path = path
        try:
            meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001 - an unreadable .metadata
            raise RunError(f"cannot read the checkpoint {path}: {error_text(e)}") from None
        self.specs = {k[len(PREFIX):]: Spec(tuple(m.size), m.properties.dtype) for k, m in meta.items()
                      if k.startswith(PREFIX) and isinstance(m, TensorStorageMetadata)}

    def read(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        t = torch.empty(spec.shape, dtype=spec.dtype)
        try:
            with warnings.catch_warnings():  # no_dist is what this asks for: DCP's warning says so
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({PREFIX + name: t}, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        except Exception as e:  # noqa: BLE001 - DCP wraps a reader's failure in its own exception
            lines = str(e).strip().splitlines()
            raise RunError(f"cannot read {name} from {self.path}: {type(e).__name__}: "
                           f"{lines[-1] if lines else ''}") from None
        return t

    def close(self) -> None:
        pass


def open_weights(located: Located) -> TorchFile | Checkpoint:
    return TorchFile(located.weights) if located.weights.is_file() else Checkpoint(located.weights)



class WithBase:
    """A LoRA run's saved tensors completed by its frozen base weights (Note [LoRA]: a checkpoint holds the
    trainable tensors and the buffers only): each missing one read, a tensor at a time, from where the run
    took it at the start (model.weights or the model=hf directory); what no file holds (a run that built its
    base from the seed) from the run's own build, made once, whole, on the first such read."""

    def __init__(self, inner, model: torch.nn.Module, recipe: ModelRecipe, seed: int):
        self.inner, self.recipe, self.seed = inner, recipe, seed
        self.plan = init_plan(model)
        self.specs = {k: Spec(tuple(v.shape), v.dtype) for k, v in model.state_dict(keep_vars=True).items()}
        self.specs.update(inner.specs)
        self.files = None if recipe.weights is None else FromFiles(
            weight_files(recipe.weights, model), self.plan, getattr(model, "base_model_prefix", ""), plain=base_name)
        self._own: dict | None = None

    def read(self, name: str) -> torch.Tensor:
        if name in self.inner.specs:
            return self.inner.read(name)
        spec = self.specs[name]
        if self.files is not None and name in self.files.keys:
            return self.files.full(name, self.plan[name], spec.shape, spec.dtype)
        if self._own is None:
            self._own = build_model(self.recipe, self.seed).state_dict()
        return self._own[name].to(spec.dtype)

    def close(self) -> None:
        self.inner.close()
        if self.files is not None:
            self.files.files.close()
