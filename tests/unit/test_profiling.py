"""trainer.profile and trainer.memory_snapshot in one process (parallel/profiling.py, Note [profiles]); a whole
profiled pipeline run is in tests/e2e/test_observe.py."""
import contextlib
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch

from parallel import profiling
from parallel.config import TrainerConfig
from parallel.profiling import Profiling, phase
from tests import gpus


def _names(path) -> set[str]:
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


def test_profiler_runs_over_its_steps_only_and_names_the_phases(tmp_path):
    p = Profiling(TrainerConfig(steps=4, profile=[2, 3]), tmp_path, torch.device("cpu"))
    seen = []
    for step in range(1, 5):
        with p.step(step):
            with phase("forward_backward"):
                torch.ones(8).sum()
            seen.append((profiling.active(), type(phase("x")) is contextlib.nullcontext))
        if step == 3:  # written when its last step ends
            assert (tmp_path / "profile" / "rank0.json").exists()
    p.close()
    assert seen == [(False, True), (True, False), (True, False), (False, True)]
    names = _names(tmp_path / "profile" / "rank0.json")
    assert {"ProfilerStep#2", "ProfilerStep#3", "forward_backward", "aten::sum"} <= names
    assert not {"ProfilerStep#1", "ProfilerStep#4"} & names


def test_a_step_that_fails_inside_the_range_leaves_the_trace_of_what_ran(tmp_path):
    p = Profiling(TrainerConfig(steps=4, profile=[1, 4]), tmp_path, torch.device("cpu"))
    with p.step(1):
        torch.ones(2).sum()
    with pytest.raises(RuntimeError, match="boom"), p.step(2):
        raise RuntimeError("boom")
    assert not profiling.active()
    assert "ProfilerStep#2" in _names(tmp_path / "profile" / "rank0.json")
    p.close()  # nothing left to stop


def test_a_run_resumed_inside_the_range_profiles_the_rest_of_it(tmp_path):
    p = Profiling(TrainerConfig(steps=6, profile=[2, 4]), tmp_path, torch.device("cpu"))
    for step in (4, 5):  # resumed after step 3
        with p.step(step):
            pass
    p.close()
    names = _names(tmp_path / "profile" / "rank0.json")
    assert "ProfilerStep#4" in names and "ProfilerStep#5" not in names


def test_offload_transfers_on_their_io_threads_are_named(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from parallel.strategies.offload.tiers import Counters, DiskTier

    io = ThreadPoolExecutor(1)
    tier = DiskTier(tmp_path / "offload" / "params", Counters(), io)
    p = Profiling(TrainerConfig(steps=1, profile=[1, 1]), tmp_path, torch.device("cpu"))
    with p.step(1):
        tier.write("w0", torch.arange(16, dtype=torch.uint8)).result()
        tier.read("w0", torch.empty(16, dtype=torch.uint8)).result()
    io.shutdown()
    events = json.loads((tmp_path / "profile" / "rank0.json").read_text())["traceEvents"]
    threads = {e["name"]: e["tid"] for e in events if e.get("name", "").startswith("offload params")}
    assert set(threads) == {"offload params write w0", "offload params read w0"}
    main = {e["tid"] for e in events if e.get("name") == "ProfilerStep#1"}
    assert not set(threads.values()) & main  # recorded on the I/O thread


def test_memory_snapshot_on_the_cpu_warns_and_records_nothing(tmp_path):
    log = logging.getLogger("parallel")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    try:
        p = Profiling(TrainerConfig(memory_snapshot=True), tmp_path, torch.device("cpu"))
        with p.step(1):
            pass
        p.close()
    finally:
        log.removeHandler(handler)
    (warning,) = [r for r in records if r.levelno == logging.WARNING]
    assert "trainer.memory_snapshot=true" in warning.getMessage() and "nothing is recorded" in warning.getMessage()
    assert not (tmp_path / "memory_snapshot").exists()


@pytest.mark.cuda
def test_memory_snapshot_on_cuda_at_the_end_and_on_out_of_memory(tmp_path):
    gpus.call(snapshot_on_cuda, tmp_path)  # this process hides the GPUs (Note [tests on a GPU machine])


def snapshot_on_cuda(tmp_path: str) -> None:
    tmp_path = Path(tmp_path)
    device = torch.device("cuda")
    end, oom = tmp_path / "end", tmp_path / "oom"
    p = Profiling(TrainerConfig(memory_snapshot=True), end, device)
    with p.step(1):
        kept = torch.empty(1 << 20, device=device)
    p.close()
    snapshot = pickle.loads((end / "memory_snapshot" / "rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]
    assert any(e["action"] == "alloc" and e["size"] >= kept.nbytes for e in snapshot["device_traces"][0])

    p = Profiling(TrainerConfig(memory_snapshot=True), oom, device)
    with pytest.raises(torch.cuda.OutOfMemoryError), p.step(1):
        torch.empty(1 << 50, dtype=torch.uint8, device=device)  # a petabyte
    assert (oom / "memory_snapshot" / "rank0.pickle").exists()
    assert p.snapshot is None  # recording stopped with the dump
