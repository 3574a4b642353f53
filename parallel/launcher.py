"""Start the workers of a run, or be one of them.

Four ways in, one body (`_work`):
  * plain `python launch/train.py` with nproc=1: this process is the only worker;
  * plain `python launch/train.py nproc=N` (also each job of a Hydra sweep): this
    process starts N workers through PyTorch's elastic launch API and waits;
  * under `torchrun`: this process is one worker among WORLD_SIZE;
  * a task of a job that Hydra's submitit launcher started with several tasks
    (hydra/launcher=slurm): each task is one worker (`join_submitit_job`).

# Note [one run directory]
All ranks of a run must write into the same directory: `run_dir` when given,
else Hydra's output directory (`hydra.run.dir`, by default dated). Where one
process starts the workers, it fixes the directory before they start and hands
it to each of them. Under torchrun every worker composes the config itself, and
a default with `${now:}` may name another second in each; so rank 0's choice is
broadcast, a worker whose Hydra made another (empty) directory removes it, and
Hydra writes no .hydra/ of its own in each worker (train.py; rank 0 writes it).
When torchrun restarts the workers (--max-restarts) they find the directory of
its first start again through a note named by torchrun's run id.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from parallel import preemption
from parallel.config import ConfigError, from_dict
from parallel.data import DataSpec
from parallel.dims import device_for_rank
from parallel.export import export_finished_run
from parallel.hardware import worker_threads
from parallel.memory.host import steady_host_allocations
from parallel.memory.oom import OUT_OF_MEMORY, OutOfMemory
from parallel.metrics import log, setup_logging
from parallel.nonfinite import NON_FINITE, AgreedStop
from parallel.trainer import run_training


def under_torchrun() -> bool:
    """True inside a worker started by torchrun (or any torchelastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def in_submitit_job() -> bool:
    """True in a task of a job with several tasks, started by Hydra's submitit launcher."""
    if os.environ.get("SUBMITIT_EXECUTOR") not in ("slurm", "local"):
        return False
    from submitit import JobEnvironment  # an optional dependency (the slurm extra)

    return JobEnvironment().num_tasks > 1


def join_submitit_job() -> None:
    """Set torch.distributed's variables from the job's: rank = task, world = all tasks,
    the rendezvous on the job's first node."""
    from submitit.helpers import TorchDistributedEnvironment  # an optional dependency (the slurm extra)

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def launch(cfg_dict: dict, run_dir: str, nproc: int, data: dict | None = None) -> None:
    """Run `nproc` workers on this machine and wait; a failed worker ends the run.

    Args:
        cfg_dict: the resolved, validated config as a plain dict (it crosses process boundaries).
        run_dir: the run directory, fixed before the workers start.
        nproc: how many workers.
        data: what validation read from the data, beside the config (a DataSpec's `to_dict`, Note [data spec]
            in parallel/data/spec.py); None: nothing read.
    Raises:
        WorkerFailed: naming the first failed rank and its error.
        Reported: workers ran out of GPU memory and said so, one line each (Note [out of memory]).
        OutOfMemory: the single worker (nproc=1) ran out of GPU memory: its one line.
        Interrupted: Ctrl-C or a signal stopped the workers.
        Preempted: a preemption signal stopped every worker after a checkpoint (Note [preemption]).
    """
    try:
        if nproc == 1:
            _work(cfg_dict, run_dir, single_process=True, data=data)
        else:
            _start_workers(cfg_dict, run_dir, nproc, data)
    except (KeyboardInterrupt, SignalException) as e:  # every worker has stopped
        name = getattr(getattr(e, "sigval", None), "name", "SIGINT")
        raise Interrupted(f"interrupted ({name}): every worker stopped; checkpoints complete so far are in "
                          f"{run_dir}") from None


def _start_workers(cfg_dict: dict, run_dir: str, nproc: int, data: dict | None) -> None:
    """`nproc` worker processes through PyTorch's elastic launch API (torchrun's own), waited for.

    Without a GPU the workers are forked from this process, which has torch and the framework imported: a
    spawned worker imports them again (~4 s each, on the same cores as its peers) and ends with an
    interpreter shutdown (~2 s), against ~1 s of training in a short run. With a GPU they are spawned:
    CUDA, and autograd's per-device threads, cannot be used in a process forked from one that started them.
    """
    fork = not torch.accelerator.is_available()
    agent_log = logging.getLogger("torch.distributed.elastic")
    level = agent_log.level
    # It says "Terminating process N via signal SIGTERM" of the workers still ending when one has ended (a
    # failure, or all stopping after a preemption): the report below says what happened.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    entrypoint = _forked_worker(agent_log, level) if fork else worker
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        # As torchrun --standalone does: a private rendezvous on a free local port.
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=str(uuid.uuid4()),
        max_restarts=0, monitor_interval=0.1, start_method="fork" if fork else "spawn",
        # Preemption signals are not the agent's (it would stop the workers at once): they are forwarded.
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
    )
    # The agent logs each failed worker's traceback line by line; WorkerFailed
    # carries it instead, so the user sees it once.
    agent_log.setLevel(logging.CRITICAL)
    try:
        with preemption.forwarding() as forwarded:
            elastic_launch(config, entrypoint=entrypoint)(cfg_dict, run_dir, None, data)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        if preemption.all_preempted(codes):
            raise preemption.preempted_run(forwarded, run_dir) from None
        if signame := preemption.stopped_at_once(codes):
            raise Interrupted(f"interrupted ({signame}): every worker stopped; checkpoints complete so far are "
                              f"in {run_dir}") from None
        rank, failure = e.get_first_failure()
        if OUT_OF_MEMORY in codes and not _failure_traceback(failure):
            raise Reported("a worker ran out of GPU memory") from None  # its line is out (Note [out of memory])
        if NON_FINITE in codes and not _failure_traceback(failure):
            raise Reported("a step was not finite") from None  # its line is out (Note [non-finite steps])
        raise WorkerFailed(rank, _failure_message(failure), _failure_traceback(failure)) from None
    finally:
        agent_log.setLevel(level)


