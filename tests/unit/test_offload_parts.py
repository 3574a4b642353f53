"""The intricate parts of strategy=offload, each tested alone in one process on the CPU (Note [offload engine] in
parallel/strategies/offload/engine.py): the buffer pool, the layout of blocks, the weight stream over a disk tier, the hooks
that stream blocks through forward and backward, and the block-by-block optimizer step.

tests/distributed/test_offload.py trains whole runs against strategy=single; these say which part is wrong."""
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from torch import nn

from parallel.config import Config
from parallel.init import init_plan
from parallel.init.values import Values
from parallel.loss import build_loss
from parallel.optim import clip_grads
from parallel.runtime import Runtime
from parallel.strategies.offload.engine import OffloadEngine, OffloadSettings
from parallel.strategies.offload.layout import Layout
from parallel.strategies.offload.pool import BufferPool
from parallel.strategies.offload.stream import WeightStream
from parallel.strategies.offload.tiers import ALIGN, Counters, DiskTier, aligned, finish

CPU = torch.device("cpu")
# The engine relies on the first block's backward pre-hook firing without inputs that need gradients
# (parallel/strategies/offload/hooks.py silences torch's warning, which pytest shows again).
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


# ---- helpers ------------------------------------------------------------------------------------------------

class Known(Values):
    """Initial values by name, the same wherever asked for (the references start from them too)."""

    def full(self, fqn, entry, shape, dtype):
        g = torch.Generator().manual_seed(zlib.crc32(fqn.encode()))
        return torch.randn(shape, generator=g).to(dtype)


def known(fqn: str, p) -> torch.Tensor:
    return Known().full(fqn, None, p.shape, p.dtype)


def on_meta(factory):
    with torch.device("meta"):
        return factory()


