"""The fine-tuning walk-through of docs/fine-tuning.md, run as a user runs it: a pretrained Hugging Face
directory, LoRA on the attention projections, the user's own dataset, data zero 3 on 2 ranks, the export merged
and as an adapter, each loaded back with from_pretrained (Note [LoRA], Note [export names])."""
from __future__ import annotations

import pytest
import torch

from tests import cli

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPORT = str(cli.ROOT / "launch" / "export.py")


def export(cwd, *args: str) -> None:
    proc = cli.run_script(EXPORT, list(args), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """(the pretrained directory, the run directory) of the walk-through's training."""
    from tests.hf_models import llama

    root = tmp_path_factory.mktemp("finetune")
    torch.manual_seed(1)
    llama(vocab_size=16, seq_len=6).save_pretrained(root / "base")  # tests.user_data.Tokens: 16 ids, 6 long
    run = root / "run"
    cli.run(["nproc=2", "strategy=data", "strategy.zero=3", "model=hf", f"model.path={root / 'base'}",
             "model.lora.r=4", "model.lora.alpha=8", f"model.lora.targets=[{','.join(TARGETS)}]",
             "data=custom", "data._target_=tests.user_data.Tokens", "data.workers=0", "trainer.batch_size=8",
             "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.save_final=true", "trainer.progress=false",
             "trainer.log_every=1", f"run_dir={run}"], cwd=root, timeout=240)
    return root / "base", run


def peft_model(base, final: dict):
    """The user's PEFT model holding the run's final weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    model.base_model.model.load_state_dict(final)
    return model


@pytest.mark.timeout(300)
def test_a_merged_export_is_peft_merge_and_unload_and_loads_with_from_pretrained(finetuned, tmp_path):
    from transformers import AutoModelForCausalLM

    base, run = finetuned
    final = cli.final_weights(run)
    export(tmp_path, f"checkpoint={run}", f"out={tmp_path / 'merged'}")
    # From the step-4 checkpoint (adapters only): the base weights read from the pretrained directory.
    export(tmp_path, f"checkpoint={run / 'checkpoints' / 'step-000004'}", f"out={tmp_path / 'from_checkpoint'}")
    expected = peft_model(base, final).merge_and_unload().state_dict()
    for out in ("merged", "from_checkpoint"):
        got = AutoModelForCausalLM.from_pretrained(tmp_path / out).state_dict()
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=f"{out}: {name}")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(expected[q], AutoModelForCausalLM.from_pretrained(base).state_dict()[q])  # trained


@pytest.mark.timeout(300)
def test_an_adapter_export_loads_with_peft_model_from_pretrained(finetuned, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, run = finetuned
    final = cli.final_weights(run)
    export(tmp_path, f"checkpoint={run}", f"out={tmp_path / 'adapter'}", "lora=adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    got = loaded.base_model.model.state_dict()
    for name, value in final.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, peft_model(base, final)(input_ids=ids).logits)
