"""strategy=pipeline under every schedule trains to the same numbers as strategy=single."""
import pytest

from parallel.strategies.pipeline.schedules import SCHEDULES
from tests import cli

MLP = ["model.args.depth=2"]  # inp, 2 blocks, head: enough for 4 stages on 2 ranks


@pytest.fixture
def single(reference):
    return reference(cli.FAST + MLP)


def pipeline_run(tmp_path, args, nproc=2):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cli.run(cli.FAST + args + [f"nproc={nproc}", "strategy=pipeline", f"run_dir={tmp_path}"], cwd=tmp_path,
            timeout=240)
    return tmp_path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_on_two_ranks_matches_single(single, tmp_path, schedule):
    run = pipeline_run(tmp_path, MLP + [f"strategy.schedule={schedule}"])
    cli.assert_same_training(run, single)
    last = cli.metrics(run)[-1]
    for key in ("bubble_measured", "bubble_analytic", "stage_imbalance"):
        assert key in last
    assert 0 <= last["bubble_measured"] < 1 and 0 <= last["bubble_analytic"] < 1
    assert len(last["mem_peak_bytes_per_rank"]) == 2 and min(last["mem_peak_bytes_per_rank"]) > 0
    assert len(last["stage_time_s_per_stage"]) == (2 if schedule in ("GPipe", "1F1B") else 4)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_four_ranks_match_single(reference, tmp_path, schedule):
    deep = ["model.args.depth=6"]  # 8 blocks: 8 stages for the interleaved schedule
    ref = reference(cli.FAST + deep)
    run = pipeline_run(tmp_path / "pp", deep + [f"strategy.schedule={schedule}"], nproc=4)
    cli.assert_same_training(run, ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_skip_connection_across_stages(reference, tmp_path, schedule):
    model = ["model=custom", "model._target_=tests.user_model.skip_net"]
    ref = reference(cli.FAST + model)
    run = pipeline_run(tmp_path / "pp", model + [f"strategy.schedule={schedule}"])
    cli.assert_same_training(run, ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_tied_embedding_and_head_with_token_ids(reference, tmp_path, schedule):
    """The embedding (first stage) and head (last stage) share one matrix; with ZBV
    both stages sit on rank 0, with 1F1B on different ranks."""
    gpt = ["model=gpt", "data.task=lm", "model.args.tie_embeddings=true", "model.args.layers=2",
           "model.args.dim=32", "data.seq_len=16"]
    ref = reference(cli.FAST + gpt)
    run = pipeline_run(tmp_path / "pp", gpt + [f"strategy.schedule={schedule}"])
    cli.assert_same_training(run, ref)
    final = cli.final_weights(run)
    assert (final["tok.weight"] == final["head.weight"]).all()


@pytest.mark.timeout(200)
def test_given_split_points_are_used(tmp_path):
    run = pipeline_run(tmp_path, MLP + ["strategy.split_points=[blocks.1]", "trainer.progress=false"])
    log = (run / "logs" / "rank0.log").read_text()
    assert "inp .. blocks.0" in log and "blocks.1 .. head" in log


DICT_LAYERS = ["model=custom", "model._target_=tests.user_model.dict_layers"]
# test_tensor_parallel's titan_fused_qkv_inferred case: the same reference run
TITAN = ["model=custom", "model._target_=tests.user_model.titan_llama", "data.task=lm", "data.seq_len=16"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", ["balanced", "given"])
def test_layers_in_a_module_dict_split_into_stages(reference, tmp_path, split):
    """torchtitan's layout: the layers in an nn.ModuleDict ("0".."3") are blocks of their own, so the stages
    split between them (they went whole to the first stage) and a split point may name one; the partition
    table's parameter counts are what each stage holds (param_bytes_per_rank), and the run is single's."""
    # Balanced by parameter counts, not by timed blocks: a busy machine must not move the split.
    given = ["strategy.split_points=[layers.2]"] if split == "given" else ["strategy.balance=params"]
    run = pipeline_run(tmp_path, DICT_LAYERS + given)
    cli.assert_same_training(run, reference(cli.FAST + DICT_LAYERS))
    log = (run / "logs" / "rank0.log").read_text()
    assert "inp .. layers.1" in log and "layers.2 .. head" in log, log
    rows = [line.split() for line in log.splitlines() if " .. " in line]
    counts = [int(row[-3].replace(",", "")) for row in rows[-2:]]
    assert [4 * c for c in counts] == cli.metrics(run)[-1]["param_bytes_per_rank"]


@pytest.mark.timeout(300)
def test_torchtitan_fused_attention_saved_by_stock_names_traces_into_stages(reference, tmp_path):
    """torchtitan's fused wqkv, saved as wq, wk and wv by state-dict hooks, is a weight of its stage, not an input
    nothing feeds (Note [fused projections traced]); the layers in a ModuleDict take the model's freqs_cis buffer
    and two more arguments. The stages hold wqkv by its own name: the final weights are single's."""
    run = pipeline_run(tmp_path, TITAN + ["+model.args.stock_names=true"])
    cli.assert_same_training(run, reference(cli.FAST + TITAN))
