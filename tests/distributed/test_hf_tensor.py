"""strategy=model (tensor parallelism) and strategy=hybrid (dp x tp) on Hugging Face models train exactly as
the user's own plain PyTorch loop (tests.hf_models.plain_loop): Llama by its own plan (grouped-query
attention, a vocabulary-split embedding; and with sequence and loss parallelism), Qwen3 by its own plan (its
per-head norms' gradients summed; with loss parallelism), GPT-2 by an inferred plan over its Conv1D layers,
BERT by an inferred plan, each on 2 ranks; Llama on dp2 x tp2."""
import pytest

from tests import cli
from tests.hf_models import DATA, HF_FAST, args, assert_as_plain

TP2 = ["nproc=2", "strategy=model"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model", ["gpt2", "bert_classifier"])
def test_inferred_plan_trains_as_the_users_own_loop(tmp_path, model):
    proc = cli.run(args(model) + TP2 + [f"run_dir={tmp_path}"], cwd=tmp_path)
    assert "inferred tensor-parallel plan" in proc.stdout + proc.stderr
    assert_as_plain(tmp_path, model)


@pytest.mark.timeout(180)
def test_llama_own_plan_from_a_directory_trains_as_from_pretrained(tmp_path, hf_dirs):
    """model=hf: Llama's own plan (q, k, v colwise with 4 heads and 2 kv heads: 2 and 1 per rank; the
    embedding split by vocabulary), each rank reading its pieces of the directory's weights."""
    run = HF_FAST + ["model=hf", f"model.path={hf_dirs['llama']}"] + DATA["llama"][0] + TP2
    proc = cli.run(run + [f"run_dir={tmp_path}"], cwd=tmp_path)
    assert "own (Hugging Face) tensor-parallel plan" in proc.stdout + proc.stderr
    assert_as_plain(tmp_path, "llama", pretrained=hf_dirs["llama"])


@pytest.mark.timeout(180)
def test_qwen3_own_plan_with_loss_parallelism_trains_as_the_users_own_loop(tmp_path):
    """Qwen3's own plan: q_norm and k_norm, applied to each rank's own heads, whole with their gradients summed
    over the ranks (replicated_with_grad_allreduce, here replicate_grads); the first step's check of the weights
    left whole passes, and every weight, the norms' included, ends as the plain loop's. With
    strategy.loss_parallel=true (Note [loss parallelism]): the logits split by the vocabulary, the
    cross-entropy on the pieces."""
    proc = cli.run(args("qwen3") + TP2 + ["strategy.loss_parallel=true", f"run_dir={tmp_path}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "q_norm:replicate_grads" in out and "lm_head:colwise_loss" in out
    assert_as_plain(tmp_path, "qwen3")


@pytest.mark.timeout(240)
def test_llama_hybrid_dp2_tp2_trains_as_the_users_own_loop(tmp_path):
    cli.run(args("llama") + ["nproc=4", "strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.zero=3",
                             f"run_dir={tmp_path}"], cwd=tmp_path, timeout=220)
    assert_as_plain(tmp_path, "llama")


@pytest.mark.timeout(180)
def test_sequence_and_loss_parallel_on_llamas_own_plan_train_as_the_users_own_loop(tmp_path):
    """strategy.sequence_parallel=true on the model's own plan (Note [sequence parallelism for a model's own
    plan]): the residual stream between the projections cut by the sequence over the 2 ranks, the norms on the
    shards (their weights' gradients summed), the rotary tables and the causal mask of the whole sequence; with
    strategy.loss_parallel=true the head's logits split by the vocabulary over the sequence it gathers."""
    proc = cli.run(args("llama") + TP2 + ["strategy.sequence_parallel=true", "strategy.loss_parallel=true",
                                          f"run_dir={tmp_path}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "model.layers.0:seq_split" in out and "lm_head:colwise_seq_loss" in out
    assert_as_plain(tmp_path, "llama")
