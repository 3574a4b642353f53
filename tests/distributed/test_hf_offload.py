"""Hugging Face models under offload and recomputed activations: the numbers of the user's own loop, GPT-2's head
tied to its token embedding and its dropout on (Note [random numbers] in parallel/seeding.py), also under tensor
parallelism."""
import functools

import pytest
import torch
from torch.distributed._composable import checkpoint

from parallel.config import DataConfig
from parallel.strategies.recompute import recompute_model
from tests import cli, hf_models

LM = ["data.task=lm", "data.vocab_size=64", "data.seq_len=16"]
MODELS = {  # name -> (factory, its arguments, the CLI's model arguments)
    "llama": (hf_models.llama, {}, ["model=custom", "model._target_=tests.hf_models.llama"]),
    "gpt2_dropout": (hf_models.gpt2, {"dropout": 0.1},
                     ["model=custom", "model._target_=tests.hf_models.gpt2", "+model.args.dropout=0.1"]),
}
CASES = {
    "llama_offload_activations_on_disk": ("llama", ["strategy=offload", "strategy.activations=disk",
                                                    "trainer.checkpoint_every=2"]),  # resumed below
    "llama_recomputed_data_zero3": ("llama", ["nproc=2", "strategy=data", "strategy.zero=3",
                                              "strategy.activations=checkpoint"]),
    "gpt2_dropout_offload_recomputed": ("gpt2_dropout", ["strategy=offload", "strategy.activations=checkpoint"]),
    # Tensor parallel ranks draw single's masks for the whole activations they all hold (Note [random numbers]);
    # the inferred plan splits GPT-2's MLPs, so every dropout here acts on whole activations.
    "gpt2_dropout_tensor_parallel_recomputed": ("gpt2_dropout", ["nproc=2", "strategy=model",
                                                                 "strategy.activations=checkpoint"]),
}


@functools.lru_cache(maxsize=None)
def user_loop(name: str):
    """The user's loop: build under the seed, seed again, train (single draws its dropout masks from
    `torch.manual_seed(trainer.seed)` after building: Note [random numbers])."""
    factory, kwargs, _ = MODELS[name]
    torch.manual_seed(0)
    model = factory(**kwargs)
    return hf_models.plain_loop(factory, kwargs, DataConfig(task="lm", vocab_size=64, seq_len=16), model=model)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_hf_model_trains_as_the_users_loop(tmp_path, case):
    name, args = CASES[case]
    cli.run(MODELS[name][2] + LM + hf_models.HF_FAST + args + [f"run_dir={tmp_path}"], cwd=tmp_path)
    hf_models.assert_as(tmp_path, user_loop(name))
    final = cli.final_weights(tmp_path)
    if name.startswith("gpt2"):  # the head and the token embedding are one weight, trained as one
        torch.testing.assert_close(final["lm_head.weight"], final["transformer.wte.weight"], rtol=0, atol=0)
    if "trainer.checkpoint_every=2" in args:  # resumed at step 2 (rotary buffers are not saved): the same run
        resumed, step2 = tmp_path / "resumed", tmp_path / "checkpoints" / "step-000002"
        cli.run(MODELS[name][2] + LM + hf_models.HF_FAST + args + [f"trainer.resume={step2}", f"run_dir={resumed}"],
                cwd=tmp_path)
        torch.testing.assert_close(cli.losses(resumed), cli.losses(tmp_path)[2:], rtol=0, atol=0)
        for key, value in cli.final_weights(resumed).items():
            torch.testing.assert_close(value, final[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


def test_recomputation_and_offload_take_the_decoder_layers_one_by_one():
    with torch.device("meta"):
        model = hf_models.llama(layers=2)
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")  # one batch of data.task=lm, seq_len 16
    recompute_model(model, tokens)  # the blocks offload streams are the same candidates (parallel.blocks)
    assert all(checkpoint.state(layer) is not None for layer in model.model.layers)
