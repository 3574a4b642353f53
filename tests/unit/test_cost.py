"""The step-time model in one process: the work a planned step is sorted into (Note [step work]), its pricing
(Note [cost model]), the fits and checks of a calibration (Note [calibration])."""
import dataclasses
import json
import logging

import pytest
import torch

from parallel.config import Config, ConfigError
from parallel.hardware import last_level_cache
from parallel.models.build import build_meta_model
from parallel.planning.calibration import Calibration, call_seconds, fit_replay, measure_dtensor_op, quick
from parallel.planning.calibration_runs import fit_comm, fit_in_step, measure_steps
from parallel.planning.cost import comm_time, compute_time, load, step_times
from parallel.planning.planner import plan
from parallel.planning.replay import Replay, _real, probe_time
from parallel.planning.standins import DDPStandIn
from parallel.planning.work import Work, byte_class, ddp_calls, size_class, spec
from parallel.validate import validate


def _cal(**changes) -> Calibration:
    base = Calibration(torch=torch.__version__, device="cpu", world=2, threads=1, cores=2,
                       products={"16": 1e9, "64": 4e9, "256": 16e9}, memory={"4096": 1e-10, "1048576": 2e-10},
                       op_s=1e-6, step_s=1e-4, comm={"allreduce/2": [1e-4, 1e9], "allgather/2": [2e-4, 5e8]},
                       made="test")
    return dataclasses.replace(base, **changes)


def test_classes_and_buckets():
    assert size_class(2 * 64 ** 3) == 64 and size_class(2 * 100 ** 3) == 128 and size_class(1) == 16
    assert size_class(2 * 10_000 ** 3) == 4096
    assert byte_class(1) == 4096 and byte_class(1 << 20) == 1 << 20 and byte_class(3 << 20) == 1 << 20
    assert byte_class(5 << 20) == 16 << 20 and byte_class(1 << 40) == 256 << 20
    # DDP: a 1 MiB first bucket, then 25 MiB ones
    assert ddp_calls(1000) == 1 and ddp_calls(1 << 20) == 1 and ddp_calls((1 << 20) + 1) == 2
    assert ddp_calls((26 << 20) + 1) == 3


def test_work_sorts_products_memory_views_and_ops():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with Work() as w:
        c = a @ b  # a product: 2 x 64^3 FLOPs, class 64
        d = c + a  # memory: reads two, writes one
        c.add_(a)  # in place: reads two, writes the first again
        c.view(-1)  # a view moves nothing (but is an op)
    assert d.shape == (64, 64)
    out = w.as_dict()
    assert out["products"] == {"64": [1, 2 * 64 ** 3]}
    assert out["memory"] == {"65536": [2, 3 * 64 * 64 * 4 * 2]}
    assert out["ops"] == 4 and out["comm"] == {}
    assert w.as_dict(steps=2)["products"] == {"64": [0, 64 ** 3]}
    # forward and backward (the phase the planner calls "forward") tallied again apart from the rest
    assert out["forward_backward"] == {"products": out["products"], "memory": out["memory"], "ops": 4}
    w.phase = "optimizer"
    with w:
        a.add_(b)
    after = w.as_dict()
    assert after["ops"] == 5 and after["forward_backward"]["ops"] == 4
    assert after["forward_backward"]["memory"] == out["memory"] != after["memory"]


def _planned(**strategy):
    cfg = Config()
    cfg.model.args = {"hidden": 32, "depth": 2}
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    validate(cfg, 2)
    return cfg, plan(cfg, 2)


