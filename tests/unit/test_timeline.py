"""The pipeline timeline on plain numbers: the drawing (parallel/pictures/timeline.py), the step the engine keeps
and its numbers (parallel/strategies/pipeline/timeline.py), and how a record's picture is written
(parallel/metrics.py, Note [pictures])."""
import json

import pytest
from matplotlib.colors import to_hex

from parallel import metrics
from parallel.memory.tracker import LiveTensorBytes
from parallel.pictures import timeline
from parallel.strategies.pipeline.timeline import Timeline

# Two ranks of a 1F1B step with 2 microbatches, in seconds: rank 1 starts later and waits between chunks.
ROWS = [
    [("forward", 0, 0, 0.00, 0.10), ("forward", 0, 1, 0.10, 0.20), ("backward", 0, 0, 0.50, 0.70),
     ("backward", 0, 1, 0.80, 1.00)],
    [("forward", 1, 0, 0.12, 0.22), ("backward", 1, 0, 0.25, 0.45), ("forward", 1, 1, 0.45, 0.55),
     ("backward_weight", 1, 0, 0.56, 0.565), ("backward", 1, 1, 0.58, 0.78)],
]
SPANS = [(0.0, 1.0), (0.05, 0.8)]


def _bars(ax):
    """(colour, y, left, width) of every bar the axes hold."""
    return [(to_hex(p.get_facecolor()), round(p.get_y() + p.get_height() / 2), p.get_x(), p.get_width())
            for p in ax.patches]


def test_one_row_per_rank_labelled_with_rank_zero_on_top():
    ax = timeline.draw(ROWS, SPANS, "t").axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert list(ax.get_yticks()) == [0, 1]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # inverted: rank 0 on top
    assert ax.get_xlim() == (0, 1.0)


def test_chunks_coloured_by_kind_over_the_waiting_span():
    ax = timeline.draw(ROWS, SPANS).axes[0]
    bars = _bars(ax)
    wait = [b for b in bars if b[0] == timeline.WAIT[0]]
    assert [(y, left, width) for _, y, left, width in wait] == [(0, 0.0, 1.0), (1, 0.05, pytest.approx(0.75))]
    for kind, (colour, _) in timeline.KINDS.items():
        want = sorted((r, c[3], pytest.approx(c[4] - c[3])) for r, row in enumerate(ROWS) for c in row
                      if c[0] == kind)
        assert sorted((y, left, width) for c, y, left, width in bars if c == colour) == want, kind
    assert len(bars) == len(wait) + sum(map(len, ROWS))
    assert len({c for c, _ in timeline.KINDS.values()} | {timeline.WAIT[0]}) == 4  # four distinct colours


def test_labels_only_where_they_fit():
    ax = timeline.draw(ROWS, SPANS).axes[0]
    labels = {t.get_text() for t in ax.texts}
    assert "s0 m0" in labels and "s1 m1" in labels  # 0.1 s of 1 s: wide enough for stage and microbatch
    assert not [t for t in ax.texts if t.get_position()[0] == pytest.approx(0.5625)]  # 5 ms: too narrow
    assert timeline._label(3, 12, 200) == "s3 m12"
    assert timeline._label(3, 12, 20) == "12"
    assert timeline._label(3, 12, 5) == ""


def test_png_bytes():
    data = timeline.png(timeline.draw(ROWS, SPANS, "t"))
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_engine_keeps_the_latest_step_not_run_under_the_memory_watch():
    t = Timeline("1F1B, 2 microbatches")
    t.record(10.0, 11.0, [("forward", 0, 0, 10.0, 10.5)])
    t.record(20.0, 21.0, [("forward", 0, 0, 20.0, 20.2), ("backward", 0, 0, 20.4, 20.9)])
    with LiveTensorBytes():  # the trainer's memory watch at a logged step
        t.record(30.0, 31.0, [("forward", 0, 0, 30.0, 30.7)])
    picture = t.gather()  # one process: its own numbers
    rows, spans, title, ago, watched = picture.draw.args
    assert (picture.tag, picture.file) == ("pipeline/timeline", "pipeline_timeline.png")
    assert (ago, watched) == (1, False)  # step 2 of 3
    assert spans == [(0.0, pytest.approx(1.0))]
    assert [(k, s, mb) for k, s, mb, _, _ in rows[0]] == [("forward", 0, 0), ("backward", 0, 0)]
    assert [pytest.approx(x) for x in (rows[0][1][3], rows[0][1][4])] == [0.4, 0.9]
    # With no step outside the watch since the last gather, the latest, marked as watched.
    with LiveTensorBytes():
        t.record(40.0, 41.0, [("forward", 0, 0, 40.0, 40.3)])
    assert t.gather().draw.args[3:] == (0, True)


def test_gathered_numbers_are_decoded_per_rank_from_the_earliest_start():
    from parallel.strategies.pipeline.timeline import HEADER, _decode

    nan = float("nan")
    # rank 0: two chunks; rank 1: one, padded; times relative to the common moment (negative: before it)
    r0 = [-5.0, -4.0, 0, 0] + [0, 0, 0, -5.0, -4.8] + [1, 0, 0, -4.5, -4.1]
    r1 = [-4.9, -4.2, 0, 0] + [2, 1, 1, -4.6, -4.3] + [nan] * 5
    assert len(r0) == len(r1) == HEADER + 10
    rows, spans = _decode(r0 + r1, len(r0))
    assert spans == [(0.0, pytest.approx(1.0)), (pytest.approx(0.1), pytest.approx(0.8))]
    assert [(k, s, mb) for k, s, mb, _, _ in rows[0]] == [("forward", 0, 0), ("backward", 0, 0)]
    assert [(k, s, mb) for k, s, mb, _, _ in rows[1]] == [("backward_weight", 1, 1)]
    assert rows[1][0][3:] == (pytest.approx(0.4), pytest.approx(0.7))


def test_a_records_picture_is_drawn_once_at_the_end_not_into_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    drawn = []

    def draw(step):
        drawn.append(step)
        return timeline.png(timeline.draw(ROWS, SPANS, f"step {step}"))

    m = metrics.Metrics(tmp_path, is_logger=True)
    for step in (1, 2):
        m.log({"step": step, "loss": 1.0, "pipeline_timeline": metrics.Picture("pipeline/timeline", "tl.png", draw)})
    assert drawn == [] and not (tmp_path / "tl.png").exists()  # Note [pictures]: not at every logged step
    m.close()
    assert drawn == [2]
    assert (tmp_path / "tl.png").read_bytes()[:4] == b"\x89PNG"
    assert all("pipeline_timeline" not in json.loads(line) for line in (tmp_path / "metrics.jsonl").open())
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    (image,) = acc.Images("pipeline/timeline")
    assert image.step == 2 and image.width == 1200 and image.height > 100


def test_pictures_are_written_again_once_their_interval_has_passed(tmp_path, monkeypatch):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 2)).save(buf, format="png")
    monkeypatch.setattr(metrics, "PICTURE_EVERY_S", 0.0)
    drawn = []
    m = metrics.Metrics(tmp_path, is_logger=True)
    for step in (1, 2):
        m.log({"step": step, "p": metrics.Picture("p", "p.png", lambda s: drawn.append(s) or buf.getvalue())})
    m.pending = {}  # nothing new for the end
    m.close()
    assert drawn == [1, 2]
