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
    pp: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, s: StrategyConfig, world_size: int) -> "ParallelDims":
        """Derive unset degrees from the world size and check that they multiply out.

        Args:
            s: the strategy config (degrees may be None).
            world_size: the number of workers.
        """
        for key in ("dp", "pp", "tp"):
            value = getattr(s, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"strategy.{key}={value!r}: must be an integer >= 1")
        # Each strategy spreads over one dimension; the others stay 1.
        spread = {"single": None, "data": "dp", "pipeline": "pp", "model": "tp"}.get(s.name)
        degrees = {"dp": s.dp, "pp": s.pp, "tp": s.tp}
        for key, value in degrees.items():
            if key != spread and value not in (None, 1):
                raise ConfigError(f"strategy.{key}={value}: strategy={s.name} does not use a {key} dimension "
                                  f"(leave it unset; combining dimensions is not supported yet)")
            if key != spread:
                degrees[key] = 1
        if spread is not None and degrees[spread] is None:
            degrees[spread] = world_size
        product = degrees["dp"] * degrees["pp"] * degrees["tp"]
        if product != world_size:
            raise ConfigError(
                f"strategy.{spread or 'dp'}={degrees[spread or 'dp']}: the degrees must multiply to the world size: "
                f"dp {degrees['dp']} x pp {degrees['pp']} x tp {degrees['tp']} = {product} != world size "
                f"{world_size} (leave degrees unset to derive them)")
        return cls(dp=degrees["dp"], pp=degrees["pp"], tp=degrees["tp"], world_size=world_size)

    @property
    def names(self) -> tuple[str, ...]:
        return ("dp", "pp", "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.dp, self.pp, self.tp)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh over all ranks (needs an initialized process group).

        tp is innermost, so the ranks of a tensor-parallel group are consecutive
        and, with torchrun's numbering, on one node where its traffic is heaviest.
        """
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)


def device_for_rank(preference: str, local_rank: int) -> torch.device:
    """The compute device of this worker: its own GPU, or the CPU."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device='cuda': no CUDA device is visible (valid: auto, cpu)")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