def test_a_planned_step_counts_ddp_buckets_and_fsdp_calls():
    cfg, (zero0,) = _planned(name="data", zero=0)
    grads = sum(p.numel() * 4 for p in build_meta_model(cfg.model).parameters())
    # DDP's one bucket of the gradients (a regression's mean loss all-reduces nothing else)
    assert zero0.work["comm"] == {"bucket/2": [ddp_calls(grads), grads]} and ddp_calls(grads) == 1
    # its reducer's copy of each gradient into the bucket, once a step (DDPStandIn.copy_gradients)
    params = len(list(build_meta_model(cfg.model).parameters()))
    assert sum(n for (func, _, _), (n, _, _) in zero0.calls.items() if str(func) == "aten.mul.out") == params
    assert zero0.work["ops"] > 0 and zero0.work["products"] and zero0.work["memory"]
    _, (zero3,) = _planned(name="data", zero=3)
    kinds = {k.split("/")[0] for k in zero3.work["comm"]}
    assert {"allgather", "reducescatter"} <= kinds  # FSDP2's gathers and gradient reduce-scatters
    t = step_times(cfg, [zero0], _cal(), 2)
    assert t["step"] == pytest.approx(t["compute"] + t["comm"]) and t["bubble"] == 0 and t["comm"] > 0


def test_ddp_s_gradient_copies_are_counted_as_its_reducer_makes_them():
    """Each gradient scaled into its bucket and copied back: two ops, both replayed; each counted as Work counts
    any op, its tensor arguments and its result (an out= argument, an in-place op's target, counted again)."""
    class Mesh:
        def size(self) -> int:
            return 2

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8, bias=False))
    model[0].bias.requires_grad_(False)  # a frozen parameter has no gradient to copy
    ddp = DDPStandIn()
    ddp.replicate(model, device_mesh=Mesh())
    work = Work()
    ddp.copy_gradients(work)
    grads = (64 * 32 + 32 * 8) * 4
    assert work.ops == 4 and sum(n for _, n in work.memory.values()) == 2 * 3 * grads
    assert {str(func) for func, _, _ in work.calls} == {"aten.mul.out", "aten.copy_.default"}


def test_pricing_is_the_stated_sum():
    cal = _cal()
    work = {"products": {"64": [3, 6e6], "1024": [1, 32e9]}, "memory": {"4096": [10, 40_000]}, "ops": 100,
            "comm": {"allreduce/2": [2, 1e6], "allgather/4": [1, 1e6], "send/2": [1, 1e6]}}
    # the 1024 class takes the largest measured rate (256's); ops and the step's fixed time added
    expected = 6e6 / 4e9 + 32e9 / 16e9 + 40_000 * 1e-10 + 100 * 1e-6 + 1e-4
    assert compute_time(work, cal) == pytest.approx(expected)
    assert compute_time(work, cal, factor=2.0) == pytest.approx(2 * expected)
    # ops on DTensors: DTensor's dispatch added to each
    assert compute_time(work | {"dtensor_ops": 50}, _cal(dtensor_op_s=4e-6)) == pytest.approx(expected + 50 * 4e-6)
    # a group size not measured: the nearest measured one; a kind not measured: the all-reduce's fit
    alone = (2e-4 + 1e6 / 1e9) + (2e-4 + 1e6 / 5e8) + (1e-4 + 1e6 / 1e9)
    assert comm_time(work, cal) == pytest.approx(alone)
    # in a step: + call_s a call from hooks (an all-gather here), + send_s a send, + sync_s any other call;
    # comm_scale for none of these on a CPU (waited where they are made)
    in_step = _cal(comm_scale=2.0, call_s=3e-3, send_s=5e-3, sync_s=1e-3)
    assert comm_time(work, in_step) == pytest.approx(alone + 3e-3 + 5e-3 + 2 * 1e-3)
    # DDP's buckets: the all-reduce's measured time x comm_scale (they overlap backward), and the time per call
    # from hooks
    buckets = {"comm": {"bucket/2": [2, 1e6]}}
    assert comm_time(buckets, in_step) == pytest.approx(2 * (2 * 1e-4 + 1e6 / 1e9) + 2 * 3e-3)
    # on GPUs FSDP2's all-gathers overlap too (their own streams)
    gpus = dataclasses.replace(in_step, device="NVIDIA H100")
    assert comm_time(work, gpus) == pytest.approx(alone + (2e-4 + 1e6 / 5e8) + 3e-3 + 5e-3 + 2 * 1e-3)


