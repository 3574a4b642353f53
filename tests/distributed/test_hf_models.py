"""Models as users bring them (tests/hf_models.py: Hugging Face Llama, GPT-2 and BERT built from configs, a
BatchNorm CNN, a hand-written model with bare parameters and a tie) train under the strategies exactly as the
user's own plain PyTorch loop does: same initial weights (model.init=module), same batches, AdamW; pretrained
directories load into sharded strategies; a checkpoint saved under one strategy resumes under another."""
import pytest

from tests import cli
from tests.hf_models import DATA, HF_FAST, args, assert_as_plain

SINGLE = ["llama", "gpt2", "bert_classifier", "batchnorm_cnn", "bare"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model", SINGLE)
def test_single_is_the_users_own_loop(reference, model):
    assert_as_plain(reference(args(model)), model)


ZERO3 = ["nproc=2", "strategy=data", "strategy.zero=3"]
RUNS = [("llama", ZERO3), ("llama", ["strategy=offload"]), ("gpt2", ZERO3), ("gpt2", ["strategy=offload"]),
        ("bert_classifier", ZERO3), ("bare", ZERO3), ("bare", ["strategy=offload"]),
        ("bare", ["nproc=2", "strategy=pipeline"]),
        ("bare", ["nproc=2", "strategy=model", "strategy.tp_plan=[blocks.*.1:colwise_gather]"])]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,strategy", RUNS, ids=[f"{m}:{' '.join(s)}" for m, s in RUNS])
def test_every_strategy_is_the_users_own_loop(tmp_path, model, strategy):
    cli.run(args(model) + strategy + [f"run_dir={tmp_path}"], cwd=tmp_path)
    assert_as_plain(tmp_path, model)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", [ZERO3], ids=["data_zero3"])
def test_pretrained_directory_trains_as_from_pretrained(tmp_path, hf_dirs, strategy):
    """model=hf loads the directory's weights (each rank its pieces): the run equals the plain loop started
    from `from_pretrained` on one process."""
    run = HF_FAST + ["model=hf", f"model.path={hf_dirs['llama']}"] + DATA["llama"][0] + strategy
    cli.run(run + [f"run_dir={tmp_path}"], cwd=tmp_path)
    assert_as_plain(tmp_path, "llama", pretrained=hf_dirs["llama"])


@pytest.mark.timeout(240)
def test_checkpoint_of_a_sharded_hf_model_resumes_on_one_process(tmp_path):
    """Saved at step 2 under data zero 3 on 2 ranks, resumed under single: steps 3 and 4 and the final weights
    are the plain loop's."""
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    cli.run(args("llama") + ZERO3 + ["trainer.checkpoint_every=2", f"run_dir={saved}"], cwd=tmp_path)
    cli.run(args("llama") + [f"trainer.resume={saved}/checkpoints/step-000002", f"run_dir={resumed}"],
            cwd=tmp_path)
    assert_as_plain(resumed, "llama", first_step=3)
