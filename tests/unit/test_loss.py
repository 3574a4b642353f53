"""The loss (Note [global loss]): microbatch shares that add up to the mean over the counted targets of the whole
batch, with the whole batch's gradients; the evaluation's sums; bad losses and evaluation settings refused before
any worker starts."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parallel.config import Config, ConfigError, LossConfig
from parallel.loss import Loss
from parallel.validate import to_config, validate
from tests.user_loss import IGNORE, PaddedLM


def padded_batch():
    data = PaddedLM(n=8, seq_len=6, vocab_size=5)
    logits = torch.randn(8, 6, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    return logits, data.y


def shares(loss: Loss, out: torch.Tensor, y: torch.Tensor, parts: int) -> torch.Tensor:
    """The step's loss as an engine adds it up: N counted once, then each microbatch's share."""
    loss.start_step(y, None, 1)
    return sum(loss(o, t) for o, t in zip(out.chunk(parts), y.chunk(parts)))


LOSSES = [LossConfig(), LossConfig(_target_="tests.user_loss.token_sum", reduction="sum"),
          LossConfig(_target_="tests.user_loss.token_mean", reduction="mean")]


@pytest.mark.parametrize("config", LOSSES, ids=["built-in", "user sum", "user mean"])
def test_microbatch_shares_add_up_to_the_whole_batch_token_mean(config):
    logits, y = padded_batch()
    counts = [(t != IGNORE).sum().item() for t in y.chunk(4)]
    assert len(set(counts)) > 1  # the microbatches hold different numbers of real tokens
    want = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    (want_grad,) = torch.autograd.grad(want, logits)
    got = shares(Loss(config, "lm"), logits, y, parts=4)
    (got_grad,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    # What a per-microbatch mean gives instead: another number, so the test tells the two apart.
    naive = sum(F.cross_entropy(o.flatten(0, 1), t.flatten(), ignore_index=IGNORE)
                for o, t in zip(logits.chunk(4), y.chunk(4))) / 4
    assert abs(naive.item() - want.item()) > 1e-3


def test_regression_counts_every_element_and_scales_for_data_parallel_averaging():
    out, y = torch.randn(8, 3), torch.randn(8, 3)
    loss = Loss(LossConfig(_target_="tests.user_loss.squared_mean", args={"weight": 2.0}), "regression")
    torch.testing.assert_close(shares(loss, out, y, parts=2), 2 * F.mse_loss(out, y))
    builtin = Loss(LossConfig(name="l1"), "regression")
    torch.testing.assert_close(shares(builtin, out, y, parts=4), F.l1_loss(out, y))
    builtin.start_step(y[:4], None, scale=2)  # one rank's half: its share x 2, as DDP then halves the gradients
    torch.testing.assert_close(builtin(out[:4], y[:4]), 2 * F.l1_loss(out[:4], y[:4], reduction="sum") / 12)


def test_padding_only_gives_zero_not_nan():
    loss = Loss(LossConfig(), "lm")
    y = torch.full((2, 3), IGNORE)
    assert shares(loss, torch.randn(2, 3, 5), y, parts=1).item() == 0.0


def test_scores_count_real_tokens_and_correct_predictions():
    logits, y = padded_batch()
    scores = Loss(LossConfig(), "lm").score(logits, y)
    real = y != IGNORE
    summed = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(scores[0].item(), summed.item())
    assert scores[1].item() == real.sum().item()
    assert scores[2].item() == ((logits.argmax(-1) == y) & real).sum().item()


def regression_cfg(**loss) -> Config:
    cfg = Config()
    cfg.model.args = {"in_features": 32, "out_features": 4}
    for key, value in loss.items():
        setattr(cfg.loss, key, value)
    return cfg


BAD = [  # (loss keys, the key the message names, words it holds)
    ({"_target_": "tests.user_loss.nope"}, "loss._target_", "cannot be imported"),
    ({"_target_": "no_dots"}, "loss._target_", "dotted path"),
    ({"_target_": "tests.user_loss.NOT_CALLABLE"}, "loss._target_", "not callable"),
    ({"_target_": "tests.user_loss.per_sample"}, "loss._target_", "must return a scalar"),
    ({"_target_": "tests.user_loss.squared_sum"}, "loss._target_", "returns a sum"),
    ({"_target_": "tests.user_loss.squared_mean", "reduction": "sum"}, "loss._target_", "returns a mean"),
    ({"_target_": "tests.user_loss.squared_mean", "args": {"scale": 2}}, "loss._target_", "fails on the model"),
    ({"_target_": "tests.user_loss.not_callable"}, "loss._target_", "fails on the model"),
    ({"name": "hinge"}, "loss.name", "unknown loss"),
    ({"reduction": "max"}, "loss.reduction", "unknown reduction"),
]


@pytest.mark.parametrize("loss,key,words", BAD, ids=[f"{b[0]}" for b in BAD])
def test_bad_loss_fails_before_workers_start(loss, key, words):
    with pytest.raises(ConfigError) as err:
        validate(regression_cfg(**loss), 1)
    msg = str(err.value)
    assert msg.startswith(f"{key}=") and words in msg and "\n" not in msg, msg


def test_a_good_user_loss_validates():
    validate(regression_cfg(_target_="tests.user_loss.squared_mean", args={"weight": 0.5}), 1)
    validate(regression_cfg(_target_="tests.user_loss.squared_sum", reduction="sum"), 1)


@pytest.mark.parametrize("key,value", [("eval_every", -1), ("eval_batches", 0)])
def test_bad_eval_settings(key, value):
    cfg = regression_cfg()
    setattr(cfg.trainer, key, value)
    with pytest.raises(ConfigError, match=f"trainer.{key}="):
        validate(cfg, 1)


def test_eval_every_without_eval_data(tmp_path):
    from parallel.data.shards import write_shards

    write_shards(({"features": np.full(8, i, np.float32), "targets": np.zeros(2, np.float32)} for i in range(16)),
                 tmp_path / "data")
    cfg = to_config({"data": {"name": "shards", "path": str(tmp_path / "data")}, "trainer": {"eval_every": 2},
                     "model": {"args": {"in_features": 8, "out_features": 2}}})
    with pytest.raises(ConfigError, match="trainer.eval_every=2: data=shards has no eval data"):
        validate(cfg, 1)


def test_eval_figures_go_to_their_own_tensorboard_group():
    from parallel.metrics import _tb_name

    assert [_tb_name(k) for k in ("eval_loss", "eval_accuracy", "eval_perplexity", "loss")] == \
        ["eval/loss", "eval/accuracy", "eval/perplexity", "train/loss"]
