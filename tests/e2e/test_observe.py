"""What a run leaves to look at: profiles (trainer.profile), the pipeline timeline, memory snapshots
(trainer.memory_snapshot), from one profiled 2-rank pipeline run shared by the tests here."""
import json
import pickle
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
from matplotlib.colors import to_rgb

from parallel.pictures import timeline
from tests import cli

STEPS, LOG_EVERY, PROFILE = 6, 3, (2, 3)
MICROBATCHES = 4  # the default for pp 2: 2 x pp x stages per rank


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """The run directory of a 2-rank pipeline run (1F1B, 4 microbatches) of 6 steps, logged every 3rd, steps 2..3
    profiled, memory snapshots asked for on the CPU (a warning, nothing recorded)."""
    run_dir = tmp_path_factory.mktemp("pipeline_run")
    cli.run(["nproc=2", "strategy=pipeline", "model.args.depth=2", f"trainer.steps={STEPS}",
             f"trainer.log_every={LOG_EVERY}", "trainer.progress=false", "trainer.timeout_s=60",
             "trainer.device=cpu", f"trainer.profile=[{PROFILE[0]},{PROFILE[1]}]", "trainer.memory_snapshot=true",
             f"run_dir={run_dir}"], cwd=run_dir, timeout=240)
    return run_dir


@pytest.mark.timeout(300)
def test_a_chrome_trace_per_rank_names_the_stages_chunks_and_the_optimizer_step(pipeline_run):
    for rank in (0, 1):
        trace = json.loads((pipeline_run / "profile" / f"rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {f"ProfilerStep#{s}" for s in range(1, STEPS + 1)} & names == {"ProfilerStep#2", "ProfilerStep#3"}
        chunks = {f"stage{rank} {kind} mb{mb}" for kind in ("forward", "backward") for mb in range(MICROBATCHES)}
        assert chunks <= names
        assert {"data", "forward_backward", "clip", "optimizer_step", "Optimizer.step#AdamW.step"} <= names
        assert {"gloo:send", "gloo:recv", "gloo:all_reduce"} <= names  # the pipeline's transfers, the norm's sum
        steps = [e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
        assert all(e["ph"] == "X" and e["dur"] > 0 for e in steps)  # complete events, as Perfetto reads them


def _bands(png: bytes) -> int:
    """Horizontal bands of the picture covered by the timeline's colours: its rows."""
    import io

    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    covered = np.zeros(pixels.shape[:2], bool)
    for colour, _ in [*timeline.KINDS.values(), timeline.WAIT]:
        covered |= np.abs(pixels - np.array(to_rgb(colour)) * 255).max(axis=2) < 8
    rows = covered.mean(axis=1) > 0.25  # a legend's patches cover far less of a line
    return int(rows[0]) + int(np.count_nonzero(rows[1:] & ~rows[:-1]))


@pytest.mark.timeout(300)
def test_the_timeline_has_a_row_per_rank_in_the_run_directory_and_in_tensorboard(pipeline_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    png = (pipeline_run / "pipeline_timeline.png").read_bytes()
    assert png[:4] == b"\x89PNG"
    assert _bands(png) == 2
    acc = EventAccumulator(str(pipeline_run / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    images = acc.Images("pipeline/timeline")
    assert [i.step for i in images] == [STEPS]  # the last logged step's (Note [pictures])
    assert _bands(images[0].encoded_image_string) == 2
    assert "pipeline_timeline" not in cli.metrics(pipeline_run)[-1]


@pytest.mark.timeout(300)
def test_memory_snapshot_on_the_cpu_warns_in_the_log_and_records_nothing(pipeline_run):
    for rank in (0, 1):
        log = (pipeline_run / "logs" / f"rank{rank}.log").read_text()
        assert log.count("trainer.memory_snapshot=true") == 1 and "nothing is recorded" in log
    assert not (pipeline_run / "memory_snapshot").exists()


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_on_cuda_the_trace_holds_kernels_and_the_memory_snapshot_is_written(tmp_path):
    cli.run(cli.FAST + ["trainer.device=cuda", "trainer.profile=[2,3]", "trainer.memory_snapshot=true",
                        f"run_dir={tmp_path}"], cwd=tmp_path)
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
    snapshot = pickle.loads((tmp_path / "memory_snapshot" / "rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]


# TensorBoard's own server over the run's directory, read through its HTTP data API (what its pages fetch).
SERVED_SCALARS = ("train/loss", "memory/mem_peak_bytes", "train/bubble_measured", "throughput/mfu")
TIMELINE_TAG = "pipeline/timeline"


@pytest.fixture(scope="module")
def tensorboard(pipeline_run, tmp_path_factory):
    """`tensorboard --logdir <run>/tensorboard` on a free loopback port; its base URL once it serves scalars."""
    log = tmp_path_factory.mktemp("tensorboard") / "server.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(pipeline_run / "tensorboard"),
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 90
        while not _get_json(url, "/data/plugin/scalars/tags", quiet=True).get(".", {}):
            assert server.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < end, "tensorboard served no scalars within 90 s"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def _get(url: str, path: str, **query) -> bytes:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(query)}" if query else url + path,
                                timeout=30) as r:
        return r.read()


def _get_json(url: str, path: str, quiet: bool = False, **query):
    try:
        return json.loads(_get(url, path, **query))
    except OSError:
        if quiet:
            return {}
        raise


@pytest.mark.timeout(200)
def test_tensorboard_serves_the_runs_scalars_and_timeline(pipeline_run, tensorboard):
    records = cli.metrics(pipeline_run)
    tags = _get_json(tensorboard, "/data/plugin/scalars/tags")["."]
    for tag in SERVED_SCALARS:
        assert tag in tags, sorted(tags)
    # The values served are the values logged.
    served = _get_json(tensorboard, "/data/plugin/scalars/scalars", run=".", tag="train/loss")
    assert [s for _, s, _ in served] == [r["step"] for r in records]
    assert [v for _, _, v in served] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    mfu = _get_json(tensorboard, "/data/plugin/scalars/scalars", run=".", tag="throughput/mfu")
    assert mfu and all(0 < v <= 1 for _, _, v in mfu), mfu
    images = _get_json(tensorboard, "/data/plugin/images/tags")["."]
    assert TIMELINE_TAG in images, images
    entries = _get_json(tensorboard, "/data/plugin/images/images", run=".", tag=TIMELINE_TAG)
    assert [e["step"] for e in entries] == [STEPS]
    png = _get(tensorboard, "/data/plugin/images/individualImage?" + entries[0]["query"])
    assert png[:4] == b"\x89PNG" and _bands(png) == 2  # the picture, a row per rank