class Mixed(nn.Module):
    """One block's worth of odd sizes and dtypes, a frozen weight declared before the trainable ones."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Parameter(torch.empty(3, 5), requires_grad=False)  # 60 bytes
        self.a = nn.Parameter(torch.empty(7))  # 28 bytes
        self.h = nn.Parameter(torch.empty(5, dtype=torch.float16))  # 10 bytes
        self.d = nn.Parameter(torch.empty(3, dtype=torch.float64))  # 24 bytes


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.x, self.y = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
        self.y.weight = self.x.weight  # tied inside the block
        self.shared = nn.Parameter(torch.empty(4))  # made the same parameter in both Pairs below


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.b0, self.b1, self.b2, self.act = Mixed(), Pair(), Pair(), nn.ReLU()
        self.b2.shared = self.b1.shared  # held by two blocks: resident
        self.loose = nn.Parameter(torch.empty(2))  # in no block: resident


class Step(nn.Module):
    """A block whose forward first calls `probe(self)` when one is set (to look at the engine mid-forward)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.probe = None

    def forward(self, x):
        if self.probe is not None:
            self.probe(self)
        return torch.tanh(self.fc(x))


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Step(), Step()])
        self.head = nn.Linear(4, 1)  # not a block here: resident

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Lora(nn.Module):
    """A frozen base (declared first) and a trainable low-rank pair with a bias."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.base.requires_grad_(False)
        self.down = nn.Linear(4, 2, bias=False)
        self.up = nn.Linear(2, 4)


class OneBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Lora()


def offload_config(tmp_path, clip: float = 0.0, prefetch: int = 1, sgd: bool = False,
                   optimizer: str = "disk") -> Config:
    cfg = Config()
    s = cfg.strategy
    s.name, s.params, s.optimizer, s.path, s.prefetch = "offload", "disk", optimizer, str(tmp_path / "off"), prefetch
    cfg.trainer.clip_grad_norm = clip
    cfg.optim.no_decay = ["bias"]  # two parameter groups: the step runs one call per group
    if sgd:
        cfg.optim._target_, cfg.optim.args = "torch.optim.SGD", {"momentum": 0.9}
    return cfg


@pytest.fixture
def engines():
    """`make(model on meta, blocks, cfg)`: an OffloadEngine on the CPU built through its constructor, as
    build_offload builds it; closed at the end."""
    made = []

    def make(model, blocks, cfg):
        e = OffloadEngine(model, OffloadSettings.of(cfg), Runtime(device=CPU, values=Known()), init_plan(model), blocks,
                          cfg.strategy.path, build_loss(cfg.loss, "regression"))
        e.make_optimizer({id(p): n for n, p in model.named_parameters()})
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


# ---- BufferPool ---------------------------------------------------------------------------------------------

def test_pool_allocates_every_buffer_up_front_and_hands_each_out_once():
    pool = BufferPool(96, CPU, 3)
    assert len(pool.all) == 3 and all(b.dtype == torch.uint8 and b.numel() == 96 for b in pool.all)
    taken = [pool.take() for _ in range(3)]
    assert len({b.data_ptr() for b in taken}) == 3
    assert {b.data_ptr() for b in taken} == {b.data_ptr() for b in pool.all}
    assert pool.take(wait=False) is None  # exhausted: no new buffer is made
    pool.give(taken[1])
    assert pool.take(wait=False) is taken[1]  # the given one is reused
    assert len(pool.all) == 3


def test_an_exhausted_pool_waits_for_a_buffer_to_be_given_back():
    pool = BufferPool(64, CPU, 1)
    held = pool.take()
    got, started = [], threading.Event()

    def taker():
        started.set()
        got.append(pool.take())  # waits

    t = threading.Thread(target=taker)
    t.start()
    started.wait()
    t.join(timeout=0.2)
    assert t.is_alive() and not got  # still waiting: nothing was given back
    pool.give(held)
    t.join(timeout=60)  # at once, but a loaded machine may take its time
    assert not t.is_alive() and got == [held]


# ---- Layout -------------------------------------------------------------------------------------------------

@pytest.fixture
def tied():
    model = on_meta(Tied)
    return model, Layout(model, ["b0", "b1", "b2", "act"], CPU)


def test_layout_puts_trainable_parameters_first_at_aligned_offsets(tied):
    model, layout = tied
    b0 = layout.blocks[0]
    assert [s.fqn for s in b0.slots] == ["b0.a", "b0.h", "b0.d", "b0.frozen"]  # module order, frozen last
    assert [s.nbytes for s in b0.slots] == [28, 10, 24, 60]
    offset = 0
    for s in b0.slots:
        assert s.offset == offset and s.offset % ALIGN == 0
        offset += aligned(s.nbytes)
    assert b0.nbytes == offset == 4 * ALIGN
    assert b0.trained == 3 * ALIGN  # up to the end of the last trainable slot: what a step writes back
    assert [s.fqn for s in b0.trainable] == ["b0.a", "b0.h", "b0.d"]
    act = layout.blocks[3]  # a block without parameters still has a buffer size, and nothing to write back
    assert act.slots == [] and act.nbytes == ALIGN and act.trained == 0


def test_layout_leaves_resident_what_no_single_block_holds_and_gives_tied_weights_one_slot(tied):
    model, layout = tied
    b1, b2 = layout.blocks[1], layout.blocks[2]
    assert [s.fqn for s in b1.slots] == ["b1.x.weight"]  # x and y share it: one slot, the first name
    assert [s.fqn for s in b2.slots] == ["b2.x.weight"]
    assert [layout.fqns[p] for p in layout.resident] == ["loose", "b1.shared"]  # model order
    assert b1.trained == b1.nbytes == ALIGN
    for b in layout.blocks:
        for s in b.slots:
            assert layout.block_of[id(s.param)] is b
    assert all(id(p) not in layout.block_of for p in layout.resident)
    assert len(layout.params) == len(set(model.parameters())) == 8  # each parameter once, tied ones included


def test_install_puts_the_real_parameters_in_and_keeps_ties(tied):
    model, layout = tied
    assert all(p.is_meta for p in model.parameters())  # not before install: initialization reads the meta ones
    layout.install()
    assert list(model.parameters()) == layout.params  # model order, each once
    assert model.b1.x.weight is model.b1.y.weight is layout.blocks[1].slots[0].param
    assert model.b1.shared is model.b2.shared
    for p in model.parameters():
        assert p.device == CPU and p.numel() == 0  # empty until a buffer is bound
    assert not model.b0.frozen.requires_grad and model.b0.a.requires_grad


def test_slot_views_round_trip_values_without_overlapping(tied):
    _, layout = tied
    b0 = layout.blocks[0]
    flat = torch.zeros(b0.nbytes, dtype=torch.uint8)
    values = {s.fqn: known(s.fqn, torch.empty(s.shape, dtype=s.dtype)) for s in b0.slots}
    for s in b0.slots:
        s.view(flat).copy_(values[s.fqn])
    for s in b0.slots:
        v = s.view(flat)
        assert v.shape == s.shape and v.dtype == s.dtype and v.data_ptr() % ALIGN == flat.data_ptr() % ALIGN
        torch.testing.assert_close(v, values[s.fqn], rtol=0, atol=0)


# ---- the weight stream over a disk tier ---------------------------------------------------------------------

@pytest.fixture
def streamed(tmp_path):
    """(model, layout, stream, tier, pool of 2) for TwoBlocks' two blocks, their weights written to the tier."""
    io = ThreadPoolExecutor(2)
    model = on_meta(TwoBlocks)
    layout = Layout(model, ["blocks.0", "blocks.1"], CPU)
    pool = BufferPool(max(b.nbytes for b in layout.blocks), CPU, 2)
    tier = DiskTier(tmp_path / "params", Counters(), io)
    for b in layout.blocks:
        b.pool = pool
        flat = torch.zeros(b.nbytes, dtype=torch.uint8)
        for s in b.slots:
            s.view(flat).copy_(known(s.fqn, torch.empty(s.shape)))
        finish(tier.write(b.key(), flat))
    layout.install()
    tier.counters.take()
    yield model, layout, WeightStream(tier, CPU, Counters()), tier, pool
    io.shutdown(wait=True)
    tier.close()