def test_a_pipeline_s_bubble_is_the_other_stages_forward_and_backward():
    from types import SimpleNamespace

    from parallel.strategies.pipeline.schedules import analytic_bubble

    cfg = Config()
    cfg.strategy.name, cfg.strategy.pp, cfg.strategy.microbatches = "pipeline", 2, 2
    cfg.strategy.schedule, cfg.strategy.stages_per_rank = "1F1B", 1
    cal = _cal(step_s=0.0)
    b = analytic_bubble("1F1B", 2, 1, 2)
    assert b / (1 - b) == pytest.approx(0.5)

    def role(fb_flops: float, after_flops: float):
        fb = {"products": {"256": [1, fb_flops]}, "memory": {}, "ops": 0}
        work = {"products": {"256": [2, fb_flops + after_flops]}, "memory": {}, "ops": 0, "comm": {},
                "forward_backward": fb}
        return SimpleNamespace(work=work, calls={}, io_bytes=0)

    # equal stages, all of their compute in forward and backward: the schedule's own share, b / (1 - b)
    t = step_times(cfg, [role(16e9, 0), role(16e9, 0)], cal, 2)
    assert t["compute"] == pytest.approx(1.0) and t["bubble"] == pytest.approx(0.5)
    # the slowest stage (1.5 s) waits for the other's forward and backward (0.5 s), not for its own; the
    # optimizer's part (after the schedule) makes no bubble
    t = step_times(cfg, [role(8e9, 8e9), role(24e9, 0)], cal, 2)
    assert t["compute"] == pytest.approx(1.5) and t["bubble"] == pytest.approx(0.5 * 0.5)
    # a work without its forward and backward recorded: all of its compute
    old = role(8e9, 8e9)
    del old.work["forward_backward"]
    assert step_times(cfg, [old, role(24e9, 0)], cal, 2)["bubble"] == pytest.approx(0.5 * 1.0)


def test_one_call_s_time_is_read_between_the_measured_sizes():
    """The line through the two measured sizes around a call's; below the smallest its time; above the largest
    the last interval's rate carried on (a large call's time grows faster than a small one's here: a 256 MB
    all-gather took 5.2x a 64 MB one)."""
    points = [[4096, 1e-4], [1 << 20, 3e-4], [16 << 20, 3e-3], [64 << 20, 20e-3]]
    assert call_seconds(points, 4096) == call_seconds(points, 8) == pytest.approx(1e-4)
    assert call_seconds(points, 1 << 20) == pytest.approx(3e-4)
    assert call_seconds(points, 8.5 * (1 << 20)) == pytest.approx((3e-4 + 3e-3) / 2)
    assert call_seconds(points, 160 << 20) == pytest.approx(20e-3 + 2 * 17e-3)
    assert call_seconds(list(reversed(points)), 40 << 20) == pytest.approx((3e-3 + 20e-3) / 2)
    # a file of [latency, bandwidth] fits loads as the same line
    old = Calibration(torch=torch.__version__, device="cpu", world=2, threads=1, cores=2,
                      comm={"allreduce/2": [1e-4, 1e9]})
    assert all(call_seconds(old.comm["allreduce/2"], n) == pytest.approx(1e-4 + n / 1e9)
               for n in (1, 4096, 1 << 20, 1 << 30))
    assert dataclasses.replace(old).comm == old.comm


def test_a_tensor_parallel_rank_is_charged_its_shards_not_the_whole_product():
    """A dispatch mode sees a DTensor op with the global shapes: counted so, each rank of tp2 would do the work
    of both. The MLP's products split evenly over the ranks of `model` (columns, then rows) as over those of
    `data` (half the batch each): the same FLOPs and product calls per rank, every op on DTensors counted."""
    cfg, (data,) = _planned(name="data", zero=0)
    _, (model,) = _planned(name="model")
    assert model.flops == data.flops > 0
    assert model.work["products"] == data.work["products"]
    assert data.work["dtensor_ops"] == 0 and model.work["dtensor_ops"] > 50
    shapes = {tuple(a[1] for a in key[1][1:] if a[0] == "tensor") for key in model.calls
              if key[0] in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)}
    assert any(s[-2:] == ((32, 32), (32, 16)) for s in shapes)  # the whole batch (32) x a column shard (16)
    assert not any(s[-2:] == ((32, 32), (32, 32)) for s in shapes)  # never x a whole hidden weight


