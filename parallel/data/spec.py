"""What validation read from the data itself, carried to the workers beside the config.

# Note [data spec]
data=custom's first sample says what the model is fed: each input field's shape and dtype, the target's,
whether the dataset is a stream, how many samples it holds (and its evaluation set), how many shards a stream
splits into (Note [custom data] in parallel/data/custom/__init__.py). These are results, not settings: the
config holds what the user set (and the sizes and keys read from the same sample, which the config's own keys
name), and a `DataSpec` holds the rest. Validation makes it once, in the launching process
(`parallel.validate.to_config_with_data`), checks against it (`validate(cfg, world, data)`), and hands it to the
workers beside the resolved config as a plain dict (`to_dict` / `from_dict`, parallel/launcher.py); a worker
gives it to what reads it through its `Runtime` (`Runtime.data`, Note [runtime]): the data source, the example
inputs the strategies trace or plan with, the throughput's token count. Synthetic data and shards have
nothing to read here: their shapes follow from the config (`DataSpec()`, whose `input` is None).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class DataSpec:
    """One sample's fields as the model and the loss get them, each `{"shape": [...], "dtype": "float32"}`
    (a sample's own shape, without the batch dimension), and the dataset's size (Note [data spec]).

    Attributes:
        input: the field the model is fed (the main one, with inputs by name); None: no sample was read.
        named: every field passed by name (Note [inputs by name] in parallel/tensors.py); None: one input.
        target: the field the loss compares with.
        iterable: the dataset is a stream (an IterableDataset).
        samples: a map-style dataset's sample count; None for a stream.
        shards: a stream's shard count (1: read whole); None for a map-style dataset.
        eval_samples: data.eval's sample count (None: a stream, or no evaluation dataset).
    """

    input: dict | None = None
    named: dict | None = None
    target: dict | None = None
    iterable: bool = False
    samples: int | None = None
    shards: int | None = None
    eval_samples: int | None = None

    def to_dict(self) -> dict:
        """A plain dict, to cross process boundaries (back with `from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> DataSpec:
        """The spec `to_dict` gave; None: nothing read."""
        return cls(**(d or {}))


def spec_of(name: str, spec: DataSpec | None) -> DataSpec:
    """`spec`, which data=custom must have (validation read it); an empty one for the other sources."""
    if spec is None or (name == "custom" and spec.input is None):
        if name == "custom":
            raise ValueError("data=custom without its DataSpec: the first sample's fields are read by validation "
                             "(parallel.validate.to_config_with_data) and passed beside the config")
        return DataSpec()
    return spec
