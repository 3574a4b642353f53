"""Train a model with the strategy chosen in conf/ (see README).

    python launch/train.py [overrides]                     one process, or nproc=N workers
    torchrun --standalone --nproc-per-node N launch/train.py [overrides]
    python launch/train.py -m strategy=single,data ...     a sweep: one full run per job
    python launch/train.py -m hydra/launcher=slurm ...     SLURM jobs, one worker per task
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from parallel.config import ConfigError, strategy_spec, to_dict  # noqa: E402
from parallel.dims import check_gpus  # noqa: E402
from parallel.entry import check_choices, exit_with, reported  # noqa: E402
from parallel.launcher import (  # noqa: E402
    check_world_size,
    in_submitit_job,
    join_submitit_job,
    launch,
    local_processes,
    under_torchrun,
    worker,
)
from parallel.models.build import build_meta_model  # noqa: E402
from parallel.models.weights import check_init_memory  # noqa: E402
from parallel.planning.auto import chart, choose, device_budget, table, write_record  # noqa: E402
from parallel.validate import to_config_with_data, validate  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
@reported
def main(dcfg: DictConfig) -> None:
    started_by = "torchrun" if under_torchrun() else None
    if started_by is None and in_submitit_job():
        join_submitit_job()  # each task of the job is one worker
        started_by = "the SLURM job"
    cfg, data = to_config_with_data(dcfg)
    world = check_world_size(cfg.nproc, started_by)
    check_gpus(cfg.trainer.device, local_processes(world, started_by), started_by)  # a GPU for each process
    validate(cfg, world, data)
    check_init_memory(cfg.model, build_meta_model(cfg.model))  # this host's memory: a run's check, not a plan's
    # Workers get the validated config with derived values filled in (degrees, microbatches), and beside it
    # what was read from the data (Note [data spec] in parallel/data/spec.py).
    cfg_dict, data_dict = to_dict(cfg), data.to_dict()
    run_dir = cfg.run_dir or HydraConfig.get().runtime.output_dir
    if started_by == "torchrun":
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise ConfigError("-m (a sweep) under torchrun: each job of a sweep starts its own workers; run "
                              f"`python launch/train.py -m nproc={world} ...` instead")
        worker(cfg_dict, None, proposed=run_dir, data=data_dict)  # rank 0's wins (Note [one run directory])
        return
    if strategy_spec(cfg.strategy.name).chooses:  # strategy=auto (Note [strategy table])
        cfg_dict = _choose(cfg, data, world, run_dir, started_by)
    if started_by is not None:
        worker(cfg_dict, run_dir, data=data_dict)  # every task of the job has the same Hydra job directory
        return
    launch(cfg_dict, run_dir, world, data_dict)


def _choose(cfg, data, world: int, run_dir: str, started_by: str | None) -> dict:
    """strategy=auto: plan the candidates, print them ranked, keep the fastest that fits (parallel.planning.auto)."""
    if started_by is not None:
        raise ConfigError(f"strategy='auto': chooses before the workers start, and {started_by} has started "
                          f"them; run `python launch/train.py strategy=auto nproc={world} ...` (or "
                          f"launch/plan.py) once and start {started_by} with the strategy it picks")
    searched: dict = {}
    chosen, found = choose(cfg, world, Path(run_dir), data=data, searched=searched)
    budget = device_budget(cfg, world)
    print(table(found, f"budget {budget / 1e6:.2f} MB per rank"))
    picked = next(c for c in found if c.dropped is None)
    print(f"auto: running {picked.name} ({' '.join(picked.overrides)})")
    # The prediction the run logs beside its measured step time (parallel.throughput.auto_prediction).
    write_record(Path(run_dir), found, searched)
    chart(found, budget, Path(run_dir, "auto.png"))
    return to_dict(chosen)


def _run() -> None:
    check_choices(sys.argv[1:], Path(__file__).resolve().parents[1] / "conf")  # one line, exit 2
    if under_torchrun():
        # Note [one run directory] (parallel/launcher.py): each torchrun worker runs
        # this script; Hydra must not write a .hydra/ of its own in each of them.
        sys.argv += ["hydra.output_subdir=null"]
    if ("--cfg" in sys.argv or "-c" in sys.argv) and "--resolve" not in sys.argv:
        sys.argv.append("--resolve")  # show the values the run would use, not interpolations
    main()


if __name__ == "__main__":
    exit_with(reported(_run))  # Ctrl-C outside the task (while Hydra composes): one line, exit 130
