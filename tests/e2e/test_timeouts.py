"""trainer.init_timeout_s until the first step has ended, trainer.timeout_s after it (Note [two timeouts] in
parallel/dims.py), on every process group of every rank (the mesh's and FSDP's included), read back by the
model itself at each step (tests.user_model.timeout_probe)."""
import json

import pytest

from tests import cli


@pytest.mark.timeout(120)
def test_collectives_wait_init_timeout_until_the_first_step_has_ended_then_timeout(tmp_path):
    cli.run(["model=custom", "model._target_=tests.user_model.timeout_probe", "nproc=2", "strategy=data",
             "strategy.zero=3", "trainer.steps=3", "trainer.progress=false", "trainer.timeout_s=77",
             "trainer.init_timeout_s=555", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    for rank in (0, 1):
        lines = (tmp_path / f"timeouts-rank{rank}.txt").read_text().splitlines()
        assert [json.loads(line) for line in lines] == [[555.0], [77.0], [77.0]], lines
