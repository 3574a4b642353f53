"""strategy=pipeline on Hugging Face models (tests/hf_models.py) trains as the user's own plain loop: Llama
(rotary embeddings, grouped-query attention), GPT-2 (output head tied to the token embedding across stages),
both with their configs' default use_cache=True, and a BERT classifier (encoder, pooler, head), split at their
nested decoder / encoder blocks; and Llama under
strategy=hybrid, dp 2 x pp 2 with ZeRO-3 over its traced blocks (Note [own or traced blocks] in
parallel/strategies/pipeline/stages.py): trained, resumed on one process, and planned; and pp 2 x tp 2, its own
(Hugging Face) plan applied to the traced blocks (Note [tensor parallelism over traced blocks] in
parallel/strategies/tensor/traced.py): trained and planned, and from a pretrained directory under Interleaved1F1B."""
import pytest

from parallel.config import Config
from parallel.planning.planner import plan
from parallel.validate import resolve
from tests import cli
from tests.hf_models import DATA, HF_FAST, args, assert_as_plain

PIPE = ["nproc=2", "strategy=pipeline"]
DP2_PP2 = ["strategy=hybrid", "strategy.dp=2", "strategy.pp=2", "strategy.zero=3"]
PP2_TP2 = ["nproc=4", "strategy=hybrid", "strategy.dp=1", "strategy.pp=2", "strategy.tp=2"]


def pipeline_run(tmp_path, model: str, extra: list[str]):
    cli.run(args(model) + PIPE + extra + [f"run_dir={tmp_path}"], cwd=tmp_path, timeout=150)
    return tmp_path


# Llama and GPT-2 come from `_target_` factories with their configs' defaults (use_cache=True, as a user writes
# `LlamaForCausalLM(LlamaConfig(...))`): they get model=hf's handling, the cache off (Note [Hugging Face
# models for training]), and train as the plain loop (the cache changes no value).
@pytest.mark.timeout(180)
@pytest.mark.parametrize("model", ["llama", "gpt2", "bert_classifier"])
def test_1f1b_balanced_is_the_users_own_loop(tmp_path, model):
    cache = ["+model.args.use_cache=true"] if model in ("llama", "gpt2") else []
    run = pipeline_run(tmp_path, model, ["strategy.schedule=1F1B"] + cache)
    assert_as_plain(run, model)
    if model == "gpt2":  # the head (last stage) and the embedding (first stage) stayed one weight
        final = cli.final_weights(run)
        assert (final["lm_head.weight"] == final["transformer.wte.weight"]).all()


@pytest.mark.timeout(180)
def test_pretrained_llama_interleaved_at_given_split_points(tmp_path, hf_dirs):
    """model=hf from a directory, four stages on two ranks cut where the user says (rotary embeddings and the
    mask cross three times): the plain loop started from `from_pretrained`."""
    points = "[model.layers.0,model.layers.1,model.norm]"
    run = HF_FAST + ["model=hf", f"model.path={hf_dirs['llama']}"] + DATA["llama"][0] + PIPE + [
        "strategy.schedule=Interleaved1F1B", f"strategy.split_points={points}", f"run_dir={tmp_path}"]
    cli.run(run, cwd=tmp_path, timeout=150)
    assert_as_plain(tmp_path, "llama", pretrained=hf_dirs["llama"])
    log = (tmp_path / "logs" / "rank0.log").read_text()  # the partition printed at start
    assert "model.embed_tokens .. model.rotary_emb" in log and "model.norm .. lm_head" in log


@pytest.fixture(scope="module")
def dp2_pp2(tmp_path_factory):
    """Llama on 4 ranks, dp 2 x pp 2, ZeRO-3, its traced blocks recomputed in backward, a checkpoint at step 2."""
    run_dir = tmp_path_factory.mktemp("dp2_pp2")
    cli.run(args("llama") + DP2_PP2 + ["nproc=4", "strategy.activations=checkpoint", "trainer.checkpoint_every=2",
                                       f"run_dir={run_dir}"], cwd=run_dir, timeout=200)
    return run_dir