def test_dtensor_dispatch_is_measured_and_leaves_no_group_behind():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is up in this process")
    seconds = measure_dtensor_op(torch.device("cpu"))
    assert 0 < seconds < 1e-3 and not dist.is_initialized()


def test_comm_fits_average_the_ranks_and_take_a_send_s_receiver():
    sizes = (4096, 1 << 20)
    ranks = [{"allreduce/2": [(n, lat + n / 1e9) for n in sizes], "send/2": [(n, slat + n / 1e9) for n in sizes]}
             for lat, slat in ((1e-4, 1e-5), (3e-4, 2e-3))]  # rank 1 receives rank 0's sends
    fits = fit_comm(ranks)
    assert fits["allreduce/2"] == [[n, pytest.approx(2e-4 + n / 1e9)] for n in sizes]
    assert fits["send/2"] == [[n, pytest.approx(2e-3 + n / 1e9)] for n in sizes]


def test_a_smaller_collective_is_fitted_no_slower_than_a_larger_one():
    """A slow stretch at one small size (3.35 ms at 64 KiB where 1 MiB took 0.95 ms, here) is bounded by the
    larger sizes' times; the rest as measured."""
    spike = [(4096, 3e-4), (64 << 10, 3.35e-3), (1 << 20, 0.95e-3), (16 << 20, 11e-3)]
    fits = fit_comm([{"allreduce/2": spike}, {"allreduce/2": spike}])
    assert fits["allreduce/2"] == [[4096, pytest.approx(3e-4)], [64 << 10, pytest.approx(0.95e-3)],
                                   [1 << 20, pytest.approx(0.95e-3)], [16 << 20, pytest.approx(11e-3)]]


def test_collectives_in_a_step_fit_the_runs_relative_error():
    """A run = its compute + its waited collectives timed alone + comm_scale x its overlapped ones (DDP's) +
    call_s per call from hooks + send_s per send + sync_s per other call: the four recovered from four runs
    (on a CPU the workers fill, comm_scale 1 and the other three); a run faster than its predicted compute stays in the fit (its relative error weighs as any run's), which
    stays non-negative."""
    runs = [(0.2, 0.12, 0.05, 0.0, 4, 0, 0), (0.09, 0.02, 0.0, 0.03, 20, 0, 0), (0.05, 0.02, 0.0, 0.005, 0, 0, 7),
            (0.04, 0.03, 0.0, 0.002, 0, 8, 1)]
    made = [(rest + waited + 1.5 * overlapped + 2e-3 * hooked + 4e-3 * sends + 1e-3 * other, rest, overlapped,
             waited, hooked, sends, other) for _, rest, overlapped, waited, hooked, sends, other in runs]
    assert fit_in_step(made) == pytest.approx((1.5, 2e-3, 4e-3, 1e-3))
    assert fit_in_step([]) == (1.0, 0.0, 0.0, 0.0)
    bent = fit_in_step([(0.1, 0.12, 0.05, 0.0, 4, 0, 0)] + made[1:])
    assert min(bent) >= 0 and bent != pytest.approx((1.5, 2e-3, 4e-3, 1e-3))
    # a CPU the workers fill: the overlapped calls as timed alone (comm_scale 1), the times per call fitted
    cpu = [(rest + waited + overlapped + 2e-3 * hooked + 4e-3 * sends + 1e-3 * other, rest, overlapped, waited,
            hooked, sends, other) for _, rest, overlapped, waited, hooked, sends, other in runs]
    assert fit_in_step(cpu, overlap=False) == pytest.approx((1.0, 2e-3, 4e-3, 1e-3))
    assert fit_in_step(made, overlap=False)[0] == 1.0