def test_ensure_reads_binds_and_release_gives_the_buffer_back(streamed):
    model, layout, stream, tier, pool = streamed
    b = layout.blocks[0]
    stream.ensure(b)
    assert b.buffer is not None and b.pending is None and len(pool.free) == 1
    for s in b.slots:
        assert s.param.untyped_storage().data_ptr() == b.buffer.data_ptr()  # a view of the bound buffer
        torch.testing.assert_close(s.param.data, known(s.fqn, s.param), rtol=0, atol=0)
    assert stream.bound[id(b.buffer.untyped_storage())] is b
    assert tier.counters.take()[:2] == (b.nbytes, 0)
    stream.ensure(b)  # bound already: nothing read again
    assert tier.counters.take()[:2] == (0, 0)
    buf = b.buffer
    model.blocks[0].fc.weight.data.add_(1)  # changed in the buffer only: releasing writes nothing back
    stream.release(b)
    assert b.buffer is None and not stream.bound and len(pool.free) == 2 and pool.free[-1] is buf
    assert all(s.param.numel() == 0 for s in b.slots)
    assert tier.counters.take()[:2] == (0, 0)
    stream.ensure(b)
    torch.testing.assert_close(model.blocks[0].fc.weight.data, known("blocks.0.fc.weight", model.blocks[0].fc.weight),
                               rtol=0, atol=0)


