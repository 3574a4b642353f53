"""Initial values (Note [initial values]): the model's own, weight files of every format, model=hf, and the
bad inputs around them, each a ConfigError naming its key before any worker starts."""
import contextlib
import json
import logging
import sys

import pytest
import torch
from safetensors.torch import save_file

from parallel.config import Config, ConfigError, ModelConfig
from parallel.init import init_plan, materialize_and_init
from parallel.init.files import WeightFiles
from parallel.models.build import build_meta_model, meta_model
from parallel.models.recipe import model_recipe
from parallel.models.weights import initial_values
from parallel.validate import validate
from tests import hf_models


def materialized(m: ModelConfig, tmp_path, seed: int = 0) -> dict:
    """The values one process starts from under `m` (every tensor, non-persistent buffers included)."""
    recipe = model_recipe(m)
    model = meta_model(recipe)
    plan = init_plan(model)
    values = initial_values(recipe, seed, tmp_path, model, plan)
    materialize_and_init(model, torch.device("cpu"), plan, values)
    return dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])


def own(factory, seed: int = 0, **kwargs) -> dict:
    """What the user's own code starts from: `torch.manual_seed(seed); factory()`."""
    torch.manual_seed(seed)
    model = factory(**kwargs)
    return dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])


def assert_equal_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("factory", ["bare", "llama", "gpt2", "bert_classifier", "batchnorm_cnn"])
def test_module_init_is_the_users_own(factory, tmp_path):
    """Constructor values, bare parameters, reset_parameters, HF _init_weights, buffers computed in __init__
    (rotary inv_freq, non-persistent) and tied weights: as `torch.manual_seed(seed); factory()` makes them."""
    m = ModelConfig(name="custom", _target_=f"tests.hf_models.{factory}")
    got = materialized(m, tmp_path, seed=3)
    assert_equal_tensors(got, own(getattr(hf_models, factory), seed=3))


def test_module_init_keeps_ties_and_the_users_global_rng_untouched(tmp_path):
    recipe = model_recipe(ModelConfig(name="custom", _target_="tests.hf_models.bare"))
    model = meta_model(recipe)
    plan = init_plan(model)
    materialize_and_init(model, torch.device("cpu"), plan, initial_values(recipe, 0, tmp_path, model, plan))
    assert model.head.weight is model.embed.weight
    assert plan["head.weight"].canonical == "embed.weight"


def test_name_init_runs_the_models_own_methods_for_layers_without_a_rule(tmp_path):
    """model.init=name on a Hugging Face model: RMSNorm by _init_weights, rotary inv_freq recomputed; values
    depend on names, not on construction order."""
    m = ModelConfig(name="custom", _target_="tests.hf_models.llama", init="name")
    got = materialized(m, tmp_path)
    torch.testing.assert_close(got["model.norm.weight"], torch.ones(32))
    torch.testing.assert_close(got["model.rotary_emb.inv_freq"], own(hf_models.llama)["model.rotary_emb.inv_freq"])
    std = got["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.015 < std < 0.025  # HF's normal(0, initializer_range=0.02), not PyTorch's default
    bigger = materialized(ModelConfig(name="custom", _target_="tests.hf_models.llama", init="name",
                                      args={"layers": 3}), tmp_path)
    torch.testing.assert_close(bigger["model.layers.1.mlp.up_proj.weight"], got["model.layers.1.mlp.up_proj.weight"])


def _pretrained(tmp_path, fmt: str) -> tuple[str, dict]:
    torch.manual_seed(7)
    model = hf_models.gpt2()
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    if fmt == "dir":
        model.save_pretrained(tmp_path / "dir")
        return str(tmp_path / "dir"), state
    if fmt == "safetensors":
        save_file(state, tmp_path / "w.safetensors")
        return str(tmp_path / "w.safetensors"), state
    if fmt == "pt":
        torch.save(state, tmp_path / "w.pt")
        return str(tmp_path / "w.pt"), state
    names = sorted(state)  # a sharded index over two files
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for f, keys in halves.items():
        save_file({k: state[k] for k in keys}, tmp_path / f)
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(tmp_path / "model.safetensors.index.json"), state


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "index", "dir"])
def test_pretrained_weights_of_every_format_load_under_the_models_names(fmt, tmp_path):
    path, state = _pretrained(tmp_path, fmt)
    got = materialized(ModelConfig(name="custom", _target_="tests.hf_models.gpt2", weights=path), tmp_path)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    assert got["lm_head.weight"] is got["transformer.wte.weight"]


def test_base_model_weights_load_into_a_model_with_a_head(tmp_path):
    """A checkpoint of the bare encoder (no `bert.` prefix) fills a model with a classification head; the head
    keeps its own initialization with model.strict=false."""
    torch.manual_seed(5)
    full = hf_models.bert_classifier()
    base = {k: v for k, v in full.bert.state_dict().items()}
    save_file({k: v.contiguous() for k, v in base.items()}, tmp_path / "base.safetensors")
    m = ModelConfig(name="custom", _target_="tests.hf_models.bert_classifier",
                    weights=str(tmp_path / "base.safetensors"), strict=False)
    got = materialized(m, tmp_path, seed=0)
    torch.testing.assert_close(got["bert.encoder.layer.1.output.dense.weight"],
                               base["encoder.layer.1.output.dense.weight"], rtol=0, atol=0)
    torch.testing.assert_close(got["classifier.weight"], own(hf_models.bert_classifier)["classifier.weight"])


