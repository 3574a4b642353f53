"""Parallel degrees and the named DeviceMesh built from them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.config import ConfigError, StrategyConfig


@dataclass(frozen=True)
class ParallelDims:
    """The degree of every mesh dimension; their product is the world size."""

    dp: int
    world_size: int

    @classmethod
    def from_config(cls, s: StrategyConfig, world_size: int) -> "ParallelDims":
        """Derive unset degrees from the world size and check that they multiply out.

        Args:
            s: the strategy config (its `dp` may be None).
            world_size: the number of workers.
        """
        dp = world_size if s.dp is None else s.dp
        if not isinstance(dp, int) or dp < 1:
            raise ConfigError(f"strategy.dp={dp!r}: must be an integer >= 1")
        if dp != world_size:
            raise ConfigError(
                f"strategy.dp={dp}: the degrees must multiply to the world size: "
                f"dp {dp} = {dp} != world size {world_size} (leave strategy.dp unset to derive it)")
        return cls(dp=dp, world_size=world_size)

    @property
    def names(self) -> tuple[str, ...]:
        return ("dp",)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.dp,)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh over all ranks (needs an initialized process group)."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)


def device_for_rank(preference: str, local_rank: int) -> torch.device:
    """The compute device of this worker: its own GPU, or the CPU."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device='cuda': no CUDA device is visible (valid: auto, cpu)")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