def test_fetch_starts_a_read_once_and_returns_false_when_the_pool_is_out(streamed):
    model, layout, stream, tier, pool = streamed
    b0, b1 = layout.blocks
    assert stream.fetch(b0) and b0.buffer is not None and b0.pending is not None
    first = b0.buffer
    assert stream.fetch(b0) and b0.buffer is first and len(pool.free) == 1  # on its way: no second read
    assert all(s.param.numel() == 0 for s in b0.slots)  # read, not bound
    held = pool.take()
    assert stream.fetch(b1, wait=False) is False and b1.buffer is None  # a prefetch does not wait
    pool.give(held)
    assert stream.fetch(b1, wait=False) and b1.buffer is not None
    stream.release(b0)  # waits for the read in flight before the buffer goes back
    stream.release(b1)
    assert len(pool.free) == 2 and b0.pending is None and b1.pending is None
    assert tier.counters.take()[:2] == (b0.nbytes + b1.nbytes, 0)


def test_unbind_empties_the_parameters_and_keeps_the_buffer_out_of_the_pool(streamed):
    _, layout, stream, _, pool = streamed
    b = layout.blocks[1]
    stream.ensure(b)
    buf = stream.unbind(b)
    assert buf.numel() == pool.nbytes and b.buffer is None and not stream.bound and len(pool.free) == 1
    assert all(s.param.numel() == 0 and s.param.dtype == s.dtype for s in b.slots)
    pool.give(buf)


class GatedTier:
    """A params tier whose reads finish when the test completes them."""

    def __init__(self):
        self.reads: list[Future] = []

    def read(self, key, dst):
        self.reads.append(Future())
        return self.reads[-1]


def test_release_and_ensure_wait_for_the_read_in_flight(streamed):
    _, layout, _, _, pool = streamed
    tier, b = GatedTier(), layout.blocks[0]
    stream = WeightStream(tier, CPU, Counters())
    stream.fetch(b)
    t = threading.Thread(target=stream.release, args=(b,))
    t.start()
    t.join(timeout=0.1)
    assert t.is_alive() and len(pool.free) == 1  # a buffer being read into is not given back
    tier.reads[0].set_result(None)
    t.join(timeout=60)  # at once, but a loaded machine may take its time
    assert not t.is_alive() and len(pool.free) == 2 and b.buffer is None
    stream.fetch(b)
    threading.Timer(0.05, tier.reads[1].set_result, (None,)).start()
    stream.ensure(b)  # waits for the read, then binds
    assert tier.reads[1].done() and all(s.param.numel() > 0 for s in b.slots)
    assert stream.waits.take()[2] >= 0.04  # the wait is counted
    stream.release(b)


def test_without_a_tier_the_stream_moves_nothing(streamed):
    _, layout, _, _, pool = streamed
    stream = WeightStream(None, CPU, Counters())
    b = layout.blocks[0]
    b.buffer = torch.zeros(b.nbytes, dtype=torch.uint8)
    stream.bind(b)
    assert stream.fetch(b) and not stream.streaming
    stream.ensure(b)
    stream.release(b)  # kept bound for the whole run
    assert b.buffer is not None and all(s.param.numel() > 0 for s in b.slots) and len(pool.free) == 2


def test_a_partial_write_keeps_the_rest_of_the_file(tmp_path):
    with ThreadPoolExecutor(1) as io:
        tier = DiskTier(tmp_path / "t", Counters(), io)
        whole = torch.arange(256, dtype=torch.int32).view(torch.uint8)[:256].clone()
        finish(tier.write("w0", whole))
        finish(tier.write("w0", torch.zeros(64, dtype=torch.uint8)))
        back = torch.empty(256, dtype=torch.uint8)
        finish(tier.read("w0", back))
        assert back[:64].eq(0).all() and torch.equal(back[64:], whole[64:])
        assert (tmp_path / "t" / "w0.bin").stat().st_size == 256
        assert tier.counters.take()[:2] == (256, 256 + 64)