def test_a_piece_is_read_alone(tmp_path):
    path, state = _pretrained(tmp_path, "safetensors")
    files = WeightFiles(path)
    piece = files.read("transformer.wte.weight", (slice(16, 32), slice(0, 32)))
    torch.testing.assert_close(piece, state["transformer.wte.weight"][16:32], rtol=0, atol=0)
    assert files.shapes["transformer.h.0.attn.c_attn.weight"] == (32, 96)


def hf_cfg(path: str, **model) -> Config:
    cfg = Config()
    cfg.data.task, cfg.data.seq_len = "lm", 16
    cfg.model = ModelConfig(name="hf", path=path, **model)
    return cfg


def test_model_hf_builds_the_directorys_model_with_overrides(hf_dirs):
    cfg = hf_cfg(hf_dirs["llama"], config={"num_hidden_layers": 1}, pretrained=False)
    validate(cfg, 1)
    model = build_meta_model(cfg.model)
    assert type(model).__name__ == "LlamaForCausalLM" and len(model.model.layers) == 1


def bad_weights(tmp_path) -> str:
    torch.manual_seed(0)
    state = hf_models.llama(dim=48, heads=4).state_dict()  # other widths
    state["extra.weight"] = torch.zeros(2)
    del state["model.norm.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "bad.safetensors")
    return str(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("case,key,words", [
    ("no_config", "model.path", "config.json"),
    ("auto_class", "model.auto_class", "AutoModelForMagic"),
    ("override", "model.config.num_hidden_layer", "not a setting"),
    ("shapes", "model.weights", "another shape"),
    ("names", "model.weights", "missing 1: model.norm.weight; unexpected 1: extra.weight"),
    ("no_logits", "model", "no 'logits'"),
    ("no_transformers", "model=hf needs Hugging Face transformers", 'pip install -e ".[hf]"'),
    ("no_file", "model.weights", "no such file"),
])
def test_bad_models_and_weights_are_config_errors(case, key, words, hf_dirs, tmp_path, monkeypatch):
    cfg = hf_cfg(hf_dirs["llama"])
    if case == "no_config":
        cfg.model.path = str(tmp_path)
    elif case == "auto_class":
        cfg.model.auto_class = "AutoModelForMagic"
    elif case == "override":
        cfg.model.config = {"num_hidden_layer": 1}
    elif case == "shapes":
        cfg.model = ModelConfig(name="custom", _target_="tests.hf_models.llama", weights=bad_weights(tmp_path))
    elif case == "names":
        state = hf_models.llama().state_dict()
        state["extra.weight"] = torch.zeros(2)
        del state["model.norm.weight"]
        save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "names.safetensors")
        cfg.model = ModelConfig(name="custom", _target_="tests.hf_models.llama",
                                weights=str(tmp_path / "names.safetensors"))
    elif case == "no_logits":
        cfg.model = ModelConfig(name="custom", _target_="tests.hf_models.hidden_states_only")
    elif case == "no_transformers":
        monkeypatch.setitem(sys.modules, "transformers", None)
    elif case == "no_file":
        cfg.model = ModelConfig(name="custom", _target_="tests.hf_models.llama", weights=str(tmp_path / "none.pt"))
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1)
    assert str(info.value).startswith(key), str(info.value)
    assert words in str(info.value), str(info.value)



def test_a_directory_missing_the_head_starts_from_from_pretrained(hf_dirs, tmp_path):
    """model=hf of an encoder checkpoint under AutoModelForMaskedLM (model.strict=false, model=hf's default):
    every tensor, the missing head included, is what `torch.manual_seed(seed); from_pretrained` gives."""
    from transformers import AutoModelForMaskedLM

    m = ModelConfig(name="hf", path=hf_dirs["bert_base"], auto_class="AutoModelForMaskedLM", strict=False)
    got = materialized(m, tmp_path, seed=3)
    torch.manual_seed(3)
    want = AutoModelForMaskedLM.from_pretrained(hf_dirs["bert_base"])
    assert_equal_tensors(got, dict([*want.named_parameters(remove_duplicate=False),
                                    *want.named_buffers(remove_duplicate=False)]))


@contextlib.contextmanager
def parallel_log(caplog, level: int):
    """The framework's log captured, whether it propagates or not (a worker's setup turns that off)."""
    log = logging.getLogger("parallel")
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger="parallel"):
            yield
    finally:
        log.removeHandler(caplog.handler)


