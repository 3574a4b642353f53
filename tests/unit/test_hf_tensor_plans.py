"""Tensor-parallel plans of Hugging Face models (tests/hf_models.py): the model's own plan in the framework's
style names, inferred plans over GPT-2's Conv1D layers and BERT, and the config errors for plans that cannot
shard the model as asked (head counts, packed projections, tied weights, styles without an equivalent)."""
import pytest
import torch

from parallel.config import Config, ConfigError
from parallel.data import example_input
from parallel.models.build import build_meta_model
from parallel.strategies.tensor import resolve_plan
from parallel.strategies.tensor.styles import Conv1DColwise, Conv1DRowwise, make_style
from parallel.validate import validate
from tests import hf_models


def _cfg(model: str, args: dict | None = None, plan=(), tp: int | None = 2, **data) -> Config:
    cfg = Config()
    cfg.strategy.name, cfg.strategy.tp, cfg.strategy.tp_plan = "model", tp, list(plan)
    cfg.model.name, cfg.model._target_, cfg.model.args = "custom", f"tests.hf_models.{model}", dict(args or {})
    cfg.data.task, cfg.data.seq_len = "lm", 16
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def _plan(cfg: Config) -> dict[str, str]:
    validate(cfg, cfg.strategy.tp)
    s = cfg.strategy
    return resolve_plan(build_meta_model(cfg.model), s.tp, s.tp_plan, s.sequence_parallel,
                        (example_input(cfg.data),))


def test_llama_takes_its_own_plan_in_the_frameworks_style_names():
    plan = _plan(_cfg("llama"))
    # The plan the model carries holds the embedding under transformers 5.24, not under 5.17: the
    # framework takes what the model carries, nothing more.
    if "model.embed_tokens" in hf_models.llama()._tp_plan:
        assert plan["model.embed_tokens"] == "rowwise"  # HF embedding_rowwise: the vocabulary split
    else:
        assert "model.embed_tokens" not in plan
    assert plan["lm_head"] == "colwise_gather"  # HF colwise_gather_output
    for i in (0, 1):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        assert {plan[f"{attn}.{p}"] for p in ("q_proj", "k_proj", "v_proj")} == {"colwise"}
        assert plan[f"{attn}.o_proj"] == plan[f"{mlp}.down_proj"] == "rowwise"
        assert plan[f"{mlp}.gate_proj"] == plan[f"{mlp}.up_proj"] == "colwise"


def test_gpt2_and_bert_plans_are_inferred():
    gpt2 = _plan(_cfg("gpt2"))
    assert gpt2 == {f"transformer.h.{i}.mlp.{n}": s for i in (0, 1) for n, s in (("c_fc", "colwise"),
                                                                               ("c_proj", "rowwise"))}
    bert = _plan(_cfg("bert_classifier", task="classification", inputs="tokens", classes=4))
    assert bert["bert.encoder.layer.0.intermediate.dense"] == "colwise"
    assert bert["bert.encoder.layer.0.output.dense"] == "rowwise"
    assert bert["bert.pooler.dense"] == "colwise" and bert["classifier"] == "rowwise"


def test_conv1d_takes_styles_that_split_its_transposed_weight():
    with torch.device("meta"):
        block = hf_models.gpt2().transformer.h[0]
    assert type(make_style("colwise", block.mlp.c_fc)) is Conv1DColwise
    assert type(make_style("rowwise", block.mlp.c_proj)) is Conv1DRowwise
    # The packed q, k, v may be split with its output gathered whole: each rank computes some columns.
    cfg = _cfg("gpt2", plan=["transformer.h.*.attn.c_attn:colwise_gather", "transformer.h.*.attn.c_proj:replicate"])
    assert _plan(cfg)["transformer.h.0.attn.c_attn"] == "colwise_gather"
    # Widths are read from the right dimension: c_fc is (36, 144), so tp 8 splits its 144 outputs evenly.
    assert _plan(_cfg("gpt2", {"dim": 36, "heads": 4}, tp=8))["transformer.h.0.mlp.c_fc"] == "colwise"