def test_reading_a_truncated_file_raises_oserror(tmp_path):
    with ThreadPoolExecutor(1) as io:
        tier = DiskTier(tmp_path / "t", Counters(), io)
        finish(tier.write("w0", torch.ones(128, dtype=torch.uint8)))
        with open(tmp_path / "t" / "w0.bin", "r+b") as f:
            f.truncate(100)
        with pytest.raises(OSError, match=r"w0\.bin: read 100 of 128 bytes \(the file was truncated\)"):
            finish(tier.read("w0", torch.empty(128, dtype=torch.uint8)))
        assert tier.counters.take()[0] == 0  # a short read counts nothing
        tier.close()
    assert not (tmp_path / "t").exists()  # the tier made the directory: closing removes it


# ---- the hooks ----------------------------------------------------------------------------------------------

def _watch(engine, model):
    """Record, inside each block's forward and at its backward pre-hook (after the engine's), which blocks
    have a buffer and whether the block's own weights are bound."""
    seen = []
    blocks = engine.blocks

    def look(phase, i):
        w = model.blocks[i].fc.weight
        seen.append((phase, i, w.numel() > 0, [b.buffer is not None for b in blocks]))

    for i, m in enumerate(model.blocks):
        m.probe = lambda _, i=i: look("forward", i)
        m.register_full_backward_pre_hook(lambda *_, i=i: look("backward", i))
    return seen


@pytest.mark.parametrize("prefetch", [0, 1])
def test_hooks_bind_a_block_for_its_forward_and_backward_and_prefetch_the_next(tmp_path, engines, prefetch):
    model = on_meta(TwoBlocks)
    engine = engines(model, ["blocks.0", "blocks.1"], offload_config(tmp_path, prefetch=prefetch))
    seen = _watch(engine, model)
    assert all(p.numel() == 0 for m in model.blocks for p in m.parameters())  # nothing bound before forward
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    engine.forward_backward(x, y)
    ahead = prefetch > 0
    assert seen == [
        ("forward", 0, True, [True, ahead]),  # bound; the next block read ahead (or not)
        # block 0 let go after its forward, unless it is among the last prefetch + 1 that backward needs first
        ("forward", 1, True, [ahead, True]),
        ("backward", 1, True, [ahead, True]),  # bound still or again; the block before it read ahead (or not)
        ("backward", 0, True, [True, False]),  # block 1's gradients handed off and its weights let go
    ]
    engine.adamw.wait()
    # block 0, the next forward's first, stays bound to its new weights (not read back); block 1 is let go
    assert [b.buffer is not None for b in engine.blocks] == [True, False]
    assert len(engine.pool.free) == engine.pool.capacity - 1
    assert model.blocks[0].fc.weight.numel() > 0 and all(p.numel() == 0 for p in model.blocks[1].parameters())
    engine.evaluate(x, y)  # evaluation lets every block go after its forward
    assert all(b.buffer is None for b in engine.blocks) and len(engine.pool.free) == engine.pool.capacity
    assert all(p.numel() == 0 for m in model.blocks for p in m.parameters())
    assert model.head.weight.numel() == 4  # resident: always there


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_backward_reads_a_blocks_optimizer_state_ahead_of_its_step(tmp_path, engines, clip):
    """Without clipping, a block's optimizer state is read when backward reaches it or the block after it, so
    its step finds it there (the first step has none to read; with clipping the step comes after backward);
    the numbers stay the plain loop's (the test below). State read for a block that then gets no gradient
    goes back to the pool at the end of the step."""
    model = on_meta(TwoBlocks)
    engine = engines(model, ["blocks.0", "blocks.1"], offload_config(tmp_path, clip=clip))
    seen = []
    for i, m in enumerate(model.blocks):  # after the engine's own pre-hook
        m.register_full_backward_pre_hook(
            lambda *_, i=i: seen.append((i, [b.state_reads is not None for b in engine.blocks])))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    for _ in range(2):
        engine.forward_backward(x, y)
        engine.clip(clip)
        engine.adamw.optimizer.step()
    ahead = not clip
    assert seen == [(1, [False, False]), (0, [False, False]), (1, [ahead, ahead]), (0, [ahead, False])]
    assert all(b.state_reads is None for b in engine.blocks)
    b = engine.blocks[0]
    engine.hooks.start_step()
    engine.adamw.prefetch_states(b)
    assert (b.state_reads is not None) == ahead
    engine.hooks.end_step()  # a step in which block 0 got no gradient
    assert b.state_reads is None and len(engine.pool.free) == engine.pool.capacity


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_engine_steps_equal_a_plain_loop(tmp_path, engines, clip):
    """Two steps of the engine (hooks, stream, step) give the plain loop's losses and weights, bit for bit."""
    model = on_meta(TwoBlocks)
    cfg = offload_config(tmp_path, clip=clip)
    engine = engines(model, ["blocks.0", "blocks.1"], cfg)
    opt = engine.adamw.optimizer
    ref = TwoBlocks()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(known(n, p))
    decay = [p for n, p in ref.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in ref.named_parameters() if n.endswith("bias")]
    o = cfg.optim
    ref_opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=o.lr,
                                betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    ref_loss = build_loss(cfg.loss, "regression")
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(3, 4, generator=gen), torch.randn(3, 1, generator=gen)
        loss = engine.forward_backward(x, y)
        norm = engine.clip(clip)
        opt.step()
        opt.zero_grad()
        ref_loss.start_step(y, None, 1)
        expected = ref_loss(ref(x), y)
        expected.backward()
        ref_norm = clip_grads([p.grad for p in ref.parameters()], clip)
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == expected.item()
        if clip:
            assert norm.item() == ref_norm.item() and ref_norm.item() > clip  # the clip factor mattered
    got = engine.full_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=0, atol=0, msg=n)
    # block 0, the next forward's first, stays bound to its new weights; every other buffer is back
    assert [b.buffer is not None for b in engine.blocks] == [True, False]
    assert len(engine.pool.free) == engine.pool.capacity - 1
    engine.stream.release(engine.blocks[0])  # what its tier holds is the same
    got = engine.full_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=0, atol=0, msg=n)
    assert len(engine.pool.free) == engine.pool.capacity


