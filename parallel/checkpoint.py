"""Checkpoints that load under any strategy and world size, written so that a crash never leaves a bad one.

# Note [checkpoint layout]
    <run_dir>/checkpoints/step-000040/
        .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP): tensors by unpartitioned name
        rng-<rank>.pt                  each rank's random number generator states
        data.pt                        the data source's state, when it keeps one (an iterable dataset's)
        trainer.json                   step, LR schedule, what it was saved under, every file's size

The tensors are keyed by the names of the unpartitioned model, whatever holds
them: `model.<name>` for every parameter and buffer (with LoRA adapters, every
trainable one and every buffer: Note [LoRA]), `optim.<name>.<key>` for
the optimizer's state under the optimizer's own keys (AdamW: exp_avg,
exp_avg_sq, step; SGD with momentum: momentum_buffer; any class: what its step
makes, `parallel.optim.param_state`), a weight tied to another (an output head
tied to the embedding) under its first name. A checkpoint resumes under the
same optimizer class and arguments (the resume check compares the keys). A rank saves its own pieces (an
FSDP shard, a tensor-parallel slice, a pipeline stage's weights, ZeRO-1's share
of the optimizer state) as DTensors or plain tensors, and DCP records which
part of each tensor each file holds; loading asks for the pieces this rank holds
now, under another strategy or world size, and DCP reads the overlapping parts
(resharding). Replicated tensors are written once.

The data position is the step: the data sources are functions of (seed,
step), so a run resumed at step k reads the batches of steps k+1.. on any
world size (Note [shard order], Note [custom data]). A stream (an iterable
dataset) also has a state: the source's `state_dict()` (the same on every rank;
a split stream's gathers every shard's from the ranks that read them), saved
once by rank 0 as data.pt and handed to its `load_state_dict` on resume.

# Note [atomic checkpoint]
A checkpoint is written into `step-N.partial/`; after every rank has written
its part, rank 0 writes `trainer.json` (listing each file and its size) and
renames the directory to `step-N`. A directory without the suffix whose files
all have their listed sizes is complete; anything else (a crash mid-write, a
truncated copy, a disk that filled) is skipped for the newest complete one
before it, with a warning. The newest `trainer.keep_checkpoints` are kept.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from parallel.config import Config, ConfigError, RunError
from parallel.lr_schedule import group_settings, restore_scheduler
from parallel.metrics import log
from parallel.models.build import build_meta_model
from parallel.models.lora import checkpointed
from parallel.optim import state_shapes
from parallel.profiling import run_phase
from parallel.seeding import rng_state, set_rng_state

SUFFIX = ".partial"
META = "trainer.json"
DATA = "data.pt"


@contextlib.contextmanager
def _interrupts_pass():
    """A Ctrl-C while DCP writes or reads stays a KeyboardInterrupt. DCP catches whatever a rank raises inside
    save / load, KeyboardInterrupt included, and raises the ranks' failures together as a CheckpointException,
    which is a BaseException: the workers' Ctrl-C handling would not see it, and it would end them with a
    traceback instead of the one line an interrupt gets (the checkpoint stays unfinished either way: Note
    [atomic checkpoint])."""
    try:
        yield
    except CheckpointException as e:
        if any(isinstance(failure[0], KeyboardInterrupt) for failure in e.failures.values()):
            raise KeyboardInterrupt from e
        raise


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def checkpoints_of(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


# ---- what is saved --------------------------------------------------------------------------------------------

def training_state(run) -> tuple[dict, list[tuple[dict, dict]]]:
    """This rank's tensors under their unpartitioned names (Note [checkpoint layout]), as the engine gives
    them (Note [engine contract]). Returns (state dict for DCP, copies of tied weights' state to make equal
    after a load)."""
    model, optim, copies = run.engine.checkpoint_state(run.optimizer, run.canonical())
    keep = checkpointed(run.cfg.model, {n: getattr(e.module, e.local_name) for n, e in run.plan.items()})
    if keep is not None:  # with adapters: the frozen base weights come back from where they came from
        model = {k: v for k, v in model.items() if k in keep}
    return {"model": model, "optim": optim}, copies


def expected_keys(cfg: Config) -> tuple[dict[str, tuple], bool]:
    """Every key a checkpoint of this model holds, with its shape (built on the meta device), and whether the
    optimizer's keys are among them (False: a user optimizer that cannot step on the meta device)."""
    model = build_meta_model(cfg.model)
    keep = checkpointed(cfg.model, dict(model.named_parameters(remove_duplicate=False))
                        | dict(model.named_buffers(remove_duplicate=False)))
    keys = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items() if keep is None or k in keep}
    shapes = state_shapes(cfg, model)  # the first name of a tied weight, as `training_state` keys it
    for name, state in (shapes or {}).items():
        keys.update({f"optim.{name}.{k}": shape for k, shape in state.items()})
    return keys, shapes is not None


# ---- finding a complete one -----------------------------------------------------------------------------------

