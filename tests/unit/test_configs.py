"""Every config in conf/ composes against the schema, and validates."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

import parallel.config  # noqa: F401  (registers the schema and resolvers)
from parallel.validate import to_config, validate

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
    cfg = to_config(compose_cfg([f"{group}={name}"] + extra))
    section = getattr(cfg, group)
    assert getattr(section, "name", name) == name
    validate(cfg, world_size=1)


def test_root_config_defaults():
    cfg = to_config(compose_cfg([]))
    assert (cfg.strategy.name, cfg.model.name, cfg.data.name) == ("single", "mlp", "synthetic")
    # The model's widths follow the data by interpolation.
    assert cfg.model.args["in_features"] == cfg.data.features
    assert cfg.model.args["out_features"] == cfg.data.targets


def test_classification_output_width_follows_classes():
    cfg = to_config(compose_cfg(["data.task=classification", "data.classes=7"]))
    assert cfg.model.args["out_features"] == 7


@pytest.mark.parametrize("override", ["trainer.foo=1", "strategy.bogus=2", "trainer.steps=1.5",
                                      "trainer.batch_size=abc", "strategy=nope", "model=nope"])
def test_composition_rejects_unknown_keys_and_wrong_types(override):
    with pytest.raises((ConfigCompositionException, MissingConfigException, OmegaConfBaseException)) as info:
        compose_cfg([override])
    assert override.split("=")[0].split(".")[-1] in str(info.value) or "nope" in str(info.value)
