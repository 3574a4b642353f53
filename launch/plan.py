"""How much memory each rank will need, before running (docs/planning.md).

    python launch/plan.py [the overrides train.py takes] nproc=N [plan.by_module=true] [plan.top=K]

Builds the configured model and strategy under fake tensors and a fake process
group, runs one training step symbolically for each rank role (Note [planner]
in parallel/planning/planner.py), prints a table and writes plan.json and its picture,
memory.png, into the run dir. No GPU, no workers and no real memory are used:
trainer.device=cuda plans a CUDA run from any host (Note [planning for CUDA] in
parallel/planning/cuda.py). strategy=auto plans its candidates first and then the
one it picks (parallel.planning.auto). nproc is the world size planned (default 1).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from parallel.config import ConfigError, positive  # noqa: E402
from parallel.entry import check_choices, reported  # noqa: E402
from parallel.planning.report import report  # noqa: E402
from parallel.validate import to_config_with_data, validate  # noqa: E402


def _refuse_world_size(argv: list[str]) -> None:
    """`world_size=N`, the option this script once took: the world size is `nproc` here as in train.py."""
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "world_size":
            raise ConfigError(f"world_size={value!r}: launch/plan.py takes the world size as train.py does: "
                              f"nproc={value}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
@reported
def main(dcfg: DictConfig) -> None:
    cfg, data = to_config_with_data(dcfg)
    if cfg.nproc is not None:
        positive("nproc", cfg.nproc)
    world = cfg.nproc or 1
    if cfg.plan.top < 1:
        raise ConfigError(f"plan.top={cfg.plan.top}: must be an integer >= 1 (the rows plan.by_module prints)")
    cfg.nproc = None
    validate(cfg, world, data)
    # As train.py's: run_dir, else Hydra's (hydra.run.dir, or its dated default); fixed before planning.
    run_dir = cfg.run_dir or HydraConfig.get().runtime.output_dir
    report(cfg, world, run_dir, data)


def _run() -> None:
    _refuse_world_size(sys.argv[1:])  # before the settings' check, which knows no such key
    check_choices(sys.argv[1:], Path(__file__).resolve().parents[1] / "conf")  # one line, exit 2
    main()


if __name__ == "__main__":
    reported(_run)()
