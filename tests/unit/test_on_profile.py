"""A step on a GPU profile (Note [step time on a profile] in parallel/planning/on_profile.py): what overlaps what,
the profile's checks (Note [hardware profiles] in parallel/hardware.py), and a planned step priced."""
import pytest

from parallel.config import Config, ConfigError
from parallel.hardware import check_hardware
from parallel.planning.auto import device_budget
from parallel.planning.network import Placement, one_level
from parallel.planning.on_profile import Collective, exposed_comm, profile_times
from parallel.planning.planner import plan
from parallel.validate import validate
from tests.unit.test_kernels import profile
from tests.unit.test_network import NVLINK

MB = 1 << 20


def test_fsdp_hides_all_but_its_first_gather_and_last_reduce_scatter_behind_enough_compute():
    h100, node = profile("h100"), Placement(8, 1)
    gathers = Collective("allgather", 10, 10 * 16 * MB, node, fsdp=True)
    scatters = Collective("reducescatter", 5, 5 * 128 * MB, node, fsdp=True)
    g, s = one_level("allgather", 16 * MB, 8, NVLINK), one_level("reducescatter", 128 * MB, 8, NVLINK)
    alone = 10 * g + 5 * s
    hidden = exposed_comm(h100, [gathers, scatters], fb=1.0)  # a second of compute hides the rest
    assert hidden["allgather"]["alone_s"] == pytest.approx(10 * g)
    assert hidden["allgather"]["exposed_s"] == pytest.approx(g)
    assert hidden["reducescatter"]["exposed_s"] == pytest.approx(s)
    # no compute to hide behind: all of it; some: max(0, comm - compute) beside the first and last
    bare = exposed_comm(h100, [gathers, scatters], fb=0.0)
    assert bare["allgather"]["exposed_s"] + bare["reducescatter"]["exposed_s"] == pytest.approx(alone)
    some = exposed_comm(h100, [gathers, scatters], fb=0.5 * (alone - g - s))
    assert some["allgather"]["exposed_s"] + some["reducescatter"]["exposed_s"] == pytest.approx(
        g + s + 0.5 * (alone - g - s))
    assert hidden["allgather"]["groups"] == ["8 ranks on 1 node"]


def test_ddp_buckets_run_beside_backward_and_other_calls_are_waited():
    h100, node = profile("h100"), Placement(8, 1)
    buckets = Collective("bucket", 4, 100 * MB, node)
    tp = Collective("allreduce", 6, 6 * MB, node)
    b, t = one_level("allreduce", 25 * MB, 8, NVLINK), one_level("allreduce", MB, 8, NVLINK)
    out = exposed_comm(h100, [buckets, tp], fb=1.0)
    assert out["bucket"]["alone_s"] == pytest.approx(4 * b) and out["bucket"]["exposed_s"] == pytest.approx(b)
    assert out["allreduce"]["exposed_s"] == out["allreduce"]["alone_s"] == pytest.approx(6 * t)
    # backward is 2/3 of the forward and backward: with fb = 3 b, 2 b hidden, the last one and one more exposed
    assert exposed_comm(h100, [buckets], fb=3 * b)["bucket"]["exposed_s"] == pytest.approx(2 * b)


def _cfg(**changes) -> Config:
    cfg = Config()
    cfg.hardware = profile(changes.pop("hardware", "h100"))
    for key, value in changes.items():
        section, _, name = key.partition("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_a_gpu_profile_prices_a_cuda_run_within_its_memory():
    cfg = _cfg()
    check_hardware(cfg, 8)
    assert cfg.trainer.device == "cuda"  # auto under a GPU profile
    assert device_budget(cfg, 8) == 85017493504  # the profile's memory, measured here
    with pytest.raises(ConfigError, match="hardware='h100': a GPU profile prices a CUDA run"):
        check_hardware(_cfg(trainer__device="cpu"), 1)
    with pytest.raises(ConfigError, match=r"memory.budget='90GB': above hardware=h100's memory, 85.0 GB"):
        check_hardware(_cfg(memory__budget="90GB"), 1)
    check_hardware(_cfg(memory__budget="80GB"), 1)
    with pytest.raises(ConfigError, match="hardware.peak_flops.fp32=None: hardware=b200 has no fp32 peak"):
        check_hardware(_cfg(hardware="b200", trainer__precision="fp32"), 1)
    lone = _cfg()
    lone.hardware.network.bandwidth = None
    check_hardware(lone, 8)
    with pytest.raises(ConfigError, match="hardware.network.bandwidth=None: nproc=16 spans nodes of 8"):
        check_hardware(lone, 16)
    check_hardware(Config(), 1)  # hardware=cpu: this host, nothing to check
    assert Config().trainer.device == "auto"


@pytest.mark.timeout(120)
def test_a_planned_step_on_a_profile_is_its_terms_and_runs_nothing():
    cfg = _cfg(strategy__name="data", strategy__zero=3)
    cfg.model.args = {"hidden": 64, "depth": 2}
    validate(cfg, 2)
    plans = plan(cfg, 2)
    t = profile_times(cfg, plans, 2, cfg.hardware)
    assert t["step"] == pytest.approx(t["compute"] + t["comm"] + t["bubble"] + t["transfers"])
    assert t["compute"] == pytest.approx(t["products"] + t["attention"] + t["memory"]) and t["products"] > 0
    assert {"allgather", "reducescatter"} <= set(t["comm_by_kind"])  # FSDP2's, over the 2 ranks of one node
    assert t["comm_by_kind"]["allgather"]["groups"] == ["2 ranks on 1 node"]
    assert 0 < t["comm"] <= t["comm_alone"]
    # DDP's bucket over the data-parallel ranks, placed from the mesh
    cfg0 = _cfg(strategy__name="data", strategy__zero=0)
    cfg0.model.args = {"hidden": 64, "depth": 2}
    validate(cfg0, 2)
    assert profile_times(cfg0, plan(cfg0, 2), 2, cfg0.hardware)["comm_by_kind"]["bucket"]["calls"] == 1
