"""Parallel degrees, the named DeviceMesh built from them, and each process's device (a GPU of its own on CUDA).

# Note [mesh dimensions]
The mesh is (dp, ep, pp, cp, tp), tp innermost; every dimension is always present (size 1 when unused), so
`mesh["cp"]` and `mesh["ep"]` always work. What each dimension splits:

    dp  the global batch (whole samples)
    ep  the global batch too, and the experts of a mixture-of-experts layer
    pp  the layers (pipeline stages)
    cp  each sample's sequence (context parallelism); cp ranks read the same samples
    tp  each layer's weights

The dense (non-expert) weights are data-parallel over dp x ep x cp (`data_mesh`): every rank of that flattened
submesh holds the same dense pieces and computes gradients over different tokens. A batch is split over
dp x ep (`batch_mesh`).

# Note [hybrid sharding]
strategy.dp_replicate = R (zero 2 and 3) is PyTorch's HSDP: FSDP2's `fully_shard` over a 2-D mesh
(dp_replicate, dp_shard), the dense weights' data-parallel ranks (`data_mesh`, N = dp x ep x cp of them)
unflattened into R groups of N / R (`fsdp_mesh`). A parameter is Shard(0) over the N / R ranks of its group and
Replicate over the R groups, so a rank holds 1 / (N / R) of the weights (zero 3), gradients and optimizer state, R
times what sharding over all N holds; a gradient is reduce-scattered within the group, then its shard all-reduced
across the R groups, and the all-gathers of zero 3 stay inside the group. The groups are consecutive blocks of dp
(replicate outermost, as the mesh's dimensions are), so with torchrun's numbering a group spans the fewest nodes
and the all-reduce of the shards, 1 / (N / R) of the gradients, is the only data-parallel traffic between groups.
R = 1 (or unset) is one group of all N ranks: plain FSDP2. Zero 0 holds every weight whole on every rank and
zero 1 shards only the optimizer state, over all N; neither has a sharded group to replicate, so R above 1 is
refused there, as under hybrid with ep > 1, whose experts are FSDP2 units of their own over mesh["dp"]
(parallel.strategies.data.check_replicas).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.config import ConfigError, StrategyConfig, strategy_spec

NAMES = ("dp", "ep", "pp", "cp", "tp")  # Note [mesh dimensions]: outermost first


@dataclass(frozen=True)
class ParallelDims:
    """The degree of every mesh dimension; their product is the world size."""

    dp: int
    pp: int
    tp: int
    world_size: int
    cp: int = 1
    ep: int = 1

    @classmethod
    def from_config(cls, s: StrategyConfig, world_size: int) -> "ParallelDims":
        """Derive unset degrees from the world size and check that they multiply out.

        Args:
            s: the strategy config (degrees may be None).
            world_size: the number of workers.
        """
        for key in NAMES:
            value = getattr(s, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"strategy.{key}={value!r}: must be an integer >= 1")
        degrees = {key: getattr(s, key) for key in NAMES}
        spec = strategy_spec(s.name)  # the dimensions it spreads over (Note [strategy table])
        if spec.combines:
            degrees = _derive_hybrid(degrees, world_size)
            spread = "dp"
        else:
            spread = spec.spreads[0] if spec.spreads else None
            for key, value in degrees.items():
                if key != spread and value not in (None, 1):
                    raise ConfigError(f"strategy.{key}={value}: strategy={s.name} does not use a {key} dimension "
                                      f"(leave it unset, or use strategy=hybrid to combine dimensions)")
                if key != spread:
                    degrees[key] = 1
            if spread is not None and degrees[spread] is None:
                degrees[spread] = world_size
        product = 1
        for value in degrees.values():
            product *= value
        if product != world_size:
            label = f"strategy={s.name}" if spec.combines else f"strategy.{spread or 'dp'}={degrees[spread or 'dp']}"
            arithmetic = " x ".join(f"{k} {v}" for k, v in degrees.items())
            raise ConfigError(f"{label}: the degrees must multiply to the world size: {arithmetic} = {product} "
                              f"!= world size {world_size} (leave degrees unset to derive them)")
        return cls(world_size=world_size, **degrees)

    @classmethod
    def of(cls, s: StrategyConfig, world_size: int) -> "ParallelDims":
        """The degrees of a resolved config (parallel.validate.resolve filled them in)."""
        return cls(dp=s.dp, pp=s.pp, tp=s.tp, cp=s.cp or 1, ep=s.ep or 1, world_size=world_size)

    @property
    def names(self) -> tuple[str, ...]:
        return NAMES

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, key) for key in NAMES)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh over all ranks (needs an initialized process group).

        tp is innermost, so the ranks of a tensor-parallel group are consecutive
        and, with torchrun's numbering, on one node where its traffic is heaviest.
        """
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)


