"""The torch releases' private names (Note [torch versions] in parallel/torch_compat.py): the one-line error where a
release lacks a feature's names (a pretend release and importer injected), and every name resolving in this torch."""
import importlib
import re
import types

import pytest
import torch

from parallel import torch_compat
from parallel.config import ConfigError
from parallel.torch_patches import static_pipeline_warmup


def _importer_without(module: str, attr: str | None = None):
    """An import that lacks `module` (attr None) or the attribute `attr` of `module`, and is torch's otherwise."""
    def load(name: str):
        if name != module:
            return importlib.import_module(name)
        if attr is None:
            raise ModuleNotFoundError(f"No module named {name!r}")
        real = importlib.import_module(name)
        return types.SimpleNamespace(**{k: v for k, v in vars(real).items() if k != attr})
    return load


CP = "torch.distributed.tensor.experimental._attention"


@pytest.mark.parametrize("load,gone", [
    (_importer_without(CP, "_HeadTailLoadBalancer"), f"{CP}._HeadTailLoadBalancer._generate_indices"),
    (_importer_without(CP), f"{CP}._ContextParallel.AttentionType.SDPA"),
], ids=["attribute", "module"])
def test_a_release_without_the_names_is_a_one_line_config_error(load, gone):
    with pytest.raises(ConfigError) as e:
        torch_compat.require("cuda_context_parallel", "strategy.cp", 2, ["trainer.device=cpu", "1"], version="2.99.0",
                             importer=load)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("strategy.cp=2: context parallelism on CUDA")
    assert f"needs {gone}, which torch 2.99.0 lacks (torch 2.11-2.15 have it)" in msg
    assert "trainer.device=cpu" in msg


def test_this_torch_has_what_its_release_should():
    """Every checked release has context parallelism's names; the warm-up vote only 2.12-2.14."""
    release = tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    torch_compat.require("cuda_context_parallel", "strategy.cp", 2)  # no error
    assert torch_compat.has("pipeline_warmup_vote") == ((2, 12) <= release <= (2, 14))


@pytest.mark.parametrize("name", torch_compat.ALWAYS)
def test_every_private_name_parallel_uses_is_in_this_torch(name):
    assert torch_compat.find(name) is not None, f"torch {torch.__version__} lacks {name}: Note [torch versions]"


def test_find_tells_a_missing_attribute_from_a_present_one():
    load = _importer_without("torch.distributed.pipelining._utils", "InferenceMode")
    assert torch_compat.find("torch.distributed.pipelining._utils:InferenceMode.STATIC", load) is None
    assert torch_compat.missing(["torch:nn.Linear", "torch:nn.NoSuchLayer"]) == ["torch:nn.NoSuchLayer"]


def test_the_planner_warmup_leaves_the_schedules_as_they_were():
    from torch.distributed.pipelining import schedules

    before = dict(vars(schedules._PipelineSchedule))
    with static_pipeline_warmup():
        pass
    assert dict(vars(schedules._PipelineSchedule)) == before


def _backward_in_child(conn):
    try:
        torch.ones(1, requires_grad=True).sum().backward()
        conn.send("ok")
    except RuntimeError as e:
        conn.send(str(e))


def test_a_process_forked_after_a_fake_backward_runs_backward():
    """Note [autograd threads and fork]: validation and the planner run backwards on fake tensors (`faking`)
    in the process that then forks the CPU workers."""
    import multiprocessing

    from parallel.tensors import faking

    with faking():
        torch.ones(2, 2, requires_grad=True).sum().backward()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_backward_in_child, args=(child,))
    proc.start()
    proc.join(60)
    assert parent.recv() == "ok"


def test_a_behaviour_of_an_older_release_is_a_one_line_config_error():
    from parallel.torch_compat import release, require_release

    assert release("2.13.0+cpu") == (2, 13) and release("2.11.0") < release("2.12")
    require_release("2.12", "a V-shaped schedule's stage pairs", "strategy.schedule", "ZBVZeroBubble",
                    version="2.12.0")  # new enough: nothing
    with pytest.raises(ConfigError) as info:
        require_release("2.12", "a V-shaped schedule's stage pairs", "strategy.schedule", "ZBVZeroBubble",
                        ["1F1B"], version="2.11.0")
    assert str(info.value) == ("strategy.schedule='ZBVZeroBubble': a V-shaped schedule's stage pairs needs torch "
                               ">= 2.12; this is torch 2.11.0 (valid: ['1F1B'])")