def incomplete(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None when it is complete (Note [atomic checkpoint])."""
    if path.name.endswith(SUFFIX):
        return "unfinished (its writer stopped before the end)"
    try:
        meta = json.loads((path / META).read_text())
        files = meta["files"]
    except FileNotFoundError:
        return f"no {META} (unfinished)"
    except (ValueError, KeyError) as e:
        return f"{META} unreadable ({e})"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} holds {f.stat().st_size} bytes of the {size} written (truncated)"
    return None


def newest_complete(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint of a run directory, and a line for each newer one skipped."""
    root = checkpoints_of(run_dir)
    found = sorted((p for p in root.glob("step-*") if p.is_dir()), key=_step_of, reverse=True) \
        if root.is_dir() else []
    skipped = []
    for path in found:
        why = incomplete(path)
        if why is None:
            return path, skipped
        skipped.append(f"{path}: {why}")
    return None, skipped


def _step_of(path: Path) -> int:
    digits = path.name.removeprefix("step-").removesuffix(SUFFIX)
    return int(digits) if digits.isdigit() else -1


def find(value: str | os.PathLike, run_dir: Path | None = None) -> tuple[Path | None, list[str]]:
    """The checkpoint `trainer.resume` names: a checkpoint directory, a run directory (its newest
    complete one) or `auto` (that of `run_dir`). Returns (path or None, lines for skipped ones).

    Raises:
        ConfigError: a path that is neither, or a named checkpoint that is not complete.
    """
    if value == "auto":
        return newest_complete(run_dir)
    path = Path(value).expanduser()
    key = f"trainer.resume={str(value)!r}"
    if (path / META).exists() or path.name.startswith("step-"):
        why = incomplete(path) if path.is_dir() else "no such directory"
        if why is not None:
            raise ConfigError(f"{key}: this checkpoint cannot be loaded: {why}; name its run directory to "
                              "take the newest complete one")
        return path, []
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise ConfigError(f"{key}: {what} (valid: a run directory, one of its checkpoints/step-N, or auto)")
    found, skipped = newest_complete(path)
    if found is None:
        detail = "; ".join(skipped) if skipped else f"{checkpoints_of(path)} holds none"
        raise ConfigError(f"{key}: no complete checkpoint ({detail}); runs save them with "
                          "trainer.checkpoint_every=N")
    return found, skipped


def check_resume(cfg: Config) -> None:
    """Before any worker starts: an explicit `trainer.resume` names a complete checkpoint of this model,
    taken before the last step. Raises ConfigError naming the key."""
    value = cfg.trainer.resume
    if value is None or value == "auto":
        return
    path, _ = find(value)
    key = f"trainer.resume={str(value)!r}"
    meta = json.loads((path / META).read_text())
    if meta["step"] >= cfg.trainer.steps:
        raise ConfigError(f"{key}: {path.name} was taken at step {meta['step']}, and trainer.steps="
                          f"{cfg.trainer.steps}: nothing left to train (raise trainer.steps)")
    saved = {k: tuple(getattr(v, "size", ())) for k, v in
             dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()}
    want, with_optim = expected_keys(cfg)
    if not with_optim:
        saved = {k: v for k, v in saved.items() if not k.startswith("optim.")}
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    shapes = sorted(k for k in set(want) & set(saved) if want[k] != saved[k])
    if missing or extra or shapes:
        parts = [f"{len(missing)} missing (e.g. {missing[:3]})" if missing else "",
                 f"{len(extra)} not in this model (e.g. {extra[:3]})" if extra else "",
                 "shapes differ: " + ", ".join(f"{k} {saved[k]} saved, {want[k]} here" for k in shapes[:3])
                 if shapes else ""]
        if all(k.startswith("optim.") for k in missing + extra + shapes):
            what = f"with another optimizer state than optim._target_={cfg.optim._target_ or 'torch.optim.AdamW'}" \
                   f" and optim.args={dict(cfg.optim.args)} keep"
        else:
            what = f"from another model than model={cfg.model.name}"
        raise ConfigError(f"{key}: saved {what}: " + "; ".join(p for p in parts if p))


# ---- saving ---------------------------------------------------------------------------------------------------

class Checkpointer:
    """Saves every `trainer.checkpoint_every` steps and at the last step (Note [atomic checkpoint])."""

    def __init__(self, cfg: Config, run_dir: Path):
        t = cfg.trainer
        self.cfg, self.every, self.keep, self.last = cfg, t.checkpoint_every, t.keep_checkpoints, t.steps
        self.root = checkpoints_of(run_dir)

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.last)

    def save(self, run, step: int) -> Path:
        """Write the checkpoint of `step` (a collective: every rank calls it); its directory."""
        with run_phase("checkpoint_save", step):  # in a profile and an out-of-memory line (Note [profiles])
            return self._save(run, step)

    def _save(self, run, step: int) -> Path:
        rank = dist.get_rank()
        final = step_dir(self.root, step)
        partial = final.with_name(final.name + SUFFIX)
        t0 = time.perf_counter()
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"*{SUFFIX}"):  # left by a run that stopped while writing
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        state, _ = training_state(run)
        with _interrupts_pass():
            dcp.save(state, checkpoint_id=str(partial))
        torch.save(rng_state(), partial / f"rng-{rank}.pt")
        data_state = run.data.state_dict() if hasattr(run.data, "state_dict") else None
        if rank == 0 and data_state is not None:
            torch.save(data_state, partial / DATA)
        dist.barrier()  # every rank's files are whole
        if rank == 0:
            self._seal(run, step, partial, final)
        dist.barrier()  # no rank goes on (or stops) before the checkpoint is complete
        log.info("checkpoint at step %d: %s (%.2f s)", step, final, time.perf_counter() - t0)
        return final

    def _seal(self, run, step: int, partial: Path, final: Path) -> None:
        files = {str(p.relative_to(partial)): p.stat().st_size for p in sorted(partial.rglob("*")) if p.is_file()}
        s = self.cfg.strategy
        meta = {"step": step, "world_size": dist.get_world_size(),
                "strategy": {"name": s.name, "dp": s.dp, "pp": s.pp, "tp": s.tp, "zero": s.zero},
                "scheduler": run.scheduler.state_dict(), "param_groups": group_settings(run.optimizer),
                "files": files,
                "bytes": sum(files.values()), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        _write_durably(partial / META, json.dumps(meta, indent=1))
        if final.exists():  # taken before by a run that resumed from an earlier one
            shutil.rmtree(final)
        os.replace(partial, final)
        _sync_dir(self.root)
        complete = sorted((p for p in self.root.glob("step-*") if p.is_dir() and not p.name.endswith(SUFFIX)),
                          key=_step_of)
        for old in complete[:-self.keep]:
            doomed = old.with_name(old.name + SUFFIX)  # never seen as complete while half removed
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- resuming -------------------------------------------------------------------------------------------------

def resume_target(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint this run continues from, the same on every rank; None: start at step 0.

    `trainer.resume` names it. Workers restarted by torchrun (`--max-restarts`)
    resume from their run directory's newest complete one, and from what
    `trainer.resume` names only while the run has saved none of its own.
    """
    value = cfg.trainer.resume
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if value is None and restart == 0:
        return None
    box: list = [None, None]  # (path, error), rank 0's answer for every rank
    if dist.get_rank() == 0:
        try:
            path, skipped = find("auto", run_dir) if restart or value == "auto" else (None, [])
            if path is None and value not in (None, "auto"):
                path, more = find(value, run_dir)
                skipped += more
        except ConfigError as e:  # the named checkpoint has gone since the check before the start
            path, skipped, box[1] = None, [], str(e)
        for line in skipped:
            log.warning("checkpoint skipped: %s", line)
        if path is None and box[1] is None and checkpoints_of(run_dir).is_dir():  # a new run says nothing
            log.info("no complete checkpoint in %s: starting at step 0", checkpoints_of(run_dir))
        box[0] = None if path is None else str(path)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise RunError(box[1])
    if restart:
        log.info("restart %d of the workers (torchrun --max-restarts)", restart)
    return None if box[0] is None else Path(box[0])


def load(run, path: Path) -> int:
    """Fill the run's model, optimizer, schedule and RNG from the checkpoint at `path`; return its step."""
    meta = json.loads((path / META).read_text())
    t0 = time.perf_counter()
    state, copies = training_state(run)
    try:
        with _interrupts_pass():
            dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # DCP raises one CheckpointException holding every rank's error
        first = str(e).strip().splitlines()
        raise RunError(f"trainer.resume: cannot load {path}: {type(e).__name__}: "
                          f"{first[-1] if first else ''}") from None
    with torch.no_grad():
        for dst, src in copies:
            for key, value in src.items():
                dst[key].copy_(value)
    run.engine.load_checkpoint_state(state["model"], state["optim"])
    restore_scheduler(run.scheduler, run.optimizer, meta["scheduler"], meta.get("param_groups"))
    if (path / DATA).is_file() and hasattr(run.data, "load_state_dict"):
        run.data.load_state_dict(torch.load(path / DATA, weights_only=False))
    _restore_rng(run, path, meta)
    saved = meta["strategy"]
    log.info("resumed from %s (step %d; saved under strategy=%s on %d ranks) in %.2f s", path, meta["step"],
             saved["name"], meta["world_size"], time.perf_counter() - t0)
    return int(meta["step"])


def _restore_rng(run, path: Path, meta: dict) -> None:
    """Each rank's generator states, when every rank draws from the stream it saved (Note [random numbers]):
    the same world size and degrees. Otherwise each stream starts again from its seed."""
    rank, world, s = dist.get_rank(), dist.get_world_size(), run.cfg.strategy
    saved = meta["strategy"]
    rng = path / f"rng-{rank}.pt"
    if meta["world_size"] == world and all(saved.get(k) == getattr(s, k) for k in ("dp", "pp", "tp")) \
            and rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    elif rank == 0:
        log.warning("random number generators: saved on %d ranks as dp %s x pp %s x tp %s, this run has dp %s x "
                    "pp %s x tp %s; each rank's stream starts again from its seed, so random ops (dropout) draw "
                    "other numbers than the saved run would have (Note [random numbers])", meta["world_size"],
                    saved.get("dp"), saved.get("pp"), saved.get("tp"), s.dp, s.pp, s.tp)
