"""strategy=model (tensor parallelism) trains to the same numbers as strategy=single."""
import pytest

from tests import cli

CASES = {
    "mlp": ["model.args.depth=2"],
    "gpt": ["model=gpt", "data.task=lm", "model.args.dim=32", "model.args.heads=4", "data.seq_len=16"],
    "gpt_sequence_parallel": ["model=gpt", "data.task=lm", "model.args.dim=32", "model.args.heads=4",
                              "data.seq_len=16", "strategy.sequence_parallel=true"],
    "user_plan": ["model=custom", "model._target_=tests.user_model.feed_forwards",
                  "strategy.tp_plan=[pairs.*.up:colwise,pairs.*.down:rowwise]"],
    "user_inferred_plan": ["model=custom", "model._target_=tests.user_model.feed_forwards"],
    # SwiGLU's gate and up both colwise, down rowwise (an inferred plan)
    "swiglu_inferred": ["model=custom", "model._target_=tests.user_model.swiglu"],
    # A norm over each head's features after a colwise q, whole with its gradient summed (Note [weights left whole])
    "head_norm_summed": ["model=custom", "model._target_=tests.user_model.head_norm",
                         "strategy.tp_plan=[q:colwise,norm:replicate_grads,o:rowwise]"],
    # torchtitan's Llama 3 with a fused wqkv and grouped-query attention: inferred, the SwiGLU feed-forwards are
    # split and the attention (a view and a split after wqkv) left whole (its reference is test_pipeline's too)
    "titan_fused_qkv_inferred": ["model=custom", "model._target_=tests.user_model.titan_llama", "data.task=lm",
                                 "data.seq_len=16"],
}
TP_ONLY = ("tp_plan", "sequence_parallel")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_model_parallel_on_two_ranks_matches_single(reference, tmp_path, case):
    args = CASES[case]
    ref = reference(cli.FAST + [a for a in args if not any(k in a for k in TP_ONLY)])
    tp = tmp_path / "tp"
    cli.run(cli.FAST + args + ["nproc=2", "strategy=model", f"run_dir={tp}"], cwd=tmp_path)
    cli.assert_same_training(tp, ref)
    # One rank logs: the run has one metrics file whose memory covers both ranks.
    assert len(cli.metrics(tp)[-1]["mem_peak_bytes_per_rank"]) == 2
    if case == "gpt":
        check_throughput(tp, ref, tokens_per_step=32 * 16)


def check_throughput(run_dir, ref_dir, tokens_per_step: int) -> None:
    """Per logged step (Note [throughput]): tokens/s, TFLOP/s per rank and MFU from the same record's step time;
    the model's FLOPs per step are the same whatever the strategy (here tp 2 and single)."""
    for path, world in ((run_dir, 2), (ref_dir, 1)):
        for r in cli.metrics(path):
            assert r["tokens_per_s"] == pytest.approx(tokens_per_step / r["step_time_s"], rel=1e-12)
            assert r["tflops_per_rank"] == pytest.approx(r["flops_per_step"] / world / r["step_time_s"] / 1e12,
                                                         rel=1e-12)
            assert 0 < r["mfu"] <= 1
    assert cli.metrics(run_dir)[-1]["flops_per_step"] == cli.metrics(ref_dir)[-1]["flops_per_step"]


@pytest.mark.timeout(120)
def test_a_weight_left_whole_on_sharded_activations_stops_the_first_step(tmp_path):
    """The same plan without replicate_grads: the norm, left whole, sees each rank's own heads, so each rank holds
    part of its gradient; the first step stops the run in one line naming it, before any weight moves (Note
    [weights left whole]). The loss would match single's to 1e-5 and the norm's weight drift in silence."""
    proc = cli.run(cli.FAST + ["model=custom", "model._target_=tests.user_model.head_norm", "nproc=2",
                               "strategy=model", "strategy.tp_plan=[q:colwise,o:rowwise]", f"run_dir={tmp_path}"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith("error: tensor parallelism: 1 weight(s) left whole get different gradients on the 2 "
                           "ranks of their tp group at the first step"), line
    assert "relative): norm.weight; each" in line and "'norm:replicate_grads'" in line, line
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "final_model.pt").exists() and not cli.metrics(tmp_path)
