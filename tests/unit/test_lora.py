"""LoRA's configuration, names and plans in one process (Note [LoRA] in parallel/models/lora.py): the planner
counts gradients and optimizer state of the adapters only, a tensor-parallel plan moves onto the base layers,
and bad input is one config error naming the key."""
import pytest

from parallel.config import Config, ConfigError, LoraConfig, ModelConfig
from parallel.models.build import build_meta_model
from parallel.models.lora import adapter_plan, base_name, exported_name
from parallel.planning.planner import plan
from parallel.validate import validate

LLAMA = "tests.hf_models.llama"


def _model(lora: dict | None = None, **model) -> ModelConfig:
    return ModelConfig(name="custom", _target_=LLAMA, lora=LoraConfig(**(lora or {})), **model)


def _config(**lora) -> Config:
    cfg = Config()
    cfg.model.name, cfg.model._target_ = "custom", LLAMA
    cfg.data.task, cfg.data.seq_len, cfg.data.vocab_size, cfg.trainer.batch_size = "lm", 16, 64, 8
    for key, value in lora.items():
        setattr(cfg.model.lora, key, value)
    return cfg


def test_the_plan_holds_gradients_and_optimizer_state_for_the_adapters_only():
    cfg = _config(r=4, targets=["q_proj", "v_proj"])
    validate(cfg, 1)
    (lora,) = plan(cfg, 1)
    model = build_meta_model(cfg.model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # 2 layers x (q_proj 32 -> 32: A 4 x 32, B 32 x 4; v_proj 32 -> 16 (2 of 4 heads): A 4 x 32, B 16 x 4)
    assert trainable == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    # AdamW's two fp32 moments per adapter weight and a step counter (an fp32 scalar) per adapter tensor.
    assert lora.optimizer == 2 * 4 * trainable + 4 * 8
    full = _config()
    validate(full, 1)
    (whole,) = plan(full, 1)
    assert whole.optimizer > 20 * lora.optimizer and lora.params > whole.params  # the adapters add a little


def test_a_tensor_parallel_plan_moves_onto_the_base_layers():
    model = build_meta_model(_model({"r": 4, "targets": ["q_proj", "o_proj", "k_proj"]}))
    got = adapter_plan(model, {"model.layers.0.self_attn.q_proj": "colwise", "model.layers.0.self_attn.o_proj":
                               "rowwise", "model.layers.0.self_attn.k_proj": "replicate", "lm_head": "colwise_gather"})
    assert got == {"model.layers.0.self_attn.q_proj.base_layer": "colwise",
                   "model.layers.0.self_attn.q_proj.lora_B.default": "colwise",
                   "model.layers.0.self_attn.o_proj.base_layer": "rowwise",
                   "model.layers.0.self_attn.o_proj.lora_A.default": "rowwise",
                   "model.layers.0.self_attn.k_proj": "replicate", "lm_head": "colwise_gather"}
    with pytest.raises(ConfigError, match=r"strategy.tp_plan\['model.layers.0.self_attn.q_proj'\]='seq_colwise'"):
        adapter_plan(model, {"model.layers.0.self_attn.q_proj": "seq_colwise"})


def test_names_without_the_adapters():
    assert base_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert base_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert base_name("score.original_module.weight") == "score.weight"
    assert base_name("score.modules_to_save.default.weight") == "score.weight"
    assert exported_name("score.original_module.weight") is None
    assert exported_name("score.modules_to_save.default.weight") == "score.weight"


@pytest.mark.parametrize("model, message", [
    ({"lora": {"r": 4, "targets": ["nowhere"]}},
     r"model.lora.targets=\['nowhere'\]: matches no module PEFT can wrap in LlamaForCausalLM .*"
     r"its Linear layers: model.layers.0.self_attn.q_proj, "),
    ({"lora": {"r": 4, "targets": ["q_proj"]}, "peft": {"_target_": "peft.LoraConfig", "r": 4}},
     r"model.peft=.*: model.lora.\* and model.peft both configure adapters: keep one"),
    ({"peft": {"r": 4}}, r"model.peft=\{'r': 4\}: needs _target_"),
    ({"lora": {"r": 4, "targets": ["input_layernorm"]}},
     r"model.lora.targets=\['input_layernorm'\]: PEFT cannot put these adapters on LlamaForCausalLM"),
    ({"lora": {"r": -1}}, r"model.lora.r=-1: must be >= 0"),
    ({"lora": {"r": 4, "dropout": 1.5}}, r"model.lora.dropout=1.5: must be in \[0, 1\)"),
], ids=["no_match", "both", "no_target", "cannot_wrap", "negative_r", "dropout"])
def test_bad_input_is_one_config_error(model, message):
    with pytest.raises(ConfigError, match=message):
        build_meta_model(_model(**model))


def test_any_peft_config_in_hydras_instantiate_shape():
    model = build_meta_model(_model(peft={
        "_target_": "peft.LoraConfig", "r": 2, "target_modules": ["gate_proj"], "lora_alpha": 4}))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"model.layers.{i}.mlp.gate_proj.lora_{ab}.default.weight" for i in (0, 1) for ab in "AB"}