@pytest.mark.timeout(240)
def test_llama_hybrid_dp2_pp2_zero3_is_the_users_own_loop(dp2_pp2):
    assert_as_plain(dp2_pp2, "llama")
    # Every weight is held once over the 4 ranks: each stage's sharded over its 2 dp ranks by FSDP2.
    held = cli.metrics(dp2_pp2)[-1]["param_bytes_per_rank"]
    assert sum(held) == 4 * sum(v.numel() for v in cli.final_weights(dp2_pp2).values())
    assert held[0] == held[2] and held[1] == held[3]


@pytest.mark.timeout(120)
def test_checkpoint_at_dp2_pp2_resumes_on_single(dp2_pp2, tmp_path):
    """Saved at step 2 by two sharded stages, resumed on one process (the checkpoint holds the unpartitioned
    names): steps 3-4 and the final weights are the plain loop's."""
    cli.run(args("llama") + [f"trainer.resume={dp2_pp2}/checkpoints/step-000002", f"run_dir={tmp_path}"],
            cwd=tmp_path)
    assert_as_plain(tmp_path, "llama", first_step=3)


@pytest.mark.timeout(120)
def test_plan_of_dp2_pp2_is_within_10_percent_of_the_run(dp2_pp2):
    """The planner (in this process, on fake tensors) builds the same traced, sharded stages: each role's peak
    is that of the run's second step (the planner's: it holds the optimizer state the first made)."""
    assert_planned(dp2_pp2, dp=2, zero=3, activations="checkpoint")


def assert_planned(run_dir, **strategy) -> None:
    """Each role's planned peak (custom Llama, `strategy` on 4 ranks) within 10% of the run's second step's."""
    cfg = Config()
    cfg.model.name, cfg.model._target_ = "custom", "tests.hf_models.llama"
    cfg.data.task, cfg.data.seq_len, cfg.trainer.batch_size = "lm", 16, 8
    cfg.strategy.name, cfg.strategy.pp = "hybrid", 2
    for k, v in strategy.items():
        setattr(cfg.strategy, k, v)
    resolve(cfg, 4)  # the degrees and microbatches (the run's config check has passed)
    measured = cli.metrics(run_dir)[1]["mem_peak_bytes_per_rank"]
    roles = plan(cfg, 4)
    assert sorted(r for p in roles for r in p.same_as) == [0, 1, 2, 3]
    for p in roles:
        for r in p.same_as:
            assert abs(p.total / measured[r] - 1) <= 0.10, (r, p.total, measured[r])


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory):
    """Llama on 4 ranks, pp 2 x tp 2: each stage's traced layers split by Llama's own plan."""
    run_dir = tmp_path_factory.mktemp("pp2_tp2")
    cli.run(args("llama") + PP2_TP2 + [f"run_dir={run_dir}"], cwd=run_dir, timeout=200)
    return run_dir


@pytest.mark.timeout(240)
def test_llama_hybrid_pp2_tp2_is_the_users_own_loop(pp2_tp2):
    assert_as_plain(pp2_tp2, "llama")
    # Each stage's weights are split over its 2 tp ranks, but the norms', whole on both.
    held, final = cli.metrics(pp2_tp2)[-1]["param_bytes_per_rank"], cli.final_weights(pp2_tp2)
    norms = sum(v.numel() for k, v in final.items() if "norm" in k)
    assert held[0] == held[1] and held[2] == held[3]
    assert sum(held) == 4 * (sum(v.numel() for v in final.values()) + norms)


@pytest.mark.timeout(120)
def test_plan_of_pp2_tp2_is_within_10_percent_of_the_run(pp2_tp2):
    assert_planned(pp2_tp2, dp=1, tp=2)


@pytest.mark.timeout(180)
def test_pretrained_llama_pp2_tp2_interleaved(tmp_path, hf_dirs):
    """model=hf from a directory, four stages on the two pipeline ranks of each tp pair: its weights loaded
    into each rank's pieces, the plain loop started from `from_pretrained`."""
    points = "[model.layers.0,model.layers.1,model.norm]"
    run = HF_FAST + ["model=hf", f"model.path={hf_dirs['llama']}"] + DATA["llama"][0] + PP2_TP2 + [
        "strategy.schedule=Interleaved1F1B", f"strategy.split_points={points}", f"run_dir={tmp_path}"]
    cli.run(run, cwd=tmp_path, timeout=150)
    assert_as_plain(tmp_path, "llama", pretrained=hf_dirs["llama"])