def _forked_worker(agent_log: logging.Logger, level: int):
    """The entry point of a forked worker: it starts as a spawned one would, without the signal handlers the
    agent installs before it forks (they turn SIGTERM into an exception) and the logging set up here."""
    signals = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT) + preemption.signals()
    before = {s: signal.getsignal(s) for s in signals}
    handlers = list(logging.root.handlers)  # Hydra's, on this process's console
    sys.stdout.flush()  # what is buffered would be written again by every worker
    sys.stderr.flush()

    def entrypoint(*args):
        for s, handler in before.items():
            signal.signal(s, handler)
        for h in handlers:
            logging.root.removeHandler(h)
        logging.root.setLevel(logging.WARNING)
        agent_log.setLevel(level)
        try:
            worker(*args)
        except SystemExit as e:
            if e.code == 1:  # worker(): stopped because another worker failed
                # That worker may still be recording its error. The agent reports the first worker to end,
                # so this one waits to be stopped (a spawned worker's slow interpreter shutdown used to give
                # the other the lead); the agent stops it once the other has ended.
                for s in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(s, signal.SIG_DFL)
                time.sleep(5)
            raise

    return entrypoint


class Interrupted(Exception):
    """Ctrl-C or a signal stopped the run's workers; the message says where its checkpoints are."""


class Reported(Exception):
    """The failed workers have said why, one line each (Note [out of memory]), or rank 0 has for all of them (a
    non-finite step, Note [non-finite steps]): the run ends with exit status 1 and nothing more."""


class WorkerFailed(RuntimeError):
    """A worker raised or died; names its rank, its error and (when known) its traceback."""

    def __init__(self, rank: int, message: str, traceback: str = ""):
        super().__init__(f"worker rank {rank} failed: {message}")
        self.rank, self.traceback = rank, traceback


def _failure_traceback(failure) -> str:
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message", {})
    return message.get("extraInfo", {}).get("py_callstack", "") if isinstance(message, dict) else ""


def _failure_message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):  # the error file's record
        message = message.get("message", message)
    if not message or message == "<N/A>" or (isinstance(message, str) and message.startswith("To enable traceback")):
        message = f"exit code {failure.exitcode}"
    return str(message)


