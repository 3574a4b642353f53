"""The torch releases the framework runs on (pyproject: torch>=2.11,<2.16) and the private PyTorch names it
uses, in one place: which releases have each, and a one-line config error where a feature's names are missing.

# Note [torch versions]
Checked by running torch 2.11.0, 2.12.0, 2.14.0 and 2.15.0 (PyPI's CUDA wheels, on a CPU) and 2.13.0 (the CPU
wheel); the unit and multi-process tests ran on 2.11.0, 2.13.0 and 2.15.0, the whole suite on 2.11.0 and 2.13.0. Two private pieces differ within that range; every other private name parallel/ uses
(`ALWAYS` below) is in all five, and tests/unit/test_torch_compat.py resolves each one in the installed torch,
so a release that drops one fails a test that names it rather than a user's run.

  torch.distributed.pipelining._utils.InferenceMode      2.12-2.15 (2.11 has none: stages given their
                                                         shapes never infer them)
  _PipelineSchedule._warmup_p2p                          2.12-2.14 (2.15 folds it into
                                                         `_initialize_pipeline_distributed_state`)

Both serve only the planner's pipeline warm-up (torch_patches.static_pipeline_warmup): on 2.12-2.14 a schedule
begins with a vote between neighbouring stages that reads a received value (nothing arrives over the fake
process group), so the vote is replaced; on 2.11 stages given their shapes skip shape inference and the first
exchange reads nothing, and on 2.15 the schedule itself picks static shapes for a fake process group. Nothing
to replace there, so no release lacks the feature.

# Note [autograd threads and fork]
A CUDA build of torch (the PyPI default, also on a machine with no GPU: 2.11, 2.12, 2.14 and 2.15 checked; the
CPU build of 2.13 does not) starts autograd's per-device threads when a process's first backward runs on fake
tensors, and a process forked after that cannot run a backward ("Unable to handle autograd's threading in
combination with fork-based multiprocessing"). Validation (the pipeline split's block costs) and the planner
run backwards on fake tensors in the launching process, which then forks its CPU workers
(parallel/launcher.py). The engine decides about its threads once, at its first backward
(`Engine::start_device_threads`), so `settle_autograd_threads` runs one on real CPU tensors first: no device
threads (there is no GPU to run them on), and forked workers train.

Features built on private names (context parallelism on CUDA) are checked when the config is validated
(`require`), so a release without them is a config error (exit 2) naming the feature, this torch and the
releases that have it, never an ImportError when the package is imported. Two behaviours of 2.11 break runs
that later releases train (`require_release`, checked in parallel/strategies/pipeline/check.py): the
V-shaped schedules (ZBVZeroBubble, DualPipeV) fail in gloo ("Pair is not connected": 2.11's own p2p setup
leaves the stage pairs they use unconnected), and stages that hand integer tensors on (a Hugging Face
model's, whose blocks sit inside other modules) fail building their receive buffers ("only Tensors of
floating point dtype can require gradients").
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from parallel.config import fail

CHECKED = ("2.11", "2.12", "2.13", "2.14", "2.15")  # the releases Note [torch versions] was checked on

Importer = Callable[[str], Any]


@dataclass(frozen=True)
class Feature:
    """What a user asks for (as the error names it), the private names it needs ("module:attr.attr"), and the
    checked releases that have them."""

    what: str
    names: tuple[str, ...]
    releases: str


_CP = "torch.distributed.tensor.experimental._attention"
_PIPE = "torch.distributed.pipelining"

FEATURES = {
    "cuda_context_parallel": Feature(
        "context parallelism on CUDA (PyTorch's ring attention)",
        (f"{_CP}:_ContextParallel.AttentionType.SDPA", f"{_CP}:_cp_options.enable_load_balance",
         f"{_CP}:_enable_context_parallel_dispatcher", f"{_CP}:_HeadTailLoadBalancer._generate_indices",
         f"{_CP}:set_rotate_method"),
        "2.11-2.15"),
    # The planner's replacement of the pipeline's warm-up vote (Note [torch versions]): where missing, there is
    # no vote to replace.
    "pipeline_warmup_vote": Feature(
        "the pipeline schedules' warm-up vote",
        (f"{_PIPE}.schedules:_PipelineSchedule._warmup_p2p", f"{_PIPE}._utils:InferenceMode.STATIC"),
        "2.12-2.14"),
}

# Private names imported where they are used, in every checked release (Note [torch versions]).
ALWAYS = (
    f"{_PIPE}.schedules:_batch_p2p", f"{_PIPE}.schedules:_ComputationType.OVERLAP_F_B",
    f"{_PIPE}.schedules:_ComputationType.UNSHARD",
    "torch.distributed._composable.replicate:replicate", "torch.distributed._composable.replicate_with_fsdp:replicate",
    "torch.distributed._composable:checkpoint", "torch.distributed._functional_collectives:all_to_all_single_autograd",
    "torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
    "torch.distributed.distributed_c10d:_resolve_process_group", "torch.distributed.device_mesh:DeviceMesh._flatten",
    "torch.distributed.device_mesh:DeviceMesh._unflatten",
    "torch.distributed.distributed_c10d:_set_pg_timeout", "torch.distributed.distributed_c10d:_world",
    "torch.testing._internal.distributed.fake_pg:FakeStore",
    "torch._dynamo.callback:CallbackArgs", "torch._dynamo.callback:callback_handler",
    "torch._guards:detect_fake_mode", "torch._subclasses.fake_tensor:FakeTensorMode",
    "torch._subclasses.fake_tensor:unset_fake_temporarily",
    "torch.utils._python_dispatch:TorchDispatchMode", "torch.utils._python_dispatch:_disable_current_modes",
    "torch.utils._python_dispatch:is_traceable_wrapper_subclass",
    "torch.utils._python_dispatch:is_in_torch_dispatch_mode",
    "torch.utils._pytree:tree_flatten", "torch.utils._pytree:tree_map", "torch.utils._pytree:tree_map_only",
    "torch:_C._current_graph_task_id", "torch:_C._get_privateuse1_backend_name",
    "torch:ops._c10d_functional.wait_tensor.default", "torch:ops._c10d_functional.all_to_all_single",
    "torch:ops.c10d._reduce_scatter_base_.default",
    "torch:profiler._ExperimentalConfig", "torch:cuda.memory._record_memory_history",
    "torch:cuda.memory._dump_snapshot",
    "torch.nn.modules.batchnorm:_BatchNorm", "torch.nn.modules.batchnorm:_NormBase",
    "torch.nn.modules.conv:_ConvNd", "torch.nn.modules.conv:_ConvTransposeNd",
)


_autograd_settled = False


def settle_autograd_threads() -> None:
    """Run one backward on real CPU tensors before the process's first on fake ones (Note [autograd threads and
    fork]); once per process."""
    global _autograd_settled
    if _autograd_settled:
        return
    _autograd_settled = True
    if torch.accelerator.is_available():
        return  # workers are spawned, not forked (parallel/launcher.py)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.enable_grad():
        x = torch.ones(1, requires_grad=True)
        x.sum().backward()


def find(name: str, importer: Importer = importlib.import_module) -> Any | None:
    """The object a "module:attr.attr" name points at, or None when this torch lacks the module or an attribute."""
    module, _, attrs = name.partition(":")
    try:
        obj = importer(module)
    except ImportError:
        return None
    for attr in attrs.split(".") if attrs else ():
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


def missing(names, importer: Importer = importlib.import_module) -> list[str]:
    """The names of `names` this torch lacks."""
    return [n for n in names if find(n, importer) is None]


def has(feature: str, importer: Importer = importlib.import_module) -> bool:
    """Whether this torch has every name `feature` (a key of FEATURES) needs."""
    return not missing(FEATURES[feature].names, importer)


def require(feature: str, key: str, value: Any, options: Any = None, *, version: str | None = None,
            importer: Importer = importlib.import_module) -> None:
    """A ConfigError (one line: the key and value that asked for `feature`, the missing name, this torch and the
    releases that have it) when this torch lacks a name the feature needs.

    Args:
        feature: a key of FEATURES.
        key, value, options: the setting that asked for the feature, and what the user may set instead.
        version, importer: this torch's version and module import (stand-ins for tests).
    """
    f = FEATURES[feature]
    gone = missing(f.names, importer)
    if gone:
        fail(key, value, f"{f.what} needs {gone[0].replace(':', '.')}, which torch {version or torch.__version__} "
             f"lacks (torch {f.releases} have it)", options)


def release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: this torch's), e.g. (2, 13) for "2.13.0+cpu"."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def require_release(at_least: str, what: str, key: str, value: Any, options: Any = None, *,
                    version: str | None = None) -> None:
    """A ConfigError (one line) when this torch is older than `at_least` ("2.12"), for `what` a behaviour of the
    older releases breaks (not a missing name: Note [torch versions])."""
    if release(version) < release(at_least):
        fail(key, value, f"{what} needs torch >= {at_least}; this is torch {version or torch.__version__}", options)
