"""Data sources: each yields this rank's slice of the global batch for a step."""
from __future__ import annotations

from parallel.config import DataConfig
from parallel.data.synthetic import SyntheticData


def build_data(cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1):
    """The configured source: SyntheticData, or ShardData for data=shards."""
    if cfg.name == "shards":
        from parallel.data.shards import ShardData

        return ShardData(cfg, seed, batch_size, dp_rank, dp_size)
    return SyntheticData(cfg, seed, batch_size, dp_rank, dp_size)


__all__ = ["SyntheticData", "build_data"]
