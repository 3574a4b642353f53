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
