"""Evaluation data of data=custom: a second dataset (data.eval) or the held-out part of the training set
(data.eval_fraction), read in a fixed order, the same on any world size."""
from __future__ import annotations

import numpy as np

from parallel.config import DataConfig
from parallel.data.custom.dataset import build_dataset, is_iterable
from parallel.data.custom.iterable import IterData
from parallel.data.custom.loader import MapData, split_indices


def build_custom_eval(cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1):
    """The evaluation source of data=custom, or None when it has none.

    Its `batch(i, device)` (i = 1, 2, ...) is this rank's slice of global evaluation batch i: consecutive
    samples of the dataset's own order (data.eval) or of the held-out indices in the dataset's order
    (data.eval_fraction), never shuffled; a tail shorter than a global batch is not evaluated. `num_batches`:
    how many whole batches there are (None for a stream).
    """
    spec = cfg.eval or {}
    if spec.get("_target_"):
        ds = build_dataset("data.eval._target_", spec["_target_"], spec.get("args") or {})
        if is_iterable(ds):
            source = IterData(cfg, seed, batch_size, dp_rank, dp_size, dataset=ds, key="data.eval._target_")
            source.num_batches = None
            return source
        indices = np.arange(len(ds))
    elif cfg.eval_fraction:
        ds = build_dataset("data._target_", cfg._target_, cfg.args)
        indices = split_indices(len(ds), cfg.eval_fraction, seed)[1]
    else:
        return None
    source = MapData(cfg, seed, batch_size, dp_rank, dp_size, dataset=ds, indices=indices, shuffle=False)
    source.num_batches = len(indices) // batch_size
    return source
