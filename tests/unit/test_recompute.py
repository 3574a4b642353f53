"""What backward recomputes (parallel/strategies/recompute.py, Note [selective recomputation]): the same gradients
and BatchNorm statistics as without, the blocks `selective=N` picks, and a plan's bytes and work between keeping
every activation and recomputing every block."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from parallel.config import Config
from parallel.planning.planner import plan
from parallel.strategies.recompute import Recompute, recompute_blocks
from parallel.validate import validate


class Block(nn.Module):
    """Products, a BatchNorm (running statistics), dropout (random numbers) and an activation."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(width, 2 * width), nn.BatchNorm1d(2 * width), nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        return x + self.down(self.drop(torch.nn.functional.gelu(self.norm(self.up(x)))))


def _blocks(n: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"layers": nn.ModuleList(Block() for _ in range(n))})


def _step(model: nn.Module) -> dict:
    torch.manual_seed(1)
    x = torch.randn(16, 8)
    for layer in model["layers"]:
        x = layer(x)
    x.square().mean().backward()
    return {**{f"{k}.grad": p.grad for k, p in model.named_parameters()}, **dict(model.named_buffers())}


@pytest.mark.parametrize("how", [Recompute(ops=True), Recompute(ops=True, alternate=True), Recompute(every=2),
                                 Recompute()], ids=["op", "op_alternate", "2", "checkpoint"])
def test_recomputed_blocks_give_the_gradients_and_statistics_of_none(how):
    plain, recomputed = _blocks(), _blocks()
    recompute_blocks(recomputed, [f"layers.{i}" for i in range(4)], how)
    want, got = _step(plain), _step(recomputed)
    for key, value in want.items():  # the same ops on the same inputs: equal, not close
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    assert int(got["layers.0.norm.num_batches_tracked"]) == 1  # moved once, not again when recomputed


def test_op_alternate_recomputes_every_second_product_of_each_forward_and_recomputation():
    """op_alternate's policy: products 1, 3, ... of a block's forward saved, 2, 4, ... recomputed, attention and
    op's other saved ops saved, the rest recomputed; counted apart in the recomputation, and afresh per forward."""
    from torch.utils.checkpoint import CheckpointPolicy

    from parallel.strategies.recompute import _policy

    aten, save, again = torch.ops.aten, CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    forward, recompute = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    ops = [aten.mm.default, aten.gelu.default, aten.addmm.default, aten._scaled_dot_product_flash_attention.default,
           aten.mm.default, aten.bmm.default]
    want = [save, again, again, save, save, again]
    policy = _policy(alternate=True)
    assert [policy(forward, op) for op in ops] == want
    assert [policy(recompute, op) for op in ops] == want  # the recomputation counts from 1 again
    assert [policy(forward, aten.mm.default) for _ in range(2)] == [save, again]  # its 5th and 6th products
    assert _policy(alternate=True)(forward, aten.bmm.default) == save  # a fresh policy per forward: its 1st
    assert [_policy(alternate=False)(forward, op) for op in ops] == [save, again, save, save, save, save]


def test_every_nth_block_is_counted_over_the_whole_model():
    """selective=2: blocks 0 and 2 of 4, also in a pipeline stage that holds blocks 1 to 3."""
    names = ["embed", *(f"layers.{i}" for i in range(4)), "head"]
    whole, stage = _blocks(), _blocks()
    recompute_blocks(whole, names, Recompute(every=2))
    recompute_blocks(stage, names, Recompute(every=2), called={"layers.1", "layers.2", "layers.3", "head"})
    hooked = [[i for i, b in enumerate(m["layers"]) if b._forward_pre_hooks] for m in (whole, stage)]
    assert hooked == [[0, 2], [2]]


def _gpt(**strategy) -> Config:
    cfg = Config()
    cfg.model.name, cfg.data.task, cfg.data.seq_len, cfg.trainer.batch_size = "gpt", "lm", 16, 8
    cfg.model.args = {"vocab_size": 64, "seq_len": 16, "dim": 32, "heads": 4, "layers": 2}
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    validate(cfg, 1)
    return cfg


def test_selective_plans_between_keeping_and_recomputing_everything():
    """On the gpt: the peak of selective=op below keeping every activation and above checkpoint's; the products'
    FLOPs those of no recomputation (their outputs are saved), the other ops run again, as checkpoint's
    recomputed forward is counted (Note [step work])."""
    device, op, checkpoint = (plan(_gpt(**s), 1)[0] for s in (
        {}, {"activations": "selective"}, {"activations": "checkpoint"}))
    assert device.total > op.total > checkpoint.total
    assert op.flops == device.flops < checkpoint.flops
    assert device.ops < op.ops
    assert op.work["products"] == device.work["products"]
    assert sum(n for _, n in op.work["memory"].values()) > sum(n for _, n in device.work["memory"].values())


def test_selective_op_under_fsdp2_in_bf16_plans_between_keeping_and_recomputing():
    """Data zero 3 over 2 ranks in bf16 (FSDP2 opens profiler ranges in backward that no forward opened inside the
    block; torch's selective checkpoint refused them): planned as the workers run it, the products' outputs
    saved and the rest run again."""
    def planned(**strategy):
        cfg = Config()
        cfg.model.name, cfg.data.task, cfg.data.seq_len, cfg.trainer.batch_size = "gpt", "lm", 16, 8
        cfg.model.args = {"vocab_size": 64, "seq_len": 16, "dim": 32, "heads": 4, "layers": 2}
        cfg.trainer.device, cfg.trainer.precision = "cuda", "bf16"
        cfg.strategy.name, cfg.strategy.zero = "data", 3
        for key, value in strategy.items():
            setattr(cfg.strategy, key, value)
        validate(cfg, 2)
        return plan(cfg, 2)[0]

    device, op = planned(), planned(activations="selective")
    assert device.total >= op.total  # the cuBLAS workspaces (64 MiB) dwarf the activations
    assert device.activations > op.activations and op.flops == device.flops and device.ops < op.ops