# ---- the optimizer step -------------------------------------------------------------------------------------

def _grads(block, gen):
    return {s.fqn: torch.randn(s.shape, generator=gen) for s in block.trainable}


def _run_block_steps(engine, grads_per_step, clip):
    """The block's step as the hooks and the trainer drive it: grads handed off, then the step."""
    b, adamw = engine.blocks[0], engine.adamw
    for grads in grads_per_step:
        engine.hooks.start_step()  # as forward_backward starts a step
        adamw.start_step()
        engine.stream.ensure(b)
        for s in b.trainable:
            s.param.grad = grads[s.fqn].clone()
        adamw.grads_done(b)
        if clip:
            adamw.clip(clip)
        adamw.step()
    adamw.wait()
    engine.stream.ensure(b)
    return {s.fqn: s.param.detach().clone() for s in b.slots}


def _reference(cfg, grads_per_step, clip, sgd):
    params = {n: nn.Parameter(known(n, p)) for n, p in on_meta(OneBlock).named_parameters() if p.requires_grad}
    o = cfg.optim
    groups = [{"params": [p for n, p in params.items() if not n.endswith("bias")]},
              {"params": [p for n, p in params.items() if n.endswith("bias")], "weight_decay": 0.0}]
    if sgd:
        opt = torch.optim.SGD(groups, lr=o.lr, weight_decay=o.weight_decay, momentum=0.9)
    else:
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    for grads in grads_per_step:
        for n, p in params.items():
            p.grad = grads[n].clone()
        if clip:
            clip_grads([p.grad for p in params.values()], clip)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


