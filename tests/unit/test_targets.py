"""Hydra's instantiate shape (Note [instantiate shape]): keyword arguments beside `_target_` in the model, data,
loss and optimizer groups, from the command line or a user's own config directory."""
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from parallel.config import ConfigError
from parallel.validate import to_config_with_data, validate
from tests.unit.test_configs import CONF


def typed_with_data(overrides, searchpath=None):
    """The typed config and what was read from its data (parallel.validate.to_config_with_data)."""
    GlobalHydra.instance().clear()
    if searchpath is not None:
        overrides = overrides + [f"hydra.searchpath=[file://{searchpath}]"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_config_with_data(compose(config_name="config", overrides=overrides))


def typed(overrides, searchpath=None):
    return typed_with_data(overrides, searchpath)[0]


def test_keyword_arguments_beside_the_target_join_args():
    cfg = typed(["model=custom", "model._target_=tests.user_model.two_tower", "model.width=8", "+model.args.out=4",
                 "optim._target_=torch.optim.SGD", "optim.momentum=0.9", "optim.lr=0.1",
                 "loss._target_=tests.user_loss.squared_mean", "+loss.weight=2"])
    assert cfg.model.args == {"width": 8, "out": 4}
    assert cfg.optim.args == {"momentum": 0.9} and cfg.optim.lr == 0.1  # a key of the schema stays its own
    assert cfg.loss.args == {"weight": 2}
    validate(cfg, 1)


def test_a_user_config_directory_in_instantiate_shape(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(
        "_target_: tests.user_model.two_tower\nfeatures: ${data.features}\nwidth: 8\nout: ${data.targets}\n")
    (tmp_path / "optim").mkdir()
    (tmp_path / "optim" / "sgd.yaml").write_text("_target_: torch.optim.SGD\n_partial_: true\nlr: 0.05\n"
                                                 "momentum: 0.9\nnesterov: true\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text("_target_: tests.user_data.regression\nn: 64\nworkers: 0\n")
    (tmp_path / "data" / "bare.yaml").write_text("_target_: tests.user_data.regression\n")
    cfg, data = typed_with_data(["model=mine", "optim=sgd", "data=mine"], searchpath=tmp_path)
    assert cfg.model.name == "custom" and cfg.model.args == {"features": 8, "width": 8, "out": 2}  # read from the data
    assert cfg.optim.args == {"momentum": 0.9, "nesterov": True} and cfg.optim.lr == 0.05
    assert cfg.data.name == "custom" and cfg.data.args == {"n": 64}
    validate(cfg, 1, data)
    assert typed(["data=bare"], searchpath=tmp_path).data.name == "custom"  # a _target_ alone: the user's dataset


BAD = [
    (["model=custom", "model._target_=tests.user_model.two_tower", "model.width=8", "+model.args.width=9"],
     "model.width=8: given both beside model._target_ and as model.args.width"),
    (["optim._target_=torch.optim.SGD", "optim.momentum=0.9", "+optim.args.momentum=0.5"],
     "optim.momentum=0.9: given both"),
    (["model.widht=8"], "model.widht=8: not a key of model"),
    (["optim.momentum=0.9"], "optim.momentum=0.9: not a key of optim"),
    (["model=custom", "model._target_=tests.user_model.two_tower", "+model._recursive_=false"],
     "model._recursive_=False: Hydra's instantiate key is not taken here"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=["model_both", "optim_both", "model_no_target",
                                                         "optim_no_target", "hydra_key"])
def test_bad_beside_keys_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        typed(overrides)