def test_the_replay_scale_fits_what_steps_take_beyond_their_calls_timed_alone():
    """A step = step_s + replay_scale x its calls timed alone + replay_op_s x its ops; never below its calls."""
    cal = _cal(step_s=1e-4)
    steps = ((1e-3, 1e-3, 100), (4e-3, 1e-3, 50), (1e-3, 5e-3, 400), (2e-3, 2e-3, 10))
    fit_replay(cal, [({"ops": ops}, 1e-4 + 1.5 * (p + m) + 3e-6 * ops, {"products": p, "memory": m})
                     for p, m, ops in steps])
    assert cal.replay_scale == pytest.approx(1.5) and cal.replay_op_s == pytest.approx(3e-6)
    untouched = _cal()
    fit_replay(untouched, [({"ops": 5}, 0.5e-4, {"products": 1e-3, "memory": 0.0})] * 2)  # no step beyond step_s
    assert untouched.replay_scale == 1.0 and untouched.replay_op_s == 0.0
    fast = _cal(step_s=1e-4)  # steps faster than their calls timed alone: the calls as timed
    fit_replay(fast, [({"ops": ops}, 1e-4 + 0.9 * (p + m), {"products": p, "memory": m}) for p, m, ops in steps])
    assert fast.replay_scale == 1.0 and fast.replay_op_s == 0.0


def test_replay_spreads_a_call_over_operand_sets_that_span_the_step():
    """A call is timed over as many operand sets as the step's bytes hold (rounded up to a power of two, up to
    twice the last-level cache, at most COPIES), each call on the next; without a span, and on a GPU, on one
    set."""
    seen = []

    def touch(x):
        seen.append(x.data_ptr())

    key = (touch, ("tuple", ("tensor", (16, 1024), (1024, 1), 0, torch.float32)), ("dict",))  # 64 KiB
    replay = Replay(torch.device("cpu"))
    replay.cache = 1 << 20
    assert replay.copies(key, 0) == 1 and replay.copies(key, 256 << 10) == 4 and replay.copies(key, 1 << 30) == 32
    assert replay.copies(key, 150 << 10) == replay.copies(key, 129 << 10) == 4  # both spans timed as 256 KiB
    assert replay.copies(key, 128 << 10) == 2
    replay.price({key: [3, 0, 64 << 10]}, None, span=256 << 10)
    assert len(set(seen[:4])) == 4 and seen[4:8] == seen[:4]  # warmed on every set in turn, then timed from the first
    seen.clear()
    replay.price({key: [3, 0, 64 << 10]}, None)  # no span: as repeated alone
    assert len(set(seen)) == 1 and set(replay.seconds) == {(key, 4), (key, 1)}
    replay.cache = 1 << 30
    assert replay.copies(key, 1 << 40) == Replay.COPIES
    assert Replay(torch.device("meta")).copies(key, 1 << 40) == 1


def test_a_replayed_step_spans_its_workers_bytes_and_pays_a_time_per_op():
    cfg, (zero0,) = _planned(name="data", zero=0)
    replay = Replay(torch.device("cpu"))
    spans = []
    price = replay.price
    replay.price = lambda calls, cal, span=0: spans.append(span) or price(calls, cal, span=span)
    base = step_times(cfg, [zero0], _cal(), 2, replay=replay)
    assert spans == [(zero0.params + zero0.grads + zero0.optimizer) * 2]  # both workers' (activations left out)
    per_op = step_times(cfg, [zero0], _cal(replay_op_s=1e-5), 2, replay=replay)
    assert per_op["ops"] == pytest.approx(base["ops"] + zero0.work["ops"] * 1e-5)
    assert per_op["products"] == base["products"] and per_op["memory"] == base["memory"]  # timed once