BAD = {  # name -> (model, model args, tp, plan, what the error starts with, what it names)
    "tp_not_dividing_kv_heads": ("llama", {}, 4, (), "strategy.tp=4", "num_key_value_heads=2"),
    "tp_not_dividing_heads": ("llama", {"heads": 6, "kv_heads": 6, "dim": 48}, 4, (), "strategy.tp=4",
                              "num_attention_heads=6"),
    "tp_not_dividing_heads_gqa": ("llama", {"heads": 4, "kv_heads": 2}, 3, (), "strategy.tp=3",
                                  "num_attention_heads=4"),
    "packed_qkv_colwise": ("gpt2", {}, 2, ["transformer.h.*.attn.c_attn:colwise", "transformer.h.*.attn.c_proj:rowwise"],
                           "strategy.tp_plan['transformer.h.0.attn.c_attn']", "colwise_gather"),
    "conv1d_sequence_style": ("gpt2", {}, 2, ["transformer.h.*.mlp.c_fc:colwise_seq_gather"],
                              "strategy.tp_plan['transformer.h.0.mlp.c_fc']", "Conv1D"),
    "tied_split_differently": ("llama", {"tie": True}, 2, ["lm_head:colwise_gather"], "strategy.tp_plan",
                               "model.embed_tokens and lm_head share one weight"),
    "conv1d_width_not_divisible": ("gpt2", {"dim": 36, "heads": 4}, 5, (), "strategy.tp=5",
                                   "transformer.h.0.mlp.c_fc has 144 output features"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_hf_plans_fail_naming_the_key(case):
    model, args, tp, plan, start, named = BAD[case]
    with pytest.raises(ConfigError) as info:
        _plan(_cfg(model, args, plan, tp))
    message = str(info.value)
    assert message.startswith(start) and named in message, message


def test_a_tied_embedding_and_head_split_alike_are_accepted():
    plan = _plan(_cfg("llama", {"tie": True}))  # rowwise embedding and colwise head both split the vocabulary
    assert plan["model.embed_tokens"] == "rowwise" and plan["lm_head"] == "colwise_gather"


def test_hf_styles_without_an_equivalent_are_config_errors():
    with torch.device("meta"):
        model = hf_models.llama()
    model._tp_plan = {"model.layers.*.mlp.gate_proj": "packed_colwise"}  # as a model with packed weights has
    with pytest.raises(ConfigError, match="packed_colwise") as info:
        resolve_plan(model, tp=2)
    assert str(info.value).startswith("strategy.tp_plan") and "give strategy.tp_plan" in str(info.value)


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_sequence_parallel_on_a_models_own_plan_cuts_the_residual_stream(model):
    """Note [sequence parallelism for a model's own plan]: the first block cuts its input, every norm of a block
    and the one after them run on shards, attention and MLP gather on entry and reduce-scatter out, the head
    gathers; the projections keep the model's own styles (Qwen3's per-head norms theirs)."""
    cfg = _cfg(model)
    plain = _plan(cfg)
    cfg.strategy.sequence_parallel = True
    plan = _plan(cfg)
    assert plan["model.layers.0"] == "seq_split" and "model.layers.1" not in plan
    for i in (0, 1):
        p = f"model.layers.{i}"
        assert plan[f"{p}.input_layernorm"] == plan[f"{p}.post_attention_layernorm"] == "sequence"
        assert plan[f"{p}.self_attn"] == plan[f"{p}.mlp"] == "seq_gather"
        assert plan[f"{p}.self_attn.o_proj"] == plan[f"{p}.mlp.down_proj"] == "rowwise_seq"
        assert plan[f"{p}.self_attn.q_proj"] == plan[f"{p}.mlp.up_proj"] == "colwise"
    assert plan["model.norm"] == "sequence" and plan["lm_head"] == "colwise_seq_gather"
    changed = {k for k in plain if plan[k] != plain[k]}
    assert changed == {"lm_head", *(f"model.layers.{i}.{m}" for i in (0, 1)
                                    for m in ("self_attn.o_proj", "mlp.down_proj"))}
    if model == "qwen3":
        assert plan["model.layers.0.self_attn.q_norm"] == "replicate_grads"


def test_sequence_parallel_on_a_models_own_plan_refused_where_it_cannot_cut():
    cfg = _cfg("llama", seq_len=15)
    cfg.strategy.sequence_parallel = True
    with pytest.raises(ConfigError, match=r"data.seq_len=15 must divide by tp 2"):
        _plan(cfg)
    with torch.device("meta"):
        model = hf_models.llama()
    model.model.layers[0].extra = torch.nn.Linear(32, 32)  # a child on the stream with no rowwise layer
    with pytest.raises(ConfigError, match=r"model.layers.0.extra \(Linear\) is neither a norm nor ends in a "
                                          r"rowwise layer"):
        resolve_plan(model, 2, (), True, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
