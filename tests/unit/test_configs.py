"""Every config in conf/ composes against the schema, and validates."""
import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from parallel.config import SPECS, Config, ConfigError, StrategyConfig, from_dict, to_dict  # (registers the schema)
from parallel.validate import to_config, to_config_with_data, validate

CONF = Path(__file__).resolve().parents[2] / "conf"
EXTRA = {("model", "custom"): ["model._target_=tests.user_model.two_tower"],
         ("model", "gpt"): ["data.task=lm"],
         ("model", "moe"): ["data.task=lm"],
         ("model", "cnn"): ["data.task=classification", "data.features=64"],
         ("data", "custom"): ["data._target_=tests.user_data.regression"],
         ("strategy", "data"): []}


def options():
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"):
        for f in sorted(group.glob("*.yaml")):
            yield group.name, f.stem


def compose_cfg(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=False)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """A tiny dataset for data=shards (its manifest sets the task and sizes)."""
    import numpy as np

    from parallel.data.shards import write_shards

    out = tmp_path_factory.mktemp("shards") / "data"
    write_shards(({"features": np.full(8, i, np.float32), "targets": np.zeros(2, np.float32)} for i in range(16)),
                 out)
    return str(out)


@pytest.mark.parametrize("group,name", list(options()))
def test_every_config_composes_and_validates(group, name, shards, hf_dirs):
    extra = [f"data.path={shards}"] if (group, name) == ("data", "shards") else EXTRA.get((group, name), [])
    if (group, name) == ("model", "hf"):
        extra = [f"model.path={hf_dirs['llama']}", "data.task=lm", "data.seq_len=16"]
    cfg, data = to_config_with_data(compose_cfg([f"{group}={name}"] + extra))
    section = getattr(cfg, group)
    assert getattr(section, "name", name) == name
    validate(cfg, world_size=1, data=data)


def test_root_config_defaults():
    cfg = to_config(compose_cfg([]))
    assert (cfg.strategy.name, cfg.model.name, cfg.data.name) == ("single", "mlp", "synthetic")
    # The model's widths follow the data by interpolation.
    assert cfg.model.args["in_features"] == cfg.data.features
    assert cfg.model.args["out_features"] == cfg.data.targets


def test_classification_output_width_follows_classes():
    cfg = to_config(compose_cfg(["data.task=classification", "data.classes=7"]))
    assert cfg.model.args["out_features"] == 7


@pytest.mark.parametrize("overrides", [["trainer.foo=1"], ["trainer.steps=1.5"], ["trainer.batch_size=abc"],
                                       ["strategy=nope"], ["model=nope"],
                                       ["strategy=pipeline", "strategy.microbatches=abc"],  # its own schema's type
                                       ["strategy=data", "strategy.zero=two"]])
def test_composition_rejects_unknown_keys_and_wrong_types(overrides):
    with pytest.raises((ConfigCompositionException, MissingConfigException, OmegaConfBaseException)) as info:
        compose_cfg(overrides)
    assert overrides[-1].split("=")[0].split(".")[-1] in str(info.value) or "nope" in str(info.value)


def test_data_spec_is_no_setting():
    """What validation reads from the data travels beside the config (Note [data spec] in parallel/data/spec.py):
    `data.spec` is refused in one line as any key the data group lacks."""
    with pytest.raises(ConfigError, match=r"^data.spec=\{\}: not a key of data; ") as info:
        to_config(compose_cfg(["+data.spec={}"]))
    assert "\n" not in str(info.value)