@record
def worker(cfg_dict: dict, run_dir: str | None, proposed: str | None = None, data: dict | None = None) -> None:
    """The entry point of one worker process (spawned by `launch`, or run by torchrun).

    Args:
        run_dir: the run directory, fixed before the workers started; None: the workers agree on one, rank 0's
            `proposed` directory (Note [one run directory]).
        data: what validation read from the data, as `launch` takes it.
    """
    signal.signal(signal.SIGINT, _interrupted)
    try:
        _work(cfg_dict, run_dir, single_process=False, proposed=proposed, data=data)
    except preemption.Preempted:  # rank 0 said so in the log (and requeued the job when asked)
        sys.exit(preemption.PREEMPTED)
    except KeyboardInterrupt:
        # Ctrl-C reaches every worker; the launcher says so once. A checkpoint being
        # written stays unfinished, and is skipped (Note [atomic checkpoint]).
        sys.exit(130)
    except Reported:  # the line is out (a non-finite step: Note [non-finite steps])
        sys.exit(NON_FINITE)
    except OutOfMemory as e:  # each rank that ran out says so, in one line and no traceback (Note [out of memory])
        print(f"error: {e}", file=sys.stderr)
        sys.exit(OUT_OF_MEMORY)
    except Exception as e:
        if not lost_peer(e):
            raise  # recorded (@record) for the launcher's report of the first failure
        # A consequence of another worker's failure: one line here, and no error file
        # (an exit status is not recorded), so the report shows the cause alone.
        print(f"rank {os.environ.get('RANK', '?')}: stopped: another worker failed ({type(e).__name__}: "
              f"{_first_line(e)[:160]})", file=sys.stderr)
        sys.exit(1)


