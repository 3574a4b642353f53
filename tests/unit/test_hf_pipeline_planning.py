"""Pipeline planning on Hugging Face models without processes: their nested blocks are found (the built-in
models' blocks unchanged), and what cannot be pipelined is a config error that says why."""
import pytest
import torch

from parallel.blocks import block_names, candidates
from parallel.config import Config, ConfigError
from parallel.models import MODELS
from parallel.validate import validate
from tests import hf_models

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)


def test_hf_blocks_are_the_nested_ones_in_forward_order():
    expected = {
        "llama": ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm",
                  "lm_head"],
        "gpt2": ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
                 "transformer.ln_f", "lm_head"],
        "bert_classifier": ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "bert.pooler",
                            "dropout", "classifier"],
    }
    for name, blocks in expected.items():
        with torch.device("meta"):
            model = getattr(hf_models, name)()
        names, inputs = candidates(model, TOKENS)
        assert names == blocks, name
        if name == "llama":  # every layer is given the rotary embeddings (cos, sin) computed once before them
            cos, sin = inputs["model.layers.1"][1]["position_embeddings"]
            assert cos.shape == sin.shape == (1, 16, 8)


def test_builtin_blocks_are_unchanged():
    expected = {"mlp": ["inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"],
                "gpt": ["tok", "pos", "blocks.0", "blocks.1", "norm", "head"],
                "cnn": ["blocks.0", "blocks.1", "head"],
                "stacked": ["frozen.0", "frozen.1", "frozen.2", "head.0", "head.1", "head.2"],
                "local": ["conv", "local", "head"]}
    for name, blocks in expected.items():
        with torch.device("meta"):
            model = MODELS[name]()
        assert block_names(model) == blocks, name


def _cfg(factory: str, strategy: dict, **args) -> Config:
    cfg = Config()
    cfg.strategy.name = strategy.pop("name", "pipeline")
    cfg.model.name, cfg.model._target_, cfg.model.args = "custom", f"tests.hf_models.{factory}", args
    cfg.data.task, cfg.data.seq_len, cfg.trainer.batch_size = "lm", 16, 8
    for k, v in strategy.items():
        setattr(cfg.strategy, k, v)
    return cfg


BAD = [
    ({"split_points": ["model.rotary_emb"]}, {}, r"strategy.split_points.*integer tensors.*valid: \['model.layers.0'"),
    ({}, {"output_hidden_states": True}, r"strategy=pipeline: the model must return one tensor \(its logits\), not"),
    ({"schedule": "Interleaved1F1B", "stages_per_rank": 4, "microbatches": 8}, {"layers": 1},
     r"strategy.pp=2 x stages_per_rank=4: 8 stages, but LlamaForCausalLM has only 5 blocks"),
    ({"name": "hybrid", "pp": 2, "tp": 1, "dp": 1}, {}, r"strategy='hybrid'.*sit inside other modules"),
]


@pytest.mark.parametrize("strategy,args,message", BAD, ids=["integers", "outputs", "blocks", "hybrid"])
def test_what_cannot_be_pipelined_is_a_config_error(strategy, args, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg("llama", dict(strategy), **args), world_size=2)
