"""strategy=pipeline on Hugging Face models (tests/hf_models.py) trains as the user's own plain loop: Llama
(rotary embeddings, grouped-query attention), GPT-2 (output head tied to the token embedding across stages)
and a BERT classifier (encoder, pooler, head), split at their nested decoder / encoder blocks."""
import pytest

from tests import cli
from tests.hf_models import DATA, HF_FAST, args, assert_as_plain

PIPE = ["nproc=2", "strategy=pipeline"]


def pipeline_run(tmp_path, model: str, extra: list[str]):
    cli.run(args(model) + PIPE + extra + [f"run_dir={tmp_path}"], cwd=tmp_path, timeout=150)
    return tmp_path


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model", ["llama", "gpt2", "bert_classifier"])
def test_1f1b_balanced_is_the_users_own_loop(tmp_path, model):
    run = pipeline_run(tmp_path, model, ["strategy.schedule=1F1B"])
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