def test_the_cache_size_is_read(monkeypatch):
    assert last_level_cache() > 0
    import parallel.hardware

    def unreadable(path):
        raise OSError(path)

    monkeypatch.setattr(parallel.hardware.os, "listdir", unreadable)  # no sysfs: the default
    assert last_level_cache(default=123) == 123


def test_replay_touches_the_heaps_top_where_a_warm_up_faulted_pages_in(monkeypatch):
    """On a CPU a call shape is warmed on every operand set; where that faulted pages in (its outputs on memory
    not in use), the heap's top is written (parallel.planning.replay._touch_heap, under the workers' allocator
    settings, parallel.planning.cost._replay) and the sets warmed again before the call is timed, so that its outputs
    land on memory in use as a worker's do; where it did not, and on another device, no touch."""
    import parallel.planning.replay as replay_module

    events = []
    monkeypatch.setattr(replay_module, "_touch_heap", lambda: events.append("touch"))
    key = (lambda x: events.append("call"), ("tuple", ("tensor", (4, 4), (4, 1), 0, torch.float32)), ("dict",))
    replay = Replay(torch.device("cpu"))
    faults = iter([0, 256])  # the warm-up over the two sets faulted 256 pages
    monkeypatch.setattr(replay_module, "_faults", lambda: next(faults))
    replay._time(key, 2)
    assert events[:6] == ["call", "call", "call", "touch", "call", "call"] and events.count("touch") == 1
    events.clear()
    monkeypatch.setattr(replay_module, "_faults", lambda: 0)  # none faulted
    replay._time(key, 2)
    assert events[:3] == ["call"] * 3 and "touch" not in events
    events.clear()
    assert Replay(torch.device("meta"))._time(key, 1) is not None  # timed there too, without a touch
    assert events and "touch" not in events
    import parallel.planning.cost as cost  # the process that replays takes the workers' allocator settings first

    events.clear()
    monkeypatch.setattr(cost, "steady_host_allocations", lambda keep_large=False: events.append(("steady", keep_large)))
    assert isinstance(cost._replay.__wrapped__("cpu", 1, None), Replay) and events == [("steady", True)]


def test_replay_takes_a_call_at_the_speed_the_machine_was_calibrated_at(monkeypatch):
    """A probe product timed beside each call: a machine running half as fast as when it was calibrated has its
    calls' times halved, within 1/4..4."""
    assert Replay(torch.device("cpu"))._speed() == 1.0  # no calibrated probe: as timed
    assert Replay(torch.device("cpu"), probe_s=1e-12)._speed() == 4.0  # clamped
    assert Replay(torch.device("cpu"), probe_s=10.0)._speed() == 0.25
    assert Replay(torch.device("meta"), probe_s=1.0).probe_s is None  # the probe is a CPU's

    now = [0.0]

    def nap(ms):  # a call of `ms` milliseconds by the replay's clock, whatever else the machine is doing
        now[0] += ms / 1e3

    key = (nap, ("tuple", ("value", 2.0)), ("dict",))  # as parallel.planning.work.spec describes nap(2.0)
    replay = Replay(torch.device("cpu"), probe_s=1.0, clock=lambda: now[0])
    monkeypatch.setattr(replay, "_speed", lambda: 2.0)
    assert replay._time(key) == pytest.approx(1e-3)  # 2 ms, twice as slow as calibrated


def test_replayed_calls_are_held_to_the_calibration_s_own_probe(monkeypatch):
    """replay_for: a plan's calls are held to the probe the calibration's replaying process timed alone; a file
    without one (made before it was kept), to its rate of products of the probe's size."""
    import parallel.planning.cost as cost

    monkeypatch.setattr(cost, "_replay", lambda kind, threads, probe_s: probe_s)
    cfg = Config()
    rates = {"16": 1e9, "128": 2 * 128 ** 3 / 40e-6}  # a 128 x 128 product in 40 us
    old = Calibration(torch="x", device="cpu", world=2, threads=1, cores=2, products=rates, memory={"4096": 1e-9})
    assert cost.replay_for(cfg, old, 2) == pytest.approx(40e-6)
    assert cost.replay_for(cfg, dataclasses.replace(old, probe_s=55e-6), 2) == 55e-6
    assert cost.replay_for(cfg, dataclasses.replace(old, host="elsewhere", probe_s=55e-6), 2) is None
    probe = probe_time(torch.device("cpu"))
    assert 0 < probe < 0.1 and probe_time(torch.device("meta")) is None


