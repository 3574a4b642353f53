"""The loss over the whole global batch and evaluation, under the strategies, as `single` and the user's own loop.

Padded text (tests.user_loss.PaddedLM: every sequence real for a length of its own) gives microbatches and
data-parallel ranks different numbers of real tokens; gradient accumulation, data parallelism and pipeline
microbatches still give single's loss and weights, and single gives the plain loop's token mean over the global
batch (Note [global loss]). Evaluation gives single's figures under every strategy, and training goes on the
same with and without it (Note [evaluation]).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from parallel.models import MODELS
from tests import cli, parity
from tests.user_loss import PaddedLM

GPT = {"vocab_size": 64, "seq_len": 16, "dim": 32, "heads": 4, "layers": 2, "mlp_ratio": 4}
SMALL = ["trainer.steps=4", "trainer.log_every=1", "trainer.progress=false", "trainer.save_final=true",
         "trainer.timeout_s=60", "optim.schedule=constant", "trainer.batch_size=8", "model=gpt",
         "model.args.dim=32"]
# Evaluated after steps 2 and 4 on 16 other padded sequences (two global batches).
PADDED = SMALL + ["data=custom", "data._target_=tests.user_loss.padded_lm", "data.shuffle=false",
                  "data.workers=0", "trainer.eval_every=2", "trainer.eval_batches=2",
                  "data.eval._target_=tests.user_loss.padded_lm", "+data.eval.args.n=16", "+data.eval.args.seed=5"]
EVAL = SMALL + ["data.task=lm", "data.seq_len=16", "trainer.eval_every=2", "trainer.eval_batches=2",
               "optim.lr=1e-3"]  # AdamW turns sharded sums' rounding into weight differences of ~lr x 1e-2


def plain_padded_loop(steps: int = 4, batch_size: int = 8):
    """The user's own loop over the padded data in its order: cross-entropy's mean over the real tokens of each
    global batch, AdamW, clipping at 1, and after steps 2 and 4 the mean loss and accuracy over the real tokens
    of the eval sequences; returns (losses, evals, final state)."""
    torch.manual_seed(0)
    model = MODELS["gpt"](**GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    data, held_out, losses, evals = PaddedLM(), PaddedLM(n=16, seed=5), [], []
    for step in range(steps):
        x, y = data.x[step * batch_size:(step + 1) * batch_size], data.y[step * batch_size:(step + 1) * batch_size]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 2 == 0:
            with torch.no_grad():
                logits, real = model(held_out.x), held_out.y != -100
                loss = F.cross_entropy(logits.flatten(0, 1), held_out.y.flatten(), ignore_index=-100).item()
                accuracy = ((logits.argmax(-1) == held_out.y) & real).sum().item() / real.sum().item()
            evals.append({"step": step + 1, "eval_loss": loss, "eval_accuracy": accuracy,
                          "eval_perplexity": math.exp(loss)})
    return torch.tensor(losses, dtype=torch.float64), evals, model.state_dict()


@pytest.fixture
def padded_single(reference):
    return reference(PADDED)


@pytest.mark.timeout(180)
def test_single_is_the_plain_loops_token_mean_over_the_global_batch(padded_single):
    data = PaddedLM()
    real = [(data.y[i:i + 4] != -100).sum().item() for i in range(0, 32, 4)]
    assert len(set(real)) > 2  # the halves of each batch hold different numbers of real tokens
    losses, plain_evals, state = plain_padded_loop()
    parity.assert_same_losses(cli.losses(padded_single), losses)
    assert_same_evals(evals(padded_single), plain_evals)
    parity.assert_same_weights(cli.final_weights(padded_single), state, parity.run_reach(padded_single))


PADDED_RUNS = [["nproc=2", "strategy=data", "trainer.grad_accum=2"],
               ["nproc=2", "strategy=pipeline"],
               ["nproc=2", "strategy=data", "strategy.zero=3", "loss._target_=tests.user_loss.token_sum",
                "loss.reduction=sum"]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", PADDED_RUNS, ids=["data_accum2", "pipeline", "zero3_user_sum"])
def test_padded_tokens_normalized_over_the_global_batch(padded_single, tmp_path, strategy):
    cli.run(PADDED + strategy + [f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, padded_single)
    assert_same_evals(evals(tmp_path), evals(padded_single))


def evals(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k == "step" or k.startswith("eval_")} for r in cli.metrics(run_dir)
            if any(k.startswith("eval_") for k in r)]


def assert_same_evals(got: list[dict], want: list[dict]) -> None:
    """The eval figures after steps 2 and 4 (lm: loss, accuracy and perplexity) within 1e-4 relative."""
    assert [r["step"] for r in want] == [2, 4]
    assert set(want[0]) == {"step", "eval_loss", "eval_accuracy", "eval_perplexity"}
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for key in w:
            torch.testing.assert_close(g[key], w[key], rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture
def eval_single(reference):
    return reference(EVAL)


EVAL_RUNS = [["nproc=2", "strategy=data", "strategy.zero=3"], ["nproc=2", "strategy=model"],
             ["nproc=2", "strategy=pipeline", "strategy.schedule=ZBVZeroBubble"], ["strategy=offload"],
             ["nproc=4", "strategy=hybrid", "strategy.dp=2", "strategy.pp=2"]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", EVAL_RUNS, ids=["zero3", "model", "pipeline_zbv", "offload", "hybrid"])
def test_eval_is_singles(eval_single, tmp_path, strategy):
    cli.run(EVAL + strategy + [f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, eval_single)
    assert_same_evals(evals(tmp_path), evals(eval_single))


@pytest.mark.timeout(180)
def test_training_is_the_same_with_and_without_eval(tmp_path):
    """A model with dropout that also draws in eval mode: evaluating after every step (its logged line apart)
    leaves every loss and weight as they were, bit for bit."""
    run = ["trainer.steps=3", "trainer.log_every=2", "trainer.progress=false", "trainer.save_final=true",
           "model=custom", "model._target_=tests.user_loss.draws_in_eval"]
    cli.run(run + [f"run_dir={tmp_path / 'plain'}"], cwd=tmp_path)
    cli.run(run + ["trainer.eval_every=1", "trainer.eval_batches=1", f"run_dir={tmp_path / 'eval'}"], cwd=tmp_path)
    plain, evaluated = cli.metrics(tmp_path / "plain"), cli.metrics(tmp_path / "eval")
    assert [r["step"] for r in evaluated] == [1, 2, 3] and "loss" not in evaluated[0]  # step 1: eval only
    assert [r["loss"] for r in plain] == [r["loss"] for r in evaluated if "loss" in r]
    got, want = cli.final_weights(tmp_path / "eval"), cli.final_weights(tmp_path / "plain")
    for name, value in want.items():
        assert torch.equal(got[name], value), name


BAD = [(["loss._target_=tests.user_loss.nowhere"], "loss._target_='tests.user_loss.nowhere': cannot be imported"),
       (["loss._target_=tests.user_loss.squared_sum"], "loss._target_='tests.user_loss.squared_sum': returns a sum"),
       (["loss._target_=tests.user_loss.per_sample"], "must return a scalar tensor"),
       (["data=custom", "data._target_=tests.user_loss.padded_lm", "trainer.eval_every=2"],
        "trainer.eval_every=2: data=custom has no evaluation data")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,words", BAD, ids=["unimportable", "sum_as_mean", "non_scalar", "no_eval_data"])
def test_bad_loss_or_eval_input_is_one_line_before_training(tmp_path, args, words):
    proc = cli.run(args + ["trainer.steps=2"], cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and words in out and "Traceback" not in out, out
    assert not list(tmp_path.glob("outputs/*/*/metrics.jsonl"))  # nothing trained
