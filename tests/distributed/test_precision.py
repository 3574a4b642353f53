"""trainer.precision=bf16 (Note [mixed precision] in parallel/strategies/data.py): every strategy that takes it
trains as strategy=single does at bf16, with fp32 weights; gradients reduced in bf16 when asked.

Tolerance: a bf16 run rounds each weight to bf16 (8 bits of mantissa, ~4e-3 relative) for its matrix products
in every strategy alike, but a data-parallel rank multiplies half the batch and a tensor-parallel rank a slice
of each product, so the bf16 products round their sums at other points than single's do; the losses agree to
about 1e-3 relative, and bf16 moves them by more than that from fp32 (checked, so the test sees bf16 ran).
"""
import pytest
import torch
from omegaconf import OmegaConf

from parallel.planning.planner import plan
from parallel.validate import to_config, validate
from tests import cli

ARGS = ["data.task=regression", "model.args.depth=2"]  # test_data_parallel's: the fp32 reference is shared
BF16 = ["trainer.precision=bf16"]
RTOL = 5e-3

# name -> (strategy args, processes)
CASES = {
    "data_zero2": (["strategy=data", "strategy.zero=2"], 2),
    "data_zero3": (["strategy=data", "strategy.zero=3"], 2),
    "hybrid_dp2_tp2": (["strategy=hybrid", "strategy.dp=2", "strategy.tp=2"], 4),
    "offload": (["strategy=offload", "strategy.params=cpu", "strategy.optimizer=cpu"], 1),
}


@pytest.fixture
def single_bf16(reference):
    return reference(cli.FAST + ARGS + BF16)


def assert_close_at_bf16(run_dir, ref_dir, small_gap: float = 3e-2):
    """Losses to RTOL; the weights fp32, close by the whole model's norm and by each tensor's (`small_gap` for
    tensors of fewer than 1024 elements: biases and norms)."""
    torch.testing.assert_close(cli.losses(run_dir), cli.losses(ref_dir), rtol=RTOL, atol=0)
    got, want = cli.final_weights(run_dir), cli.final_weights(ref_dir)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.float32, name  # the master weights stay fp32
        # By each tensor's norm: AdamW moves a weight whose gradient is near zero by about lr either way, so a
        # few elements of a tensor may differ by up to 2 lr where a bf16 rounding flipped such a gradient's sign.
        # A small tensor (a bias) shows that most: ~1e-2 here, against ~2e-3 for the whole model.
        gap = ((got[name] - want[name]).norm() / want[name].norm()).item()
        assert gap < (small_gap if want[name].numel() < 1024 else 3e-2), (name, gap)
    flat = lambda state: torch.cat([state[n].flatten() for n in sorted(state)])  # noqa: E731
    assert (flat(got) - flat(want)).norm() / flat(want).norm() < 5e-3


@pytest.mark.timeout(300)
def test_single_at_bf16_is_not_the_fp32_run(reference, single_bf16):
    fp32 = reference(cli.FAST + ARGS)
    gap = (cli.losses(single_bf16) - cli.losses(fp32)).abs() / cli.losses(fp32)
    assert gap.max() > 2e-5, gap  # autocast ran: bf16 products moved the losses
    assert gap.max() < 2e-2, gap


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_matches_single_at_bf16(single_bf16, tmp_path, case):
    args, nproc = CASES[case]
    cli.run(cli.FAST + ARGS + BF16 + args + [f"nproc={nproc}", f"run_dir={tmp_path}"], cwd=tmp_path, timeout=240)
    assert_close_at_bf16(tmp_path, single_bf16)


@pytest.mark.timeout(300)
def test_gradients_reduced_in_bf16(single_bf16, tmp_path):
    """trainer.reduce_precision=bf16 under DDP (zero 0, a communication hook) and FSDP2 (zero 3, its policy):
    the same bf16 sums, and not those of the fp32 reduction."""
    runs = {}
    for zero, reduce in ((0, "bf16"), (3, "bf16"), (3, "fp32")):
        runs[zero, reduce] = run_dir = tmp_path / f"zero{zero}_{reduce}"
        cli.run(cli.FAST + ARGS + BF16 + ["nproc=2", "strategy=data", f"strategy.zero={zero}",
                                          f"trainer.reduce_precision={reduce}", f"run_dir={run_dir}"], cwd=tmp_path)
        assert_close_at_bf16(run_dir, single_bf16)
    torch.testing.assert_close(cli.losses(runs[0, "bf16"]), cli.losses(runs[3, "bf16"]), rtol=1e-4, atol=0)
    assert not torch.equal(cli.losses(runs[3, "bf16"]), cli.losses(runs[3, "fp32"]))


# test_recompute's gpt: its residual stream is fp32 between blocks under autocast (fp32 embeddings + bf16 products).
GPT = ["model=gpt", "data.task=lm", "model.args.dim=32", "model.args.heads=4", "data.seq_len=16"]


@pytest.mark.timeout(300)
def test_pipeline_stages_hand_each_other_bf16(reference, tmp_path):
    """Pipeline x2 at bf16 (Note [bf16 stages] in parallel/strategies/pipeline/stages.py): the residual crosses
    the cut in bf16, rounded once where single keeps it fp32, so the run follows single at bf16 to bf16's
    rounding (losses within 2.4e-5 relative here, the weights 9e-4 by norm; with fp32 boundaries 4.8e-5 and
    4.4e-4); the plan of the run's own config sends the boundary in bf16's bytes and holds the peak the run
    measured on each rank, to the byte."""
    ref = reference(cli.FAST + GPT + BF16)
    cli.run(cli.FAST + GPT + BF16 + ["strategy=pipeline", "nproc=2", f"run_dir={tmp_path}"], cwd=tmp_path,
            timeout=240)
    # A bias of 32 entries near zero moves by about lr a step either way, by its gradient's sign (see
    # assert_close_at_bf16), and the bf16 boundary (the residual forward, its gradient back) flips a few of
    # those signs in stage 0: blocks.0.norm2.bias differs by 0.14 of its norm (0.072), the matrices by 7e-3 at
    # most, the model by 9e-4.
    assert_close_at_bf16(tmp_path, ref, small_gap=0.25)
    cfg = to_config(OmegaConf.to_container(OmegaConf.load(tmp_path / ".hydra" / "config.yaml")))
    validate(cfg, 2)
    measured = cli.metrics(tmp_path)[-1]["mem_peak_bytes_per_rank"]
    roles = sorted(plan(cfg, 2), key=lambda p: p.rank)
    assert [p.total for p in roles] == measured
    # Stage 0 sends the residual (batch x seq_len x dim) forward, stage 1 its gradient back, each 2 bytes an
    # element: 32,768 bytes a step (65,536 with fp32 boundaries), and 4 more for the loss's token count.
    boundary = cfg.trainer.batch_size * cfg.data.seq_len * cfg.model.args["dim"] * 2
    assert [p.comm_bytes for p in roles] == [boundary + 4] * 2
