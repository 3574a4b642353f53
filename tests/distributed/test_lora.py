"""LoRA through PEFT (model.lora, model.peft; Note [LoRA] in parallel/models/lora.py): every strategy trains the
adapters to the numbers of the user's own PEFT loop, the base weights stay as they were, and only the adapters
hold optimizer state."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests import cli
from tests.hf_models import DATA, HF_FAST, assert_as, llama, plain_loop

# Adapters on the attention's query and value projections and the MLP's down projection: the tensor-parallel
# plan splits q and v by columns and down by rows, so both placements of an adapter are exercised.
TARGETS = ["q_proj", "v_proj", "down_proj"]
LORA = ["model=custom", "model._target_=tests.hf_models.llama", "model.lora.r=4", "model.lora.alpha=8",
        f"model.lora.targets=[{','.join(TARGETS)}]"] + DATA["llama"][0]


@functools.lru_cache(maxsize=None)
def peft_loop(pretrained: str | None = None):
    """The user's own PEFT script: seed, the model (or from_pretrained), get_peft_model, AdamW over what PEFT
    left trainable."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = llama() if pretrained is None else AutoModelForCausalLM.from_pretrained(pretrained)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    losses, _ = plain_loop(llama, {}, DATA["llama"][1], model=model)
    return losses, {k: v.detach().clone() for k, v in model.base_model.model.state_dict().items()}


def assert_as_peft(run_dir, pretrained: str | None = None) -> None:
    losses, state = peft_loop(pretrained)
    assert_as(run_dir, (losses, state))
    final = cli.final_weights(run_dir)
    torch.manual_seed(0)
    initial = (llama() if pretrained is None else AutoModelForCausalLM.from_pretrained(pretrained)).state_dict()
    for name, value in state.items():
        if "lora_B" in name:
            assert value.abs().sum() > 0, f"{name} did not train"
        if "lora_" not in name:  # the base weights: exactly as built
            torch.testing.assert_close(final[name], initial[name.replace(".base_layer", "")], rtol=0, atol=0)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_single")
    cli.run(HF_FAST + LORA + [f"run_dir={run_dir}"], cwd=run_dir)
    return run_dir


def test_single_is_the_users_peft_loop_and_keeps_state_for_the_adapters_only(single):
    assert_as_peft(single)
    adapters = sum(v.numel() for k, v in peft_loop()[1].items() if "lora_" in k)
    # AdamW's two fp32 moments per adapter weight, nothing for the frozen base.
    assert cli.metrics(single)[-1]["optim_state_bytes_per_rank"] == [2 * 4 * adapters]


def test_a_pretrained_directory_is_the_users_from_pretrained_peft_loop(hf_dirs, tmp_path):
    """model=hf: the base from the directory's weights, the adapters drawn after from_pretrained, as the
    user's script draws them."""
    args = [a for a in LORA if not a.startswith("model=") and not a.startswith("model._target_")]
    cli.run(HF_FAST + ["model=hf", f"model.path={hf_dirs['llama']}"] + args + [f"run_dir={tmp_path}"], cwd=tmp_path)
    assert_as_peft(tmp_path, hf_dirs["llama"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [["nproc=2", "strategy=pipeline"],
                                      ["nproc=2", "strategy=model"],
                                      ["strategy=offload", "strategy.params=disk", "strategy.optimizer=disk"],
                                      ["nproc=4", "strategy=hybrid", "strategy.dp=2", "strategy.pp=2"],
                                      ["strategy.activations=checkpoint", "trainer.compile=true"]],
                         ids=["pipeline", "model", "offload", "hybrid_dp2_pp2", "recomputed_compiled"])
def test_every_strategy_trains_the_adapters_as_the_peft_loop(tmp_path, strategy):
    cli.run(HF_FAST + LORA + strategy + [f"run_dir={tmp_path}"], cwd=tmp_path, timeout=240)
    assert_as_peft(tmp_path)


@pytest.mark.timeout(300)
def test_data_zero3_checkpoints_only_the_adapters_and_resumes_on_one_rank(tmp_path):
    import torch.distributed.checkpoint as dcp

    sharded, resumed = tmp_path / "zero3", tmp_path / "resumed"
    cli.run(HF_FAST + LORA + ["nproc=2", "strategy=data", "strategy.zero=3", "trainer.checkpoint_every=2",
                              f"run_dir={sharded}"], cwd=tmp_path, timeout=240)
    assert_as_peft(sharded)
    step2 = sharded / "checkpoints" / "step-000002"
    saved = dcp.FileSystemReader(str(step2)).read_metadata().state_dict_metadata
    weights = sorted(k for k in saved if k.startswith("model."))
    assert weights and all("lora_" in k or k.endswith("inv_freq") for k in weights), weights
    assert not any(".base_layer." in k or "embed_tokens" in k for k in saved)
    # Another strategy and world size (one rank, its weights on disk): the base weights from the seeded build,
    # the adapters and their state from step 2.
    cli.run(HF_FAST + LORA + ["strategy=offload", "strategy.params=disk", "strategy.optimizer=disk",
                              f"trainer.resume={step2}", f"run_dir={resumed}"], cwd=tmp_path)
    assert_as(resumed, peft_loop(), first_step=3)
    # Its export merged from the last checkpoint (adapters only): the base weights from the seeded build.
    from safetensors.torch import load_file

    from tests.e2e.test_finetune import export

    export(tmp_path, f"checkpoint={sharded / 'checkpoints' / 'step-000004'}", f"out={tmp_path / 'merged'}")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    final = cli.final_weights(sharded)
    q = "model.layers.1.self_attn.q_proj"
    delta = final[f"{q}.lora_B.default.weight"] @ final[f"{q}.lora_A.default.weight"] * 8 / 4  # alpha / r
    torch.testing.assert_close(got[f"{q}.weight"], final[f"{q}.base_layer.weight"] + delta)
    assert not any("lora_" in k or "base_layer" in k for k in got)