def _interrupted(signum, frame) -> None:
    """Ctrl-C reaches a worker twice (from the terminal, then forwarded by the launcher): the first stops it,
    the second would interrupt its exit midway (atexit handlers), so it is ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


# What a collective raises on a rank whose peer has died: a consequence, not the cause.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "communicator was aborted",
              "NCCL communicator", "Socket closed")


def lost_peer(e: BaseException) -> bool:
    return any(m in str(e) for m in _PEER_LOST)


def report_worker_error(e: Exception) -> int:
    """Print a torchrun worker's error once and return its exit status.

    torchrun shows the traceback of the first failure in its summary (the
    worker's @record error file), so the worker prints one line; without an
    error file it prints the traceback too.
    """
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        traceback.print_exception(e)
    print(f"error: worker rank {os.environ.get('RANK', '?')} failed: {type(e).__name__}: {_first_line(e)}",
          file=sys.stderr)
    return 1


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _work(cfg_dict: dict, run_dir: str | None, single_process: bool, proposed: str | None = None,
          data: dict | None = None) -> None:
    """One worker: device, process group, the run directory agreed on, then the trainer's run; then, on rank 0,
    the export (trainer.export)."""
    cfg = from_dict(cfg_dict)  # resolved and validated before the workers started
    spec = None if data is None else DataSpec.from_dict(data)  # read from the data then (Note [data spec])
    gc.freeze()  # Note [the collector in a worker]
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = device_for_rank(cfg.trainer.device, local_rank)
    # Note [host allocations]: before anything of the run is allocated
    steady_host_allocations(keep_large=device.type == "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if cfg.memory.fraction is not None:
            torch.cuda.set_per_process_memory_fraction(cfg.memory.fraction, device)
    if device.type == "cpu" and (threads := worker_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))):
        torch.set_num_threads(threads)  # the cores shared out among this machine's workers
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.trainer.init_timeout_s)  # until the first step has ended: Note [two timeouts]
    if single_process:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    global _worked
    _worked = True
    try:
        with preemption.watching(cfg.trainer.preempt_timeout_s, cfg.trainer.preempt_check_s):
            run_dir = Path(_agree_on_run_dir(run_dir, cfg_dict, proposed))
            setup_logging(run_dir, dist.get_rank())
            log.info("run dir %s | strategy %s | world %d | device %s", run_dir, cfg.strategy.name,
                     dist.get_world_size(), device)
            if cfg.memory.fraction is not None and device.type != "cuda":
                log.warning("memory.fraction=%s has no effect on the CPU", cfg.memory.fraction)
            _warn_shared_store()
            run_training(cfg, run_dir, device, spec)
    except AgreedStop as e:  # a non-finite step (Note [non-finite steps]), ...: one line, before any rank ends
        if e.says:
            print(f"error: {e}", file=sys.stderr, flush=True)
        _close_group(drain=e.agreed)
        raise Reported(str(e)) from None
    except preemption.Preempted as e:
        _close_group(drain=True)
        preemption.finish(e, cfg.trainer.requeue)  # in a submitit job, it may exit here (requeued)
        raise
    except BaseException:
        _close_group(drain=False)
        raise
    exporting = cfg.trainer.export and dist.get_rank() == 0
    _close_group(drain=True)
    if exporting:  # Note [export at the end]
        log.info("trainer.export: %s", export_finished_run(cfg, run_dir))


# Note [export at the end]
# trainer.export=true exports what the run saved last (final_model.pt or its
# last checkpoint, Note [export]) from rank 0 alone, after the process group is
# gone: an export reads and writes the whole model, which may take longer than
# trainer.timeout_s, and the other ranks would otherwise wait for it in a
# collective that times out. They end; rank 0 goes on, and the run ends when it
# has exported (a failed export: one line, exit 1, the weights left as saved).


_worked = False  # this process has run a worker (`_work`)


def ran_a_worker() -> bool:
    """True once this process has run a worker: see Note [ending a worker] (parallel/entry.py)."""
    return _worked


# Note [the collector in a worker]
# What a worker has imported when it starts (torch, Hydra, the framework: some
# 300,000 objects, more with transformers) is never garbage, yet every full
# collection walks it, ~0.2 s a time on a 2-core machine, and a run made two (the
# trainer's before its steps, `_close_group`'s at the end). `_work` freezes it
# first (gc.freeze: kept where the collector does not look, for the process's
# life); the collections then walk what the run built only, and the trainer,
# finding its imports frozen, leaves the run's objects to the collector as they
# are (the few collections during its steps walk them alone). A sweep's jobs in
# one process (nproc=1) each freeze what the previous ones imported; their
# objects were collected when their group closed.


def _close_group(drain: bool) -> None:
    """Destroy the process group with nothing of the run left behind it (Note [ending a worker]).

    Args:
        drain: every rank is here (the run ended or stopped at a step boundary): a barrier first, which on
            gloo waits for every collective issued before it, asynchronous ones included.
    """
    if drain:
        dist.barrier()
    gc.collect()  # the run's modules, tensors and work handles go now, while the group and the GIL are whole
    dist.destroy_process_group()


def _agree_on_run_dir(run_dir: str | None, cfg_dict: dict, proposed: str) -> str:
    """See Note [one run directory]."""
    if run_dir is None:
        choice = [None]
        if dist.get_rank() == 0:
            choice[0] = _torchrun_run_dir(proposed)
            Path(choice[0], ".hydra").mkdir(parents=True, exist_ok=True)
            OmegaConf.save(OmegaConf.create(cfg_dict), Path(choice[0], ".hydra", "config.yaml"))
            OmegaConf.save(OmegaConf.create(sys.argv[1:]), Path(choice[0], ".hydra", "overrides.yaml"))
        dist.broadcast_object_list(choice, src=0)
        run_dir = choice[0]
        if Path(proposed).resolve() != Path(run_dir).resolve():
            try:
                Path(proposed).rmdir()  # what this worker's Hydra made for another second, still empty
            except OSError:
                pass
    return str(Path(run_dir).resolve())


def _torchrun_run_dir(proposed: str) -> str:
    """`proposed` at torchrun's first start of the workers; the directory of that start when it restarts them
    (--max-restarts), so that they resume from its checkpoints. Found again through a note named by the
    run id, which torchrun keeps across restarts (written only when it may restart them)."""
    note = Path("outputs", ".torchrun", os.environ["TORCHELASTIC_RUN_ID"])
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and note.is_file():
        return note.read_text().strip()
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(str(Path(proposed).resolve()))
    return proposed


def _warn_shared_store() -> None:
    if dist.get_rank() == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Measured here: 2 of 4 restarts failed to connect (gloo), 0 of 8 with the store not shared.
        log.warning("torchrun shares its rendezvous store with the workers, and restarted workers may then read "
                    "their peers' addresses of the attempt before and fail to connect (PyTorch issue 135712): "
                    "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for --max-restarts")


def check_world_size(nproc: int | None, started_by: str | None = None) -> int:
    """The world size of this run: that of the launcher that started the workers, or nproc (default 1).

    Args:
        started_by: the launcher ("torchrun", "the SLURM job") when this process
            is one of its workers; WORLD_SIZE is then its.
    """
    if started_by is not None:
        world = int(os.environ["WORLD_SIZE"])
        if nproc is not None and nproc != world:
            raise ConfigError(f"nproc={nproc}: {started_by} started {world} workers; "
                              f"drop nproc (the launcher sets the world size)")
        return world
    return 1 if nproc is None else nproc


def local_processes(world: int, started_by: str | None) -> int | None:
    """The workers of this run on this machine (parallel.dims.check_gpus): all of them when this process starts
    them; else the launcher's LOCAL_WORLD_SIZE (torchrun and the SLURM job set it; None when unset)."""
    if started_by is None:
        return world
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else None
