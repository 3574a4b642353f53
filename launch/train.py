"""Train a model with the strategy chosen in conf/ (see README).

    python launch/train.py [overrides]                     one process, or nproc=N workers
    torchrun --standalone --nproc-per-node N launch/train.py [overrides]
    python launch/train.py -m strategy=single,data ...     a sweep: one full run per job
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from parallel.config import ConfigError, to_config, validate  # noqa: E402
from parallel.launcher import WorkerFailed, check_world_size, launch, under_torchrun, worker  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    try:
        cfg = to_config(dcfg)
        world = check_world_size(cfg.nproc)
        validate(cfg, world)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    # Workers get the validated config with derived values filled in (degrees, microbatches).
    cfg_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    if under_torchrun():
        worker(cfg_dict, None)
        return
    run_dir = cfg.run_dir or HydraConfig.get().runtime.output_dir
    try:
        launch(cfg_dict, run_dir, world)
    except WorkerFailed as e:
        print(f"{e.traceback}\nerror: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    if under_torchrun():
        # Note [one run directory] (parallel/launcher.py): each torchrun worker runs
        # this script; Hydra must not create a directory of its own in each of them.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null"]
    if ("--cfg" in sys.argv or "-c" in sys.argv) and "--resolve" not in sys.argv:
        sys.argv.append("--resolve")  # show the values the run would use, not interpolations
    main()
