"""Blocks alike planned once (Note [planning by depth]): a model of five blocks traced at 2, 3 and 4 and its plan
extended gives the bytes, work and collectives of the plan that traces all five, role by role."""
import dataclasses
import tempfile

import pytest
from torch import nn

from parallel.config import Config
from parallel.dims import ParallelDims
from parallel.planning import depth, planner
from parallel.planning.allocator import LARGE_SEGMENT
from parallel.planning.planner import plan
from parallel.validate import validate

GPT = {"vocab_size": 64, "seq_len": 16, "dim": 32, "heads": 4, "layers": 5}
CUDA = {"trainer.device": "cuda", "trainer.precision": "bf16"}
CASES = {
    "data_zero3_cuda": (2, {"strategy.name": "data", "strategy.zero": 3, **CUDA}),
    "checkpoint_cuda": (1, {"strategy.activations": "checkpoint", **CUDA}),  # its peak moves to the optimizer
    # a CPU run's plan replays its op calls here and is traced whole (traced_whole); its bytes extend alike
    "single": (1, {}),
}


def _cfg(world: int, settings: dict, every_block: bool = False) -> Config:
    cfg = Config()
    cfg.model.name, cfg.model.args, cfg.data.task = "gpt", dict(GPT), "lm"
    cfg.data.seq_len, cfg.trainer.batch_size = 16, 8
    for key, value in settings.items():
        group, name = key.split(".")
        setattr(getattr(cfg, group), name, value)
    cfg.plan.every_block = every_block
    validate(cfg, world)
    return cfg


@pytest.mark.parametrize("case", CASES)
def test_a_plan_extended_by_depth_is_the_plan_of_every_block(case, monkeypatch):
    world, settings = CASES[case]
    whole = plan(_cfg(world, settings, every_block=True), world)
    cfg = _cfg(world, settings)
    dims = ParallelDims.of(cfg.strategy, world)
    if "trainer.device" in settings:
        assert not depth.traced_whole(cfg, dims, by_module=False)
        extended = []
        monkeypatch.setattr(planner, "extend", lambda *a: extended.append(depth.extend(*a)) or extended[-1])
        fast = plan(cfg, world)
        assert extended and extended[-1] is fast  # traced at 2, 3 and 4 blocks and extended, not traced whole
    else:
        assert depth.traced_whole(cfg, dims, by_module=False)
        with tempfile.TemporaryDirectory() as run_dir:
            fast = depth.extend({d: planner._plan_roles(cfg, dims, run_dir, False, ("blocks", d))
                                 for d in depth.DEPTHS}, GPT["layers"], "blocks")
    for a, b in zip(whole, fast, strict=True):
        for f in dataclasses.fields(a):
            if f.name in depth.RESERVED:  # the segments: on their line within 2 x 20 MiB, never under the total
                assert abs(getattr(b, f.name) - getattr(a, f.name)) <= 2 * LARGE_SEGMENT, f.name
                assert getattr(b, f.name) >= b.total if "trainer.device" in settings else getattr(b, f.name) == 0
            elif f.name not in ("tally", "by_module", "calls"):
                assert getattr(b, f.name) == getattr(a, f.name), f.name
        # the calls of every depth, each as often as in the whole trace; the rest (over every parameter) is
        # priced by its class from the work, equal above
        assert b.calls and all(a.calls[key] == row for key, row in b.calls.items())
        assert a.total > 0 and a.work["products"] and b.peak_phase in b.phases


def test_zero_1_and_pipelines_are_traced_whole():
    """ZeRO-1's partition of whole parameters (by size, over the ranks) and a pipeline's split by the blocks'
    weight do not grow block by block."""
    for strategy in ({"strategy.name": "data", "strategy.zero": 1}, {"strategy.name": "pipeline"}):
        cfg = _cfg(2, {**strategy, **CUDA})
        assert depth.traced_whole(cfg, ParallelDims.of(cfg.strategy, 2), by_module=False)


def test_blocks_that_differ_are_not_alike():
    """A list of blocks of one class but other shapes, or another setting (as Gemma's sliding and full attention
    layers), is no list of blocks alike; one whose settings only number the blocks is."""
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
    assert depth.block_list(model)[0] == "layers"
    for i, layer in enumerate(model.layers):
        layer.layer_idx = i
    assert depth.block_list(model)[0] == "layers"
    model.layers[3].sliding_window = 4
    assert depth.block_list(model) is None
    model.layers = nn.ModuleList(nn.Linear(8, 8 + i % 2) for i in range(6))
    assert depth.block_list(model) is None
    model.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))  # no deeper than the depths traced
    assert depth.block_list(model) is None
