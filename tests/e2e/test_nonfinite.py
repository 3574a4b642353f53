"""The divergence guard (Note [non-finite steps] in parallel/nonfinite.py) under every kind of engine: a loss that
turns NaN at a chosen step (one NaN target in that step's batch, tests.user_data.poisoned) stops the run in one
line before the optimizer or a checkpoint sees it, every earlier checkpoint kept; under trainer.nonfinite=skip
the step is dropped, the weights and optimizer state after it those before it, and the run goes on as
strategy=single's does."""

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import cli

BASE = ["trainer.log_every=1", "trainer.progress=false", "trainer.timeout_s=60", "model.args.depth=2",
        "data=custom", "data._target_=tests.user_data.poisoned", "data.shuffle=false", "trainer.batch_size=8",
        "trainer.steps=6"]
STRATEGIES = {
    "single": ["strategy=single"],
    "data3": ["nproc=2", "strategy=data", "strategy.zero=3"],
    "pipeline": ["nproc=2", "strategy=pipeline"],
    "offload": ["strategy=offload"],  # with clipping: its blocks step after backward
    "offload_noclip": ["strategy=offload", "trainer.clip_grad_norm=0"],  # its blocks step during backward
    "offload_device": ["strategy=offload", "strategy.optimizer=device"],  # gradients wait on the device
}


def _state(path) -> dict:
    """A checkpoint's tensors (weights and optimizer state) by name, read whole."""
    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif torch.is_tensor(value):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def _errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["single", "data3", "pipeline", "offload", "offload_noclip"])
def test_a_nan_loss_stops_the_run_before_its_step_and_checkpoint(tmp_path, strategy):
    args = BASE + STRATEGIES[strategy] + ["+data.args.steps=[5]", "trainer.checkpoint_every=2",
                                          "trainer.keep_checkpoints=2", f"run_dir={tmp_path}"]
    proc = cli.run(args, cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    last = tmp_path / "checkpoints" / "step-000004"
    rank = 1 if strategy == "pipeline" else 0  # the last stage holds the loss
    assert _errors(proc) == [f"error: non-finite loss (nan) at step 5 on rank {rank} (grad_norm nan); the last good "
                             f"checkpoint is {last}"], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    state = _state(last)
    assert state and all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
    assert [r["step"] for r in cli.metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]  # no record of step 5


@pytest.fixture(scope="module")
def skipped_single(shared_dir):
    return cli.shared_run(BASE + ["trainer.nonfinite=skip", "+data.args.steps=[3]"], shared_dir / "nonfinite")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["single", "data3", "pipeline", "offload_noclip", "offload_device"])
def test_a_skipped_step_leaves_weights_and_optimizer_state_as_they_were(tmp_path, strategy, skipped_single):
    args = BASE + STRATEGIES[strategy] + ["trainer.nonfinite=skip", "+data.args.steps=[3]",
                                          "trainer.checkpoint_every=1", "trainer.keep_checkpoints=6",
                                          f"run_dir={tmp_path}"]
    cli.run(args, cwd=tmp_path)
    before, after = (_state(tmp_path / "checkpoints" / f"step-00000{s}") for s in (2, 3))
    assert sorted(before) == sorted(after)
    assert any(".exp_avg" in k for k in before), sorted(before)  # the optimizer state is in the comparison
    for name in before:
        if not name.endswith(".step") or "optim" not in name:
            torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    steps = {k: v for k, v in after.items() if k.endswith(".step") and "optim" in k}
    assert steps and all(float(v) == 2 for v in steps.values()), steps  # AdamW counted steps 1 and 2 alone
    records = [r for r in cli.metrics(tmp_path) if "loss" in r]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert records[2]["loss"] is None  # strict JSON: the skipped step's NaN loss is null in metrics.jsonl
    # The run goes on as single's (the next batches, the same weights): the parity invariant, the NaN step aside.
    got, want = cli.losses(tmp_path), cli.losses(skipped_single)
    keep = [0, 1, 3, 4, 5]
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=0)


@pytest.mark.timeout(120)
def test_too_many_skipped_steps_in_a_row_stop_the_run(tmp_path):
    args = BASE + ["trainer.nonfinite=skip", "trainer.nonfinite_limit=2", "+data.args.steps=[3,4]",
                   "trainer.checkpoint_every=2", f"run_dir={tmp_path}"]
    proc = cli.run(args, cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    last = tmp_path / "checkpoints" / "step-000002"
    assert _errors(proc) == [f"error: non-finite loss (nan) at step 4 on rank 0 (grad_norm nan), 2 steps in a row "
                             f"(trainer.nonfinite_limit=2); the last good checkpoint is {last}"], proc.stderr
    assert [r["skipped_steps"] for r in cli.metrics(tmp_path) if "loss" in r] == [0, 0, 1]
