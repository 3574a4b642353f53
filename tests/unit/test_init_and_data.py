"""Initialization by name, deterministic data, the live-bytes tracker."""
import torch

from parallel.config import DataConfig, LossConfig
from parallel.data.synthetic import SyntheticData
from parallel.init import ByName, init_plan, materialize_and_init, name_seed
from parallel.loss import Loss
from parallel.memory.tracker import LiveTensorBytes
from parallel.models import MODELS


def _init(model_fn, seed=0):
    with torch.device("meta"):
        model = model_fn()
    return materialize_and_init(model, torch.device("cpu"), init_plan(model), ByName(seed, model))


def test_init_depends_on_seed_and_name_only():
    a = _init(lambda: MODELS["mlp"](depth=2))
    b = _init(lambda: MODELS["mlp"](depth=4))  # a bigger model: shared names get the same values
    for name, p in a.named_parameters():
        torch.testing.assert_close(p, dict(b.named_parameters())[name], rtol=0, atol=0)
    c = _init(lambda: MODELS["mlp"](depth=2), seed=1)
    assert not torch.equal(a.inp.weight, c.inp.weight)
    # Two same-shaped layers with different names differ.
    assert not torch.equal(a.blocks[0].fc.weight, a.blocks[1].fc.weight)


def test_init_follows_pytorch_default_scales():
    model = _init(lambda: MODELS["gpt"](dim=32, heads=2, layers=1))
    bound = 1 / 32 ** 0.5
    w = model.blocks[0].attn.q.weight
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert torch.equal(model.norm.weight, torch.ones(32)) and torch.equal(model.norm.bias, torch.zeros(32))
    assert abs(model.tok.weight.std().item() - 1.0) < 0.1


def test_name_seed_is_stable():
    # Fixed across processes and Python versions (not Python's salted hash).
    assert name_seed(0, "inp.weight") == name_seed(0, "inp.weight") != name_seed(0, "inp.bias")
    assert name_seed(0, "inp.weight") == 5576034184804569525  # pinned: changing it changes every run's init


def test_global_batch_depends_only_on_seed_and_step():
    cfg = DataConfig(task="regression")
    one = SyntheticData(cfg, seed=3, batch_size=8)
    halves = [SyntheticData(cfg, seed=3, batch_size=8, dp_rank=r, dp_size=2) for r in range(2)]
    for step in (1, 7):
        x, y = one.batch(step, torch.device("cpu"))
        parts = [h.batch(step, torch.device("cpu")) for h in halves]
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), x, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), y, rtol=0, atol=0)
    assert not torch.equal(one.batch(1, torch.device("cpu"))[0], one.batch(2, torch.device("cpu"))[0])


def test_every_task_gives_a_finite_loss():
    for task, model in (("regression", MODELS["mlp"](32, 4)), ("classification", MODELS["mlp"](32, 10)),
                        ("lm", MODELS["gpt"](vocab_size=64, seq_len=32, dim=16, heads=2, layers=1))):
        data = SyntheticData(DataConfig(task=task), seed=0, batch_size=4)
        x, y = data.batch(1, torch.device("cpu"))
        loss = Loss(LossConfig(), task)
        loss.start_step(y, None, 1)
        loss = loss(model(x), y)
        assert loss.ndim == 0 and torch.isfinite(loss)


def test_tracker_counts_live_tensor_bytes():
    tracker = LiveTensorBytes("cpu")
    w = torch.zeros(1000)  # 4000 bytes, existing before the step
    tracker.track([w])
    with tracker:
        a = torch.ones(2000)  # +8000
        b = a * 2  # +8000 -> peak 20000
        del a, b
        c = torch.ones(500)  # after the frees: 4000 + 2000
        view = c[:10]  # a view adds nothing
    assert tracker.peak == 20000
    assert tracker.current == 6000
    del c, view
    assert tracker.current == 4000


def test_tracker_sees_storage_resize():
    t = torch.zeros(1000)
    tracker = LiveTensorBytes("cpu")
    tracker.track([t])
    with tracker:
        t.untyped_storage().resize_(0)
        _ = torch.ones(100)
    assert tracker.current == 400 and tracker.peak == 4000
    out = torch.empty(0)
    tracker.track([out])
    with tracker:  # an op that resizes its out= argument (Note [storages resized in place])
        torch.add(torch.ones(10), 1, out=out)
        assert tracker.current == 400 + 40
    t.untyped_storage().resize_(4000)  # resized while no tracker watched: the next look rereads every size
    with tracker:
        assert tracker.current == 4000 + 400 + 40  # t, the ones above (still held by `_`), out


class _Seen(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op dispatched through it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_counting_fake_tensors_dispatches_nothing_of_its_own():
    """The tracker and the planner's allocator feed read each tensor an op makes without dispatching anything
    (a fake tensor's `is_meta` runs prim.device through every mode below them, each op's tensors once more),
    and the FLOP counter's op count leaves such queries out."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallel.flops import Flops
    from parallel.planning.allocator import AllocatorFeed

    with FakeTensorMode():
        x = torch.ones(8, 8)
    seen, flops, feed = _Seen(), Flops(), AllocatorFeed()
    with FakeTensorMode(allow_non_fake_inputs=True), seen, flops, LiveTensorBytes("cpu") as tracker:
        y = x @ x + 1
        feed.add(y)
        assert x.is_meta is False  # a query of the test's own: dispatched, and no op of the step
    assert seen.ops == ["aten.mm.default", "aten.add.Tensor", "prim.device.default"]
    assert flops.ops == 2 and (tracker.current, tracker.peak) == (8 * 8 * 4, 2 * 8 * 8 * 4)


def test_clipping_scales_the_gradients_to_the_max_norm():
    from parallel.optim import clip_grads

    grads = [torch.full((3,), 2.0), torch.ones(4)]  # norm sqrt(12 + 4) = 4
    norm = clip_grads(grads, max_norm=1.0)
    assert norm.item() == 4.0  # the norm before clipping, as logged
    clipped = torch.linalg.vector_norm(torch.cat(grads))
    torch.testing.assert_close(clipped, torch.tensor(1.0), rtol=1e-5, atol=0)
    small = [torch.full((2,), 0.1)]
    clip_grads(small, max_norm=1.0)  # under the max: unchanged
    torch.testing.assert_close(small[0], torch.full((2,), 0.1), rtol=0, atol=0)