@pytest.mark.parametrize("clip,sgd,tier", [
    (0.0, False, "disk"), (0.1, False, "disk"), (0.0, True, "disk"), (0.1, True, "disk"),
    (0.1, False, "device"), (0.0, True, "device"),
], ids=["adamw", "adamw_clip", "sgd_momentum", "sgd_momentum_clip", "adamw_clip_state_on_device",
        "sgd_momentum_state_on_device"])
def test_block_step_equals_torch_optimizer(tmp_path, engines, clip, sgd, tier):
    """Three steps of one block (the state read back from its tier after the first) equal torch's own
    optimizer on the same weights and gradients, bit for bit; the frozen weights stay and get no state."""
    cfg = offload_config(tmp_path, clip=clip, sgd=sgd, optimizer=tier)
    engine = engines(on_meta(OneBlock), ["block"], cfg)
    b = engine.blocks[0]
    gen = torch.Generator().manual_seed(1)
    steps = [_grads(b, gen) for _ in range(3)]
    if clip:  # the clip factor is applied: the gradients' norm is above the limit
        assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in steps[0].values()])) > clip
    got = _run_block_steps(engine, steps, clip)
    expected = _reference(cfg, steps, clip, sgd)
    for n, v in expected.items():
        torch.testing.assert_close(got[n], v, rtol=0, atol=0, msg=n)
    for n in ("block.base.weight", "block.base.bias"):
        torch.testing.assert_close(got[n], known(n, got[n]), rtol=0, atol=0, msg=n)  # frozen: untouched
    state = engine.state.optimizer_state()
    assert sorted(state) == ["block.down.weight", "block.up.bias", "block.up.weight"]  # none for frozen ones
    keys = ["momentum_buffer"] if sgd else ["exp_avg", "exp_avg_sq", "step"]
    assert all(sorted(v) == keys for v in state.values())
    frozen = [s.param for s in b.slots if not s.param.requires_grad]
    if sgd:
        assert not set(frozen) & engine.adamw.started
    else:
        assert all(engine.adamw.steps[p].item() == 0 for p in frozen)
        assert all(v["step"].item() == 3 for v in state.values())
    kinds = ["m"] + ([] if sgd else ["v"])  # the state holds the trainable range only
    if tier == "disk":
        assert [(engine.path / "optimizer" / f"{b.key(k)}.bin").stat().st_size for k in kinds] == [b.trained] * len(kinds)
    else:
        assert [t.numel() for t in engine.adamw.state_in_memory[b.index]] == [b.trained] * len(kinds)
    engine.stream.release(b)
    assert len(engine.pool.free) == engine.pool.capacity  # every buffer of the steps back


def test_a_step_writes_back_only_the_trainable_range(tmp_path, engines):
    """The weights file past `trained` (the frozen weights) is never written by a step: bytes changed there
    behind the engine's back while the block is bound survive its step."""
    engine = engines(on_meta(OneBlock), ["block"], offload_config(tmp_path))
    b = engine.blocks[0]
    assert 0 < b.trained < b.nbytes
    file = engine.path / "params" / f"{b.key()}.bin"
    engine.stream.ensure(b)  # read into the buffer the step updates
    marker = bytes(range(7, 7 + b.nbytes - b.trained))
    with open(file, "r+b") as f:
        f.seek(b.trained)
        f.write(marker)
    engine.counters["params"].take()
    before = file.read_bytes()[:b.trained]
    _run_block_steps(engine, [_grads(b, torch.Generator().manual_seed(2))], 0.0)
    after = file.read_bytes()
    assert after[b.trained:] == marker and after[:b.trained] != before and len(after) == b.nbytes
    read, written, _ = engine.counters["params"].take()
    # the block, first in the next forward, stays bound to its new weights: nothing read back; what it is
    # bound to is what was written
    assert written == b.trained and read == 0
    assert bytes(b.buffer[:b.trained].numpy()) == after[:b.trained]
