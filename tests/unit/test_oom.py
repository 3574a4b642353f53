"""The out-of-memory line's parts (parallel/memory/oom.py, Note [out of memory]), on errors raised here on the CPU
(torch.cuda.OutOfMemoryError exists in the CPU build); the whole line from the command line is in
tests/e2e/test_cli.py."""
import json

import pytest
import torch

from parallel.config import Config
from parallel.memory.oom import changes, figures, oom_chain, out_of_memory, planned_peak, where
from parallel.profiling import run_phase
from parallel.units import human_bytes
from tests import gpus
from tests.user_model import out_of_memory_at


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test looks at whatever was raised
        return e
    raise AssertionError("nothing was raised")


def test_forward_names_the_innermost_module_and_backward_none():
    model = out_of_memory_at(at=1)
    e = _raised(lambda: model(torch.ones(2, 32)))
    assert where(oom_chain(e), model) == where([e], model)
    at = where([e], model)
    assert (at.step, at.phase, at.module) == (None, "forward", "2: OutOfMemoryAt")
    assert where([e]).module == "OutOfMemoryAt"  # no model given: its class

    model = out_of_memory_at(at=1, phase="backward")
    e = _raised(lambda: model(torch.ones(2, 32)).sum().backward())
    at = where([e], model)
    assert (at.phase, at.module) == ("backward", None)  # autograd ran the layer's backward, not the module


def test_an_out_of_memory_wrapped_by_pytorch_is_found_with_its_frames():
    model = out_of_memory_at(at=1)

    def stage():  # as a pipeline stage wraps its forward's error
        try:
            model(torch.ones(2, 32))
        except Exception as e:
            raise RuntimeError("stage 0 failed to run forward") from e

    e = _raised(stage)
    chain = oom_chain(e)
    assert [type(x).__name__ for x in chain] == ["RuntimeError", "OutOfMemoryError"]
    assert where(chain, model).module == "2: OutOfMemoryAt"
    assert oom_chain(_raised(lambda: int("x"))) is None
    assert out_of_memory(ValueError("no"), Config(), model, torch.device("cpu"), None) is None


def test_the_step_and_phase_are_those_the_trainer_named():
    """parallel.profiling.run_phase marks what is raised inside it, innermost phase first; the step from the
    innermost phase that has one."""
    model = out_of_memory_at(at=1)

    def step():
        with run_phase("forward_backward", 7):
            model(torch.ones(2, 32))

    at = where(oom_chain(_raised(step)), model)
    assert (at.step, at.phase, at.module) == (7, "forward", "2: OutOfMemoryAt")

    def saved():
        with run_phase("checkpoint_save", 4), run_phase("unnamed inner part"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    assert (where([_raised(saved)]).step, where([_raised(saved)]).phase) == (4, "checkpoint save")

    def final():
        with run_phase("save_final"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    assert (where([_raised(final)]).step, where([_raised(final)]).phase) == (None, "saving the final weights")


def _resolved(**strategy) -> Config:
    cfg = Config()
    cfg.strategy.dp, cfg.strategy.ep, cfg.strategy.cp = 1, 1, 1
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    return cfg


def test_changes_leave_out_what_is_applied_and_put_the_state_first_after_the_step():
    assert changes(_resolved(), 1, "forward") == [
        "strategy.activations=checkpoint", "trainer.grad_accum=2", "strategy=offload", "trainer.batch_size=16"]
    data = _resolved(name="data", dp=2, activations="checkpoint")
    assert changes(data, 2, "backward") == ["trainer.grad_accum=2", "strategy.zero=3", "trainer.batch_size=16"]
    assert changes(data, 2, "optimizer step") == ["strategy.zero=3", "trainer.grad_accum=2", "trainer.batch_size=16"]
    data.strategy.zero, data.trainer.batch_size = 3, 2  # one sample a rank: nothing left to split
    assert changes(data, 2, "forward") == []
    offload = _resolved(name="offload", activations="cpu")
    assert changes(offload, 1, "forward") == ["trainer.grad_accum=2", "trainer.batch_size=16"]


def test_the_plan_is_auto_json_of_this_strategy_or_none(tmp_path):
    cfg = _resolved(name="data", dp=2, zero=1)
    assert planned_peak(cfg, tmp_path) is None  # no plan was made
    chosen = ["strategy=data", "strategy.zero=1"]
    (tmp_path / "auto.json").write_text(json.dumps({"chosen": chosen, "candidates": [
        {"overrides": ["strategy=data", "strategy.zero=0"], "peak": 9_000_000, "dropped": "over the budget"},
        {"overrides": chosen, "peak": 1_234_000, "dropped": None}]}))
    assert planned_peak(cfg, tmp_path) == 1_234_000
    cfg.strategy.zero = 3  # a run resumed in that directory with another strategy: not that plan's
    assert planned_peak(cfg, tmp_path) is None


def test_the_line_on_the_cpu_says_unknown_and_the_plan(tmp_path):
    assert figures(torch.device("cpu"), None) == "allocated and limit unknown on the cpu (memory.fraction unset)"
    assert figures(torch.device("cpu"), 0.5).endswith("(memory.fraction 0.5)")
    model = out_of_memory_at(at=1)
    cfg = _resolved()
    (tmp_path / "auto.json").write_text(json.dumps({"chosen": ["strategy=single"], "candidates": [
        {"overrides": ["strategy=single"], "peak": 1_234_000, "dropped": None}]}))
    line = str(out_of_memory(_raised(lambda: model(torch.ones(2, 32))), cfg, model, torch.device("cpu"), tmp_path))
    assert line.startswith("out of GPU memory on rank 0 in forward (2: OutOfMemoryAt): allocated and limit unknown")
    assert "; the plan predicts 1.2 MB at its largest rank (strategy=auto, auto.json); try strategy.activations=" \
           "checkpoint, then " in line and "\n" not in line


@pytest.mark.cuda
def test_on_cuda_the_line_names_what_is_allocated_of_the_fraction():
    gpus.call(cuda_figures)  # this process hides the GPUs (Note [tests on a GPU machine])


def cuda_figures() -> None:
    device = torch.device("cuda", 0)
    kept = torch.empty(10**6, dtype=torch.uint8, device=device)
    total = torch.cuda.get_device_properties(device).total_memory
    assert torch.cuda.memory_allocated(device) >= kept.nbytes
    assert figures(device, 0.5) == (f"{human_bytes(torch.cuda.memory_allocated(device))} allocated of "
                                    f"{human_bytes(total * 0.5)} (memory.fraction 0.5)")
