"""model=moe trains to the same numbers as strategy=single under data parallelism, pipelines and expert
parallelism (ep alone, dp x ep, ep x pp, ep x tp), and a checkpoint saved at ep 2 resumes on one process."""
import pytest

from tests import cli

MOE = ["model=moe", "data.task=lm", "data.seq_len=16", "model.args.dim=32", "model.args.heads=4",
       "model.args.experts=4", "model.args.capacity_factor=1.5", "model.args.aux_coef=0.1"]

# name -> (strategy args, processes)
CASES = {
    "data_zero3": (["strategy=data", "strategy.zero=3"], 2),
    "pipeline": (["strategy=pipeline"], 2),
    "ep2": (["strategy=expert"], 2),
    # The dense weights' optimizer state sharded over dp x ep, the experts' over their dp ranks (Note [ZeRO 1]).
    "dp2_ep2_zero1": (["strategy=hybrid", "strategy.dp=2", "strategy.ep=2", "strategy.zero=1"], 4),
    "dp2_ep2_zero3": (["strategy=hybrid", "strategy.dp=2", "strategy.ep=2", "strategy.zero=3"], 4),
    "ep2_pp2": (["strategy=hybrid", "strategy.dp=1", "strategy.ep=2", "strategy.pp=2"], 4),
    "ep2_tp2": (["strategy=hybrid", "strategy.dp=1", "strategy.ep=2", "strategy.tp=2"], 4),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_moe_matches_single(reference, tmp_path, case):
    args, nproc = CASES[case]
    cli.run(cli.FAST + MOE + args + [f"nproc={nproc}", f"run_dir={tmp_path}"], cwd=tmp_path, timeout=240)
    ref = reference(cli.FAST + MOE)
    cli.assert_same_training(tmp_path, ref)
    got, want = cli.metrics(tmp_path)[-1], cli.metrics(ref)[-1]
    if case == "pipeline":  # its traced stages run every expert on every token and keep no figures (Note [moe layer])
        assert "moe_tokens_per_expert" not in got
        return
    # The routing figures are the whole batch's, summed over the ranks that each saw a share of it.
    for key in ("moe_tokens_per_expert", "moe_dropped_tokens"):
        assert got[key] == want[key], key
    assert want["moe_dropped_tokens"] > 0 and len(want["moe_tokens_per_expert"]) == 4


@pytest.mark.timeout(300)
def test_checkpoint_at_ep2_resumes_on_one_process(reference, tmp_path):
    """Saved at step 3 under ep 2 (each rank its experts, under their own names), resumed under single: the
    rest of the run is single's."""
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    cli.run(cli.FAST + MOE + ["strategy=expert", "nproc=2", "trainer.checkpoint_every=3", f"run_dir={saved}"],
            cwd=tmp_path, timeout=240)
    cli.run(cli.FAST + MOE + [f"trainer.resume={saved}/checkpoints/step-000003", f"run_dir={resumed}"],
            cwd=tmp_path)
    ref = reference(cli.FAST + MOE)
    assert [r["step"] for r in cli.metrics(resumed)] == [4, 5, 6]
    cli.assert_same_training(resumed, ref, first_step=4)


@pytest.mark.timeout(300)
def test_a_users_moe_layer_trains_under_ep(reference, tmp_path):
    """A user's own layer with `router` and `experts`, written to the interface, splits its experts over ep."""
    user = ["model=custom", "model._target_=tests.user_model.moe_regressor"]
    cli.run(cli.FAST + user + ["strategy=expert", "nproc=2", f"run_dir={tmp_path}"], cwd=tmp_path, timeout=240)
    cli.assert_same_training(tmp_path, reference(cli.FAST + user))


@pytest.mark.timeout(120)
def test_single_is_the_users_own_loop(tmp_path):
    """The model trained alone in a plain PyTorch loop (its load-balancing gradient weighted per sequence of
    the batch it is given) gives single's losses and weights."""
    from parallel.config import DataConfig
    from parallel.models.moe import build_moe
    from tests.hf_models import HF_FAST, assert_as, plain_loop

    cli.run(HF_FAST + MOE + [f"run_dir={tmp_path}"], cwd=tmp_path)
    kwargs = {"vocab_size": 64, "seq_len": 16, "dim": 32, "heads": 4, "experts": 4, "capacity_factor": 1.5,
              "aux_coef": 0.1}
    assert_as(tmp_path, plain_loop(build_moe, kwargs, DataConfig(task="lm", seq_len=16)))