def test_reference_steps_are_replayed_at_one_probe_speed(monkeypatch):
    """measure_steps times the probe once, alone, and holds its replays to it; launch/calibrate.py's later rounds
    of the same steps are held to the first round's probe."""
    import parallel.planning.calibration_runs as runs

    held = []
    monkeypatch.setattr(runs, "Replay", lambda device, probe_s: held.append(probe_s) or Replay(device, probe_s=probe_s))
    tiny = (("mlp", 16, 2, 4),)
    steps, probe = measure_steps(torch.device("cpu"), tiny, seconds=0.01)
    (work, seconds, timed), = steps
    assert 0 < probe < 0.1 and seconds > 0 and timed["products"] + timed["memory"] > 0 and work["ops"] > 0
    again, kept = measure_steps(torch.device("cpu"), tiny, seconds=0.01, probe_s=2 * probe)
    assert kept == 2 * probe and again[0][2] is not None and held == [probe, 2 * probe]
    plain, none = measure_steps(torch.device("cpu"), tiny, seconds=0.01, replay=False)  # the other processes'
    assert none is None and plain[0][2] is None and plain[0][1] > 0


def test_quick_measures_every_term():
    cal = quick(2)
    assert cal.world == 2 and cal.device == "cpu" and cal.op_s > 0 and cal.step_s >= 0
    assert set(cal.products) == {"16", "32", "64", "128", "256", "512"} and all(v > 0 for v in cal.products.values())
    assert all(v > 0 for v in cal.memory.values()) and "allreduce/2" in cal.comm
    assert cal.dtensor_op_s >= 0 and cal.replay_scale == 1.0  # the replay scale wants launch/calibrate.py's steps


def test_a_slope_of_ops_that_came_out_flat_is_measured_again(monkeypatch):
    """measure_ops: a slow stretch over the shallow step's batches made the deeper step no slower (the suite's
    other process, once); an op costs something, so the slope is measured again."""
    import parallel.planning.calibration as calibration

    timings = iter([{1: 2e-3, 8: 2e-3}, {1: 1e-3, 8: 3e-3}])
    calls = []
    monkeypatch.setattr(calibration, "_fastest_alternating",
                        lambda fns, *args: calls.append(sorted(fns)) or next(timings))
    per_op, per_step = calibration.measure_ops(torch.device("cpu"))
    assert calls == [[1, 8], [1, 8]] and per_op > 0 and per_step >= 0


def test_bad_calibration_files(tmp_path, caplog):
    with pytest.raises(ConfigError, match="no such file.*launch/calibrate.py nproc=2"):
        load(str(tmp_path / "none.json"), 2, cuda=False)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a calibration file"):
        load(str(bad), 2, cuda=False)
    bad.write_text(json.dumps({"torch": "x"}))
    with pytest.raises(ConfigError, match="not a calibration file"):
        load(str(bad), 2, cuda=False)
    path = tmp_path / "calibration.json"
    _cal().write(str(path))
    with pytest.raises(ConfigError, match="measured on cpu, and this run is planned for cuda"):
        load(str(path), 2, cuda=True)
    _cal(torch="2.0.0", world=4).write(str(path))
    with caplog.at_level(logging.WARNING, logger="parallel"):
        cal = load(str(path), 2, cuda=False)
    assert cal.world == 4
    assert "made with torch 2.0.0" in caplog.text and "measured with 4 processes, the plan has 2" in caplog.text


