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
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"strategy.{key}={value!r}: must be an integer >= 1")
        degrees = {"dp": s.dp, "pp": s.pp, "tp": s.tp}
        if s.name == "hybrid":
            degrees = _derive_hybrid(degrees, world_size)
            spread = "dp"
        else:
            # The other strategies spread over one dimension; the others stay 1.
            spread = {"single": None, "data": "dp", "pipeline": "pp", "model": "tp"}.get(s.name)
            for key, value in degrees.items():
                if key != spread and value not in (None, 1):
                    raise ConfigError(f"strategy.{key}={value}: strategy={s.name} does not use a {key} dimension "
                                      f"(leave it unset, or use strategy=hybrid to combine dimensions)")
                if key != spread:
                    degrees[key] = 1
            if spread is not None and degrees[spread] is None:
                degrees[spread] = world_size
        product = degrees["dp"] * degrees["pp"] * degrees["tp"]
        if product != world_size:
            label = "strategy=hybrid" if s.name == "hybrid" else f"strategy.{spread or 'dp'}={degrees[spread or 'dp']}"
            raise ConfigError(
                f"{label}: the degrees must multiply to the world size: "
                f"dp {degrees['dp']} x pp {degrees['pp']} x tp {degrees['tp']} = {product} != world size "
                f"{world_size} (leave degrees unset to derive them)")
        return cls(dp=degrees["dp"], pp=degrees["pp"], tp=degrees["tp"], world_size=world_size)

    @classmethod
    def of(cls, s: StrategyConfig, world_size: int) -> "ParallelDims":
        """The degrees of a resolved config (parallel.validate.resolve filled them in)."""
        return cls(dp=s.dp, pp=s.pp, tp=s.tp, world_size=world_size)

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


def _derive_hybrid(degrees: dict, world_size: int) -> dict:
    """Fill unset hybrid degrees.

    One unset degree takes what the others leave of the world size. With dp
    unset among several, the other unset ones are 1 and dp takes the rest. With
    dp set and both pp and tp unset, the split of the rest is the user's to say.
    """
    unset = [k for k, v in degrees.items() if v is None]
    if len(unset) > 1:
        if degrees["dp"] is not None:
            if degrees["dp"] != world_size:
                raise ConfigError(f"strategy.pp=None, strategy.tp=None: dp {degrees['dp']} leaves "
                                  f"{world_size / degrees['dp']:g} of the world size {world_size} to pipeline and "
                                  f"tensor parallelism; set strategy.pp or strategy.tp")
            unset = ["pp"]
            degrees["tp"] = 1
        else:
            for key in ("pp", "tp"):
                if degrees[key] is None:
                    degrees[key] = 1
            unset = ["dp"]
    if unset:
        key = unset[0]
        rest = 1
        for k, v in degrees.items():
            if k != key:
                rest *= v
        if world_size % rest:
            others = " x ".join(f"{k} {v}" for k, v in degrees.items() if k != key)
            raise ConfigError(f"strategy.{key}=None: {others} = {rest} does not divide the world size "
                              f"{world_size}, so {key} cannot be derived")
        degrees[key] = world_size // rest
    return degrees


def device_for_rank(preference: str, local_rank: int) -> torch.device:
    """The compute device of this worker: its own GPU, or the CPU."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device='cuda': no CUDA device is visible (valid: auto, cpu)")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
