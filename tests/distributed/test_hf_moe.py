"""A pretrained Hugging Face mixture-of-experts model (tests/hf_models.py mixtral, saved by save_pretrained with one
tensor per expert, which transformers 5 fuses as it loads: Note [checkpoint conversion]) trains as `model=hf`
under single, data zero 3, pipeline, expert parallelism and offload as the user's own loop started from
`torch.manual_seed(0); AutoModelForCausalLM.from_pretrained(dir)` (one reference run, shared): its fake
passes take the real run's grouped products (Note [grouped matmul on fake tensors]), its fused experts split
over ep (Note [Hugging Face experts over ep])."""
import pytest
import torch

from tests import cli
from tests.hf_models import DATA, HF_FAST, assert_as, mixtral, plain_from_pretrained

STRATEGIES = {"single": [], "data_zero3": ["nproc=2", "strategy=data", "strategy.zero=3"],
              "pipeline": ["nproc=2", "strategy=pipeline"], "expert": ["nproc=2", "strategy=expert"],
              "offload": ["strategy=offload"]}


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(1)  # not the run's seed: a run that did not load them would start elsewhere
    mixtral().save_pretrained(path)
    return str(path)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_pretrained_mixtral_trains_as_the_users_loop(tmp_path, mixtral_dir, strategy):
    run = HF_FAST + ["model=hf", f"model.path={mixtral_dir}", "model.strict=true"] + DATA["mixtral"][0]
    cli.run(run + STRATEGIES[strategy] + [f"run_dir={tmp_path}"], cwd=tmp_path, timeout=180)
    assert_as(tmp_path, plain_from_pretrained(mixtral_dir, "AutoModelForCausalLM"))
    if strategy == "expert":  # each rank held half of the experts (2 layers x 4 experts x 3 x 64 x 32 floats)
        held = cli.metrics(tmp_path)[-1]["param_bytes_per_rank"]
        whole = sum(v.numel() * 4 for v in cli.final_weights(tmp_path).values())
        assert held == [whole - 2 * 2 * 3 * 64 * 32 * 4] * 2
