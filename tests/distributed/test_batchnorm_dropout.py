"""What real models contain: BatchNorm (strategy.sync_batchnorm, Note [batch norm] in parallel/batchnorm.py) and
dropout (the generators each rank seeds and checkpoints, Note [random numbers] in parallel/seeding.py)."""
import pytest
import torch
from torch import nn

from parallel.config import DataConfig
from tests import cli, hf_models

BATCHNORM = ["model=custom", "model._target_=tests.hf_models.batchnorm_cnn", "data.task=classification",
             "data.features=64",
             # A convolution's bias right before a BatchNorm changes nothing the BatchNorm passes on: its gradient
             # is zero but for rounding, which AdamW would turn into steps of ~lr in any direction. Real models
             # leave it out; frozen here, so every weight and running statistic can be compared.
             "model.freeze=[stem.0.bias,blocks.*.0.bias]"] + hf_models.HF_FAST


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [["strategy=data", "strategy.zero=0"],
                                  ["strategy=data", "strategy.zero=3", "strategy.activations=checkpoint"],
                                  ["strategy=hybrid", "strategy.dp=2"]],
                         ids=["data_zero0", "data_zero3_recomputed", "hybrid_dp2"])
def test_synced_batchnorm_trains_as_single(reference, tmp_path, args):
    """Statistics over both ranks' samples are the global batch's: the losses, weights and running statistics
    of single; recomputed blocks do not move the running statistics a second time."""
    cli.run(BATCHNORM + ["nproc=2", "strategy.sync_batchnorm=true", *args, f"run_dir={tmp_path}"], cwd=tmp_path)
    single = reference(BATCHNORM)
    cli.assert_same_training(tmp_path, single)  # every buffer too: running_mean, running_var, num_batches_tracked
    assert int(cli.final_weights(tmp_path)["blocks.1.1.num_batches_tracked"]) == 4


class DropoutMLP(nn.Module):
    """Residual blocks that end in dropout, for the pipeline (a model it can trace and split)."""

    def __init__(self, features: int = 32, outputs: int = 4, hidden: int = 32, depth: int = 3, p: float = 0.2):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(p))
                                    for _ in range(depth))
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def dropout_mlp(**kwargs) -> nn.Module:
    return DropoutMLP(**kwargs)


GPT2 = ["model=custom", "model._target_=tests.hf_models.gpt2", "+model.args.dropout=0.1", "data.task=lm",
        "data.vocab_size=64", "data.seq_len=16"] + hf_models.HF_FAST
LM = DataConfig(task="lm", vocab_size=64, seq_len=16)


def user_loop(dropout: float) -> torch.Tensor:
    """The losses of the user's loop (seeded again after building, as `single` is: Note [random numbers])."""
    torch.manual_seed(0)
    model = hf_models.gpt2(dropout=dropout)
    return hf_models.plain_loop(hf_models.gpt2, {}, LM, model=model)[0]


def assert_identical(a, b) -> None:
    torch.testing.assert_close(cli.losses(a), cli.losses(b), rtol=0, atol=0)
    got, want = cli.final_weights(a), cli.final_weights(b)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(200)
def test_dropout_under_data_parallel_repeats_and_resumes_exactly(tmp_path):
    """GPT-2 with dropout, data zero 3 on 2 ranks: the same run twice is the same bit for bit, and a run resumed
    from a checkpoint at step 2 continues it bit for bit (every rank's generators are in the checkpoint)."""
    args = GPT2 + ["nproc=2", "strategy=data", "strategy.zero=3"]
    first, again, resumed = tmp_path / "first", tmp_path / "again", tmp_path / "resumed"
    cli.run(args + ["trainer.checkpoint_every=2", f"run_dir={first}"], cwd=tmp_path)
    cli.run(args + [f"run_dir={again}"], cwd=tmp_path)
    cli.run(args + [f"trainer.resume={first}/checkpoints/step-000002", f"run_dir={resumed}"], cwd=tmp_path)
    assert_identical(again, first)
    assert [r["step"] for r in cli.metrics(resumed)] == [3, 4]
    torch.testing.assert_close(cli.losses(resumed), cli.losses(first)[2:], rtol=0, atol=0)
    final, want = cli.final_weights(resumed), cli.final_weights(first)
    for name in want:
        torch.testing.assert_close(final[name], want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    # What parity holds (Note [random numbers]): the masks are on (the run is not the dropout-free one), and
    # each rank draws its own, so the run is another sample than the single process's, not its numbers.
    losses = cli.losses(first)
    assert not torch.allclose(losses, user_loop(0.0), rtol=1e-4, atol=0)
    assert not torch.allclose(losses, user_loop(0.1), rtol=1e-4, atol=0)


@pytest.mark.timeout(200)
def test_dropout_under_a_pipeline_repeats_exactly(tmp_path):
    """Two stages, four microbatches each drawing its masks on the rank of its stage: the same run twice."""
    args = ["model=custom", "model._target_=tests.distributed.test_batchnorm_dropout.dropout_mlp", "nproc=2",
            "strategy=pipeline", "strategy.split_points=[blocks.1]"] + hf_models.HF_FAST
    for name in ("first", "again"):
        cli.run(args + [f"run_dir={tmp_path / name}"], cwd=tmp_path)
    assert_identical(tmp_path / "again", tmp_path / "first")
    torch.manual_seed(0)
    plain = hf_models.plain_loop(dropout_mlp, {"p": 0.0}, DataConfig())[0]
    assert not torch.allclose(cli.losses(tmp_path / "first"), plain, rtol=1e-4, atol=0)  # the masks are on
