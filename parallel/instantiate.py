"""A user's callable in Hydra's instantiate shape: `_target_` with its keyword arguments beside it.

# Note [instantiate shape]
A model, dataset, loss or optimizer may name a user's callable in `_target_`, and its keyword arguments go under
`args` (`+model.args.width=64`) or beside `_target_`, as `hydra.utils.instantiate` takes them, e.g. a file
of the user's own config directory (`--config-dir DIR`), DIR/model/mine.yaml, selected by `model=mine`:

    _target_: mypkg.models.build
    width: 64

The schema's nodes of these groups (parallel.config.TARGET_GROUPS) let keys their dataclass lacks through
composition, and `move_beside_keys`, called before the config is typed (parallel.validate.to_config), moves
each of them into `args`: one mechanism for the four groups. The keys the dataclass has stay the framework's
(`model.freeze`, `optim.lr`, `data.task`, ...). Both forms at once merge; the same key in both is an error, and
so is a key beside no `_target_` (a misspelt setting, not an argument). A model or dataset file in this shape
names no built-in, so a `_target_` beside the schema's default name (mlp, synthetic) makes it the user's
(name custom). Of Hydra's own `_..._` keys, `_partial_` is taken (the framework completes the call: the
optimizer's parameters, the loss's output and target); the others mean nothing here and are refused.
"""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf, open_dict

from parallel.config import TARGET_GROUPS, fail

# Hydra's instantiate key that the framework's own call makes true anyway.
TAKEN = ("_partial_",)


def move_beside_keys(cfg: DictConfig) -> None:
    """In each of TARGET_GROUPS, move the keys its schema lacks into its `args`, in place (Note [instantiate
    shape]). Raises ConfigError for a key given in both places, a key beside no `_target_`, or one of Hydra's
    `_..._` keys that the framework does not take."""
    for group in TARGET_GROUPS:
        node = cfg[group]
        schema = OmegaConf.get_type(node)
        fields = {f.name: f for f in dataclasses.fields(schema)}
        beside = [k for k in node.keys() if k not in fields]
        target = node.get("_target_")
        raw = OmegaConf.to_container(node, resolve=False)  # interpolations resolve later, as the typed config's
        with open_dict(node):
            for key in beside:
                _move(group, node, key, raw[key], target, sorted(fields))
        if target and group in ("model", "data") and node.name == fields["name"].default:
            node.name = "custom"


def _move(group: str, node: DictConfig, key: str, value, target, known: list[str]) -> None:
    if key in TAKEN:
        del node[key]
        return
    if key.startswith("_") and key.endswith("_"):
        fail(f"{group}.{key}", value, f"Hydra's instantiate key is not taken here: {group}._target_ is called "
             f"with keyword arguments only", list(TAKEN))
    if not target:
        fail(f"{group}.{key}", value, f"not a key of {group}; keyword arguments beside {group}._target_ are for "
             f"a user's callable (a built-in's go under {group}.args)", known)
    if key in node.args:
        fail(f"{group}.{key}", value, f"given both beside {group}._target_ and as {group}.args.{key} "
             f"(={node.args[key]!r}): keep one")
    node.args[key] = value
    del node[key]