def _flat(mesh: DeviceMesh, names: tuple[str, ...], name: str) -> DeviceMesh:
    """The 1-D mesh over the ranks of `names` (Note [mesh dimensions]); mesh["dp"] itself when the others are 1.

    DeviceMesh's `_flatten` (the way torchtitan builds its dp_shard_cp mesh; torch 2.13 has no public spelling)
    makes the flattened mesh once per name, with process groups of its own: the data-parallel collectives then
    never share a group with context or expert parallelism's exchanges.
    """
    if all(mesh[n].size() == 1 for n in names[1:]):
        return mesh[names[0]]
    return mesh[names]._flatten(name)


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that hold the same dense weights: dp x ep x cp, flattened (Note [mesh dimensions])."""
    return _flat(mesh, ("dp", "ep", "cp"), "dp_ep_cp")


def fsdp_mesh(mesh: DeviceMesh, replicas: int | None = None) -> DeviceMesh:
    """The mesh FSDP2 spreads the dense weights over: `data_mesh`, or with `replicas` (strategy.dp_replicate)
    above 1 that mesh unflattened into (dp_replicate, dp_shard), `replicas` groups of consecutive ranks (Note
    [hybrid sharding]). Each call makes the 2-D mesh's process groups anew: a builder asks once."""
    dense = data_mesh(mesh)
    if (replicas or 1) == 1:
        return dense
    return dense._unflatten(0, (replicas, dense.size() // replicas), ("dp_replicate", "dp_shard"))


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that each read their own share of the global batch: dp x ep, flattened."""
    return _flat(mesh, ("dp", "ep"), "dp_ep")


def _derive_hybrid(degrees: dict, world_size: int) -> dict:
    """Fill the unset degrees of a strategy that combines dimensions (hybrid).

    Unset cp and ep are 1 (context and expert parallelism are asked for by name). Then one unset degree takes
    what the others leave of the world size. With dp unset among several, the other unset ones are 1 and dp
    takes the rest. With dp set and both pp and tp unset, the split of the rest is the user's to say.
    """
    for key in ("cp", "ep"):
        if degrees[key] is None:
            degrees[key] = 1
    unset = [k for k, v in degrees.items() if v is None]
    if len(unset) > 1:
        if degrees["dp"] is not None:
            given = degrees["dp"] * degrees["ep"] * degrees["cp"]
            if given != world_size:
                raise ConfigError(f"strategy.pp=None, strategy.tp=None: dp {degrees['dp']} x ep {degrees['ep']} x "
                                  f"cp {degrees['cp']} leaves {world_size / given:g} of the world size {world_size} "
                                  f"to pipeline and tensor parallelism; set strategy.pp or strategy.tp")
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
    """The compute device of this worker: its own GPU (`check_gpus` made sure there is one), or the CPU."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device='cuda': no CUDA device is visible (valid: auto, cpu)")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass(frozen=True)
class Gpus:
    """The GPUs this process sees: how many, and CUDA_VISIBLE_DEVICES (None: unset). A test makes its own."""

    count: int
    visible: str | None

    @classmethod
    def here(cls) -> "Gpus":
        return cls(torch.cuda.device_count() if torch.cuda.is_available() else 0,
                   os.environ.get("CUDA_VISIBLE_DEVICES"))

    def variable(self) -> str:
        return "CUDA_VISIBLE_DEVICES unset" if self.visible is None else f"CUDA_VISIBLE_DEVICES={self.visible!r}"


def check_gpus(device: str, processes: int | None, started_by: str | None = None, gpus: Gpus | None = None) -> None:
    """A CUDA run gives each process on this machine a GPU of its own (`device_for_rank`): more processes than
    visible GPUs is a config error before any worker starts. Two processes on one GPU would not share it
    quietly: nccl refuses them ("Duplicate GPU detected") after every worker has started. trainer.device=auto
    with too many processes is the same error, not a quiet fall back to the CPU.

    Args:
        device: trainer.device.
        processes: the workers on this machine: nproc, or the launcher's LOCAL_WORLD_SIZE (None: unknown,
            nothing is checked).
        started_by: the launcher that started the workers ("torchrun", "the SLURM job"), None: this process.
        gpus: what this machine shows; None: `Gpus.here()` (asked only for a run that may use CUDA).
    """
    if device == "cpu" or processes is None:
        return
    gpus = gpus or Gpus.here()
    if gpus.count == 0:
        if device == "cuda":
            raise ConfigError(f"trainer.device='cuda': no CUDA device is visible here ({gpus.variable()}; valid: "
                              f"auto, cpu)")
        return  # auto on a machine without a GPU: the CPU
    if processes <= gpus.count:
        return
    if started_by is None:
        given, fewer = f"nproc={processes}", f"nproc={gpus.count}"
    elif started_by == "torchrun":
        given, fewer = f"LOCAL_WORLD_SIZE={processes}", f"torchrun --nproc-per-node {gpus.count}"
    else:
        given, fewer = f"LOCAL_WORLD_SIZE={processes}", f"{gpus.count} tasks per node in {started_by}"
    visible = f"{gpus.count} GPU is" if gpus.count == 1 else f"{gpus.count} GPUs are"
    raise ConfigError(f"{given}: {processes} processes on this machine with trainer.device={device} need a GPU each, "
                      f"and {visible} visible ({gpus.variable()}); start at most {gpus.count} ({fewer}), train on "
                      f"the CPU (trainer.device=cpu), or make more GPUs visible")


# Note [two timeouts]
# Building a run (the model, the user's initial values handed from rank 0, a
# checkpoint read back), compiling its blocks and its first step may take far
# longer than a step: a large model's initialisation or a cold compile. Every
# collective before the end of the first step waits up to trainer.init_timeout_s
# (the process group is opened with it, parallel/launcher.py; the mesh's and the
# pipeline's groups are set to it once built); after the first step the trainer
# lowers every group to trainer.timeout_s, so that a rank that hangs later is
# found in minutes. torch gives each new group its backend's default (30 min on
# gloo, 10 on NCCL), not the world group's, hence every group of the process.


def set_collective_timeout(seconds: float) -> None:
    """Every process group of this process waits `seconds` at most for a collective (Note [two timeouts])."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world  # private: parallel/torch_compat.py

    if not dist.is_initialized():
        return
    for group in list(_world.pg_map):
        if dist.get_rank(group) >= 0:  # this rank is in it
            _set_pg_timeout(timedelta(seconds=seconds), group)
