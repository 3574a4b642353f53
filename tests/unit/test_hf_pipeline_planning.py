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
    cfg.trainer.compile = strategy.pop("compile", False)
    for k, v in strategy.items():
        setattr(cfg.strategy, k, v)
    return cfg


BAD = [
    ({"split_points": ["model.rotary_emb"]}, {}, r"strategy.split_points.*integer tensors.*valid: \['model.layers.0'"),
    ({}, {"output_hidden_states": True}, r"strategy=pipeline: the model must return one tensor \(its logits\), not"),
    ({"schedule": "Interleaved1F1B", "stages_per_rank": 4, "microbatches": 8}, {"layers": 1},
     r"strategy.pp=2 x stages_per_rank=4: 8 stages, but LlamaForCausalLM has only 5 blocks"),
    ({"compile": True}, {}, r"trainer.compile=True: compiles the model's own blocks; LlamaForCausalLM's blocks "
                            r"sit inside other modules \(model.layers.0, model.layers.1, ...\).*trainer.compile=false"),
]


@pytest.mark.parametrize("strategy,args,message", BAD, ids=["integers", "outputs", "blocks", "compile"])
def test_what_cannot_be_pipelined_is_a_config_error(strategy, args, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg("llama", dict(strategy), **args), world_size=2)


# Nested blocks run traced in hybrid's stages (Note [own or traced blocks]): what needs the model's own block
# code is refused, on 4 ranks; dp x pp and tp x pp are not (tests/distributed/test_hf_pipeline.py trains them),
# but for what tensor parallelism cannot do over traced blocks (Note [tensor parallelism over traced blocks]).
TRACED = [
    ("llama", {"pp": 2, "tp": 2, "sequence_parallel": True,
               "tp_plan": ["model.layers.*.mlp.gate_proj:colwise", "model.layers.*.mlp.up_proj:colwise",
                           "model.layers.*.mlp.down_proj:rowwise_seq", "model.layers.*.post_attention_layernorm:sequence"]},
     {}, r"strategy.sequence_parallel=True: cuts the sequence inside the blocks.*LlamaForCausalLM's blocks sit "
         r"inside other modules \(model.layers.0.*strategy.sequence_parallel=false"),
    ("llama", {"dp": 2, "pp": 2, "compile": True}, {}, r"trainer.compile=True: .*\(model.layers.0"),
    ("wrapped", {"pp": 2, "ep": 2}, {"model": "moe"}, r"strategy.ep=2: expert parallelism places the model's own "
     r"expert modules; Wrapped's blocks sit inside other modules \(inner.blocks.0.*strategy.ep=1"),
    ("wrapped", {"dp": 2, "pp": 2, "sync_batchnorm": True}, {"model": "batchnorm_cnn"},
     r"strategy.sync_batchnorm=True: swaps the model's own BatchNorm layers; Wrapped's blocks sit inside"),
]


@pytest.mark.parametrize("factory,strategy,args,message", TRACED,
                         ids=["sequence_parallel", "compile", "ep", "sync_bn"])
def test_hybrid_stages_of_nested_blocks_refuse_what_needs_the_models_own_blocks(factory, strategy, args, message):
    cfg = _cfg(factory, {"name": "hybrid", "dp": 1, **strategy}, **args)
    if args.get("model") == "batchnorm_cnn":
        cfg.data.task, cfg.data.features = "classification", 64
    with pytest.raises(ConfigError, match=message) as info:
        validate(cfg, world_size=4)
    assert "\n" not in str(info.value)  # one line


def test_a_split_by_blocks_alike_is_the_split_of_every_block():
    """Note [a split by blocks alike]: the names, costs and boundaries of a Llama's 7 layers asked of 4 are those
    asked of all 7 (its embedding, rotary embeddings, norm and head kept), so the balanced split is too."""
    from parallel.strategies.pipeline import split

    with torch.device("meta"):
        model = hf_models.llama(layers=7)
    names, costs, bounds = split._costs(model, TOKENS, timed=False)
    alike = split._costs_by_blocks_alike(model, TOKENS, *split.alike_blocks(model, split.SHORT))
    assert alike is not None and alike[0] == names and alike[1] == costs
    assert alike[2]() == split._traced_boundaries(model, TOKENS, names)
    assert len(list(model.model.layers)) == 7  # the list is whole again