# A key of another strategy, or of none: one line naming the key and the strategy, when the composed config is
# typed (Note [strategy schemas] in parallel/strategy_specs.py).
OTHERS_KEYS = [
    (["strategy=pipeline", "strategy.zero=3"], "strategy.zero=3: not a key of strategy=pipeline, but of "
                                               "strategy=data, context, expert, hybrid (valid: ['activations', "
                                               "'balance', 'microbatches', 'pp', 'schedule', 'selective', "
                                               "'split_points', 'stages_per_rank'])"),
    (["strategy=data", "strategy.schedule=GPipe"], "strategy.schedule='GPipe': not a key of strategy=data, but of "
                                                   "strategy=pipeline, hybrid, auto (valid: ['activations', 'dp', "
                                                   "'dp_replicate', 'selective', 'sync_batchnorm', 'zero'])"),
    # Replicas of a sharded group: data's and hybrid's (Note [hybrid sharding] in parallel/dims.py).
    (["strategy=context", "strategy.dp_replicate=2"], "strategy.dp_replicate=2: not a key of strategy=context, but "
                                                      "of strategy=data, hybrid"),
    (["strategy.bogus=2"], "strategy.bogus=2: not a key of strategy=single, nor of another strategy (valid: "
                           "['activations', 'selective'])"),
    (["strategy=single", "strategy.dp=2"], "strategy.dp=2: not a key of strategy=single, but of strategy=data, hybrid"),
    (["strategy=model", "strategy.sync_batchnorm=true"], "strategy.sync_batchnorm=True: not a key of strategy=model"),
    (["strategy=context", "strategy.tp=2"], "strategy.tp=2: not a key of strategy=context"),
    (["strategy=expert", "strategy.schedule=GPipe"], "strategy.schedule='GPipe': not a key of strategy=expert"),
    (["strategy=offload", "strategy.zero=1"], "strategy.zero=1: not a key of strategy=offload"),
    (["strategy=hybrid", "strategy.params=cpu"], "strategy.params='cpu': not a key of strategy=hybrid, but of "
                                                 "strategy=offload"),
    (["strategy=auto", "strategy.activations=checkpoint"], "strategy.activations='checkpoint': not a key of "
                                                           "strategy=auto"),
    (["strategy=data", "+strategy.pp=2"], "strategy.pp=2: not a key of strategy=data"),  # added with +, too
    # strategy.name picks the keys that count: those of the strategy named (its group's schema types the rest).
    (["strategy.name=offload", "strategy.zero=3"], "strategy.zero=3: not a key of strategy=offload"),
    (["strategy.name=pipeline", "strategy.microbatches=abc"], "strategy.microbatches='abc': ValidationError: "),
    (["strategy.name=warp"], "strategy.name='warp': unknown strategy"),
]


@pytest.mark.parametrize("overrides,message", OTHERS_KEYS, ids=[" ".join(o) for o, _ in OTHERS_KEYS])
def test_a_key_of_another_strategy_is_refused_naming_it_and_the_strategy(overrides, message):
    with pytest.raises(ConfigError) as info:
        to_config(compose_cfg(overrides))
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["data", "pipeline", "model", "context", "expert"])
def test_hybrid_takes_the_keys_of_what_it_composes(name):
    """Every key of the strategies hybrid combines, given to hybrid, is typed and kept."""
    for key in SPECS[name].keys:
        default = getattr(StrategyConfig(), key)
        value = {bool: "true", int: "2", str: "x"}.get(type(default), "2") if not isinstance(default, list) else "[a]"
        cfg = to_config(compose_cfg(["strategy=hybrid", f"strategy.{key}={value}"]))
        assert getattr(cfg.strategy, key) != default, key


def test_the_code_sees_every_strategy_key_at_its_default():
    """After typing, a strategy's config holds every key (those it does not take at their defaults), so code
    that reads another strategy's key reads its default (Note [strategy schemas])."""
    cfg = to_config(compose_cfg(["strategy=pipeline", "strategy.pp=2"]))
    assert type(cfg.strategy) is StrategyConfig and type(cfg) is Config
    s = cfg.strategy
    assert (s.pp, s.zero, s.params, s.sync_batchnorm) == (2, 0, "auto", False)
    assert from_dict(to_dict(cfg)) == cfg


def test_a_run_config_read_back_takes_every_strategy_key():
    """A run's .hydra/config.yaml (a plain dict here) from before the per-strategy schemas held every key: it
    still types (launch/export.py reads it)."""
    cfg = to_config({"strategy": {**dataclasses.asdict(StrategyConfig(name="pipeline")), "zero": 0},
                     "model": {"args": {"in_features": 32, "out_features": 4}}})
    assert cfg.strategy.name == "pipeline" and cfg.strategy.zero == 0
