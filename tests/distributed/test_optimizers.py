"""Any optimizer, with parameter groups and a schedule, trains to the same numbers as `single` under every
strategy; its state resumes across strategies and world sizes; a schedule extends as Note [lr schedule] says."""
import pytest
import torch
import torch.nn.functional as F

from parallel.config import DataConfig
from parallel.data.synthetic import SyntheticData
from parallel.models.mlp import build_mlp
from tests import cli, parity

BASE = cli.FAST + ["data.task=regression", "model.args.depth=2"]
# Nesterov momentum, weight decay off for biases, half the lr for the input layer, warmup-stable-decay.
SGD = ["optim._target_=torch.optim.SGD", "+optim.args.momentum=0.9", "+optim.args.nesterov=true", "optim.lr=0.05",
       "optim.no_decay=[bias]", "optim.lr_scale=[inp.*:0.5]", "optim.schedule=wsd", "optim.warmup_steps=1",
       "optim.decay_steps=3"]
ADAM = ["optim._target_=torch.optim.Adam", "optim.no_decay=[bias]", "optim.lr_scale=[blocks.1.*:2]",
        "optim.schedule=linear"]
OPTIMIZERS = {"sgd": SGD, "adam": ADAM}
STRATEGIES = {
    "zero1": ["nproc=2", "strategy=data", "strategy.zero=1"],
    "zero3": ["nproc=2", "strategy=data", "strategy.zero=3", "trainer.checkpoint_every=3"],
    "model": ["nproc=2", "strategy=model"],
    "pipeline": ["nproc=2", "strategy=pipeline"],
    "offload": ["strategy=offload"],
    "hybrid": ["nproc=4", "strategy=hybrid", "strategy.dp=2", "strategy.pp=2", "strategy.zero=3"],
}
CASES = [("sgd", s) for s in STRATEGIES] + [("adam", s) for s in STRATEGIES if s not in ("offload", "hybrid")]


def single(reference, optimizer: str, *extra: str):
    # Checkpoints at steps 3 and 6, for the extension tests.
    return reference(BASE + OPTIMIZERS[optimizer] + ["trainer.checkpoint_every=3", *extra])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer,strategy", CASES, ids=[f"{o}-{s}" for o, s in CASES])
def test_optimizer_under_strategy_matches_single(reference, optimizer, strategy):
    run = reference(BASE + OPTIMIZERS[optimizer] + STRATEGIES[strategy])  # shared with the resume test
    cli.assert_same_training(run, single(reference, optimizer))


def plain_sgd_loop(steps: int = 6):
    """The user's own loop for SGD: the same model, batches, groups, clipping and schedule, written out."""
    torch.manual_seed(0)
    model = build_mlp(32, 4, 64, 2)
    named = dict(model.named_parameters())
    groups = [{"params": [named["inp.weight"]], "lr": 0.025}, {"params": [named["inp.bias"]], "lr": 0.025,
                                                                "weight_decay": 0.0},
              {"params": [p for n, p in named.items() if not n.startswith("inp.") and n.endswith("weight")]},
              {"params": [p for n, p in named.items() if not n.startswith("inp.") and n.endswith("bias")],
               "weight_decay": 0.0}]
    opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    # wsd over 6 steps with a warmup of 1 and a decay of 3 (from step index 3): 1, 1, 1, 1, then 0.1 + 0.9 x 2/3
    # and 0.1 + 0.9 x 1/3.
    factors = [1.0, 1.0, 1.0, 1.0, 0.7, 0.4]
    base = [g["lr"] for g in opt.param_groups]
    data = SyntheticData(DataConfig(task="regression"), 0, 32)
    losses = []
    for step in range(1, steps + 1):
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * factors[step - 1]
        x, y = data.global_batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), model.state_dict()


@pytest.mark.timeout(120)
def test_single_sgd_with_groups_and_wsd_is_the_plain_pytorch_loop(reference):
    run = single(reference, "sgd")
    losses, state = plain_sgd_loop()
    parity.assert_same_losses(cli.losses(run), losses)
    parity.assert_same_weights(cli.final_weights(run), state, parity.run_reach(run))  # SGD's: rounding only
    lrs = [r["lr"] for r in cli.metrics(run)]  # optim.lr's groups, as the step leaves them for the next one
    torch.testing.assert_close(lrs, [0.05, 0.05, 0.05, 0.035, 0.02, 0.005])


@pytest.mark.timeout(240)
def test_sgd_momentum_checkpoint_from_zero3_on_two_ranks_resumes_on_single(reference, tmp_path):
    zero3 = reference(BASE + SGD + STRATEGIES["zero3"])
    cli.run(BASE + SGD + [f"trainer.resume={zero3}/checkpoints/step-000003", f"run_dir={tmp_path}"], cwd=tmp_path)
    ref = single(reference, "sgd")
    assert [r["step"] for r in cli.metrics(tmp_path)] == [4, 5, 6]
    cli.assert_same_training(tmp_path, ref, first_step=4)
    # Under another optimizer its state does not fit: a config error before training.
    proc = cli.run(BASE + [f"trainer.resume={zero3}/checkpoints/step-000003", f"run_dir={tmp_path / 'adamw'}"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "another optimizer state" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.timeout(240)
def test_extending_a_run_follows_the_schedule_of_the_new_length(reference, tmp_path):
    """Resumed with trainer.steps raised from 6 to 10: from step 3 (wsd's stable phase) the run is the
    uninterrupted 10-step one, losses and lrs; from the finished step 6 its lrs are the 10-step schedule's."""
    short, long = single(reference, "sgd"), single(reference, "sgd", "trainer.steps=10")
    for k, start in ((3, "stable"), (6, "finished")):
        out = tmp_path / start
        cli.run(BASE + SGD + ["trainer.steps=10", f"trainer.resume={short}/checkpoints/step-00000{k}",
                              f"run_dir={out}"], cwd=tmp_path)
        got, want = cli.metrics(out), cli.metrics(long)[k:]
        assert [r["step"] for r in got] == list(range(k + 1, 11))
        torch.testing.assert_close([r["lr"] for r in got], [r["lr"] for r in want], rtol=1e-12, atol=0)
        if start == "stable":
            torch.testing.assert_close(cli.losses(out), cli.losses(long)[k:], rtol=1e-4, atol=0)
    # The 6-step run had decayed by its end; the 10-step schedule is back at the peak at step 7.
    assert cli.metrics(short)[-1]["lr"] < 0.05 and cli.metrics(long)[6]["lr"] == 0.05


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,key", [
    (["strategy=offload", "optim._target_=torch.optim.Adagrad"], "optim._target_"),
    (["optim._target_=torch.optim.SGD", "+optim.args.momentun=0.9"], "optim.args"),
    (["optim._target_=torch.utils.data.Dataset"], "optim._target_"),
    (["optim.schedule=exponential"], "optim.schedule"),
    (["optim.scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau"], "optim.scheduler._target_"),
])
def test_bad_optimizer_input_is_one_line_before_training(tmp_path, args, key):
    proc = cli.run(args + [f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