def test_a_directory_missing_the_head_is_listed_once_or_refused_with_strict(hf_dirs, caplog):
    cfg = hf_cfg(hf_dirs["bert_base"], auto_class="AutoModelForMaskedLM", strict=False)
    with parallel_log(caplog, logging.WARNING):
        validate(cfg, 1)
    assert len({id(r) for r in caplog.records if "lack" in r.getMessage()}) == 1  # one warning lists them
    assert "lack; from_pretrained's initial values for 5 tensors (cls.predictions.bias" in caplog.text
    assert "hold, ignored: 2 tensors (pooler.dense.bias, pooler.dense.weight)" in caplog.text
    cfg.model.strict = True
    with pytest.raises(ConfigError, match=r"^model.path=.*missing 5: cls.predictions.bias.*unexpected 2: pooler"):
        validate(cfg, 1)


def test_a_body_saved_under_other_names_is_refused_not_trained_from_fresh_values(tmp_path):
    """A Mixtral directory whose experts are saved under names no conversion of transformers' knows
    (`experts.N.wi` for the `experts.N.w1` that it fuses into `mlp.experts` as it loads: Note [checkpoint
    conversion] in parallel/models/hf_conversion.py): read as they are, the experts would start from fresh values
    with one warning line; the body's tensors missing while the files' go unread is a config error instead."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    hf_models.mixtral().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    save_file({k.replace(".w1.", ".wi."): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    cfg = hf_cfg(str(tmp_path), strict=False)
    with pytest.raises(ConfigError, match=r"^model.path=.*: 2 tensors of MixtralForCausalLM's own body are not in the "
                                          r"files \(model.layers.0.mlp.experts.gate_up_proj, .*\), while 16 of the "
                                          r"files' go unread \(model.layers.0.block_sparse_moe.experts.0.w3.weight, "
                                          r"model.layers.0.block_sparse_moe.experts.0.wi.weight"):
        validate(cfg, 1)


@pytest.mark.parametrize("task,data,cls", [
    ("lm", {}, "LlamaForCausalLM"),
    ("classification", {"inputs": "tokens", "classes": 4}, "LlamaForSequenceClassification"),
])
def test_a_config_without_architectures_builds_the_tasks_class(task, data, cls, tmp_path, caplog):
    """config.json as `LlamaConfig(...).save_pretrained(dir)` writes it (no architectures): data.task says the
    Auto class, in the log; model.auto_class still wins."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16, num_labels=4, pad_token_id=0,
                ).save_pretrained(tmp_path)
    cfg = hf_cfg(str(tmp_path))
    cfg.data.task = task
    for key, value in data.items():
        setattr(cfg.data, key, value)
    with parallel_log(caplog, logging.INFO):
        validate(cfg, 1)
    assert type(build_meta_model(cfg.model)).__name__ == cls
    assert f"config.json names no architectures; data.task={task} builds it with AutoModelFor" in caplog.text
    cfg = hf_cfg(str(tmp_path), auto_class="AutoModelForCausalLM")
    cfg.data.task = task
    for key, value in data.items():
        setattr(cfg.data, key, value)
    if task == "classification":  # the set class wins: a causal LM does not give the classes' outputs
        with pytest.raises(ConfigError, match="data.task=classification"):
            validate(cfg, 1)
    else:
        validate(cfg, 1)
    assert cfg.model.auto_class == "AutoModelForCausalLM"


@pytest.mark.parametrize("factory", ["llama", "gpt2"])
def test_a_factorys_hf_model_trains_without_its_cache(factory):
    """A `_target_` factory's PreTrainedModel with its config's default use_cache=True gets model=hf's handling
    (cache off, training mode) and so splits into pipeline stages (tests/distributed/test_hf_pipeline.py
    trains it)."""
    cfg = Config()
    cfg.model = ModelConfig(name="custom", _target_=f"tests.hf_models.{factory}", args={"use_cache": True})
    cfg.data.task, cfg.data.seq_len, cfg.trainer.batch_size = "lm", 16, 8
    cfg.strategy.name = "pipeline"
    validate(cfg, 2)
    model = build_meta_model(cfg.model)
    assert model.config.use_cache is False and model.training


def test_a_model_built_whole_at_start_must_fit_the_hosts_available_memory(tmp_path):
    """model.init=module builds the whole model on rank 0's host once: where its tensors alone exceed the memory
    available there, a config error names the figures and model.init=name, before any worker starts."""
    from parallel.models.weights import check_init_memory

    m = ModelConfig(name="mlp", args={"hidden": 512, "depth": 6})
    model = build_meta_model(m)
    need = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(ConfigError, match=r"model.init='module': builds the whole model once in host memory at "
                                          rf"start, {need / 1e6:.1f} MB of tensors, and this host has 1.0 MB "
                                          r"available .*model.init=name"):
        check_init_memory(m, model, available=1_000_000)
    check_init_memory(m, model, available=need)  # fits exactly
    check_init_memory(ModelConfig(name="mlp", args=m.args, init="name"), model, available=1)  # never whole
    check_init_memory(m, model)  # this host's own figure: a 6.3 MB MLP fits