def test_rates_measured_with_more_workers_sharing_cores_are_scaled():
    cfg, (zero0,) = _planned(name="data", zero=0)
    one = step_times(cfg, [zero0], _cal(world=2, threads=1, cores=2), 2)["compute"]
    # the same rates measured by 4 processes of one thread on the 2 cores (2 threads per core): the plan's 2
    # workers get a core each, twice as fast
    shared = step_times(cfg, [zero0], _cal(world=4, threads=1, cores=2), 2)["compute"]
    assert shared == pytest.approx(one / 2)


def test_replay_times_each_distinct_call_once_and_prices_the_rest_by_class():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with Work() as w:
        for _ in range(3):
            (a @ b.t()).relu_()  # the same calls three times: a product of a transposed view, an in-place op
        torch.nn.functional.embedding(torch.zeros(4, dtype=torch.long), a)  # integer indices: zeros, valid
    calls = {key: [n, flops, moved] for key, (n, flops, moved) in w.calls.items()}
    assert sum(n for n, _, _ in calls.values()) == w.ops == 11  # t, mm, relu_ x3; embedding (2 ops)
    assert len(calls) == 5
    mm = next(k for k in calls if k[0] is torch.ops.aten.mm.default)
    assert mm[1][2][2] == (1, 64)  # b.t(): strides kept
    replay = Replay(torch.device("cpu"))
    t = replay.price(calls, _cal())
    assert len(replay.seconds) == len(calls) and all(s is not None and s > 0 for s in replay.seconds.values())
    assert t["products"] == pytest.approx(3 * replay.seconds[mm, 1]) and t["memory"] > 0  # (call, operand sets)
    # a call that cannot run here (an index out of range needs real values) is priced by its class
    bad = (torch.ops.aten.select.int, (("tensor", (2,), (1,), 0, torch.float32), ("value", 0), ("value", 5)), ())
    assert replay.price({bad: [1, 0, 8]}, _cal()) == {"products": 0.0, "memory": pytest.approx(8 * 1e-10 + 1e-6)}
    assert replay.seconds[bad, 1] is None


def test_replay_makes_every_tensor_and_named_device_on_its_own_device():
    """A CUDA run planned on the CPU names the CPU in its calls (autocast's casts, factory ops); replayed on the
    GPU, they must stay on it, not time a copy to host memory the run never makes."""
    x = torch.ones(2, 3)
    key = spec(((x,), {"dtype": torch.bfloat16, "device": torch.device("cpu"), "non_blocking": False}))
    args, kwargs = _real(key, torch.device("meta"))
    assert args[0].device.type == "meta" and args[0].shape == (2, 3)
    assert kwargs == {"dtype": torch.bfloat16, "device": torch.device("meta"), "non_blocking": False}
    assert torch.ops.aten._to_copy.default(*args, **kwargs).device.type == "meta"


def test_attention_on_the_cpu_counts_torch_s_products_with_grouped_heads_too():
    """scaled_dot_product_attention runs the CPU's own kernels here, which torch's FLOP table leaves out: counted
    as torch's formula for the flash kernel counts them, with grouped key/value heads broadcast."""
    from torch.utils.flop_counter import flop_registry

    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    kv = torch.randn(2, 2, 16, 8, requires_grad=True)
    with Work() as w:
        out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        out.sum().backward()
    attention = [(k[0].name(), flops) for k, (_, flops, _) in w.calls.items() if "attention" in k[0].name()]
    assert [name for name, _ in attention] == ["aten::_scaled_dot_product_flash_attention_for_cpu",
                                               "aten::_scaled_dot_product_flash_attention_for_cpu_backward"]
    whole = torch.randn(2, 4, 16, 8)  # the same products with the key/value heads repeated, by torch's formulas
    fwd = flop_registry[torch.ops.aten._scaled_dot_product_flash_attention](whole, whole, whole, out_val=None)
    bwd = flop_registry[torch.ops.aten._scaled_dot_product_flash_attention_backward](whole, whole, whole, whole,
                                                                                       out_val=None)
    assert [flops for _, flops in attention] == [fwd, bwd] == [2 * 2 * 4 * 16 * 16 * 16, 2 * 2 * 4 * 16 * 16 * 40]
