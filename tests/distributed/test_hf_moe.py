"""A pretrained Hugging Face mixture-of-experts model (tests/hf_models.py mixtral, saved by save_pretrained with one
tensor per expert, which transformers 5 fuses as it loads: Note [checkpoint conversion]) trains as `model=hf`
under single, data zero 3, pipeline, expert parallelism and offload as the user's own loop started from
`torch.manual_seed(0); AutoModelForCausalLM.from_pretrained(dir)` (one reference run, shared): its fake
passes take the real run's grouped products (Note [grouped matmul on fake tensors]), its fused experts split
over ep (Note [Hugging Face experts over ep]). Qwen3-MoE (per-expert checkpoint, q and k norms) and GPT-OSS
(fused, biased, interleaved experts; attention sinks) each under the strategy that cuts them most, and
Mixtral's adapters as the user's own PEFT loop trains them."""
import pytest
import torch

from tests import cli, hf_models
from tests.hf_models import DATA, HF_FAST, assert_as, mixtral, plain_from_pretrained, plain_loop

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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model, strategy", [("qwen3_moe", "pipeline"), ("gpt_oss", "expert")])
def test_other_pretrained_moe_families_train_as_the_users_loop(tmp_path, model, strategy):
    torch.manual_seed(1)
    getattr(hf_models, model)().save_pretrained(tmp_path / "dir")
    run = HF_FAST + ["model=hf", f"model.path={tmp_path / 'dir'}", "model.strict=true"] + DATA[model][0]
    cli.run(run + STRATEGIES[strategy] + [f"run_dir={tmp_path}"], cwd=tmp_path, timeout=180)
    assert_as(tmp_path, plain_from_pretrained(str(tmp_path / "dir"), "AutoModelForCausalLM"))


@pytest.mark.timeout(240)
def test_mixtrals_adapters_train_as_the_users_peft_loop_under_data_zero3(tmp_path, mixtral_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,v_proj]"]
    run = HF_FAST + ["model=hf", f"model.path={mixtral_dir}"] + lora + DATA["mixtral"][0]
    cli.run(run + STRATEGIES["data_zero3"] + [f"run_dir={tmp_path}"], cwd=tmp_path, timeout=180)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(mixtral_dir)
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    losses, _ = plain_loop(None, {}, DATA["mixtral"][1], model=peft)
    state = {k: v.detach() for k, v in peft.base_model.model.state_dict().items()}
    assert_as(tmp_path, (losses, state))
    final = cli.final_weights(tmp_path)
    for name, value in state.items():
        if "lora_" not in name:  # the experts and every other base weight stay as loaded
            torch.testing.assert_close(final[name], initial[name.replace(".base_layer", "")], rtol=0, atol=0)
