"""The planner's pictures on plain numbers: memory.png (parallel.pictures.memory) and auto.png
(parallel.pictures.candidates)."""
import matplotlib.image
import pytest

from parallel.pictures.candidates import TERMS, candidates_figure, write_candidates
from parallel.pictures.memory import KINDS, memory_figure, unit_for, write_memory

# Two roles (a pipeline's stages): bytes by kind.
KIND_BYTES = {"params": [400_000, 300_000], "grads": [400_000, 300_000], "optimizer": [800_000, 600_000],
              "activations": [1_500_000, 200_000], "temp": [100_000, 50_000]}


def _bars(ax):
    return [(p.get_x(), p.get_y(), p.get_width(), p.get_height()) for p in ax.patches]


def test_unit_for():
    assert unit_for(3.2e9) == (1e9, "GB") and unit_for(999) == (1, "B") and unit_for(1e6) == (1e6, "MB")


def test_memory_bars_stack_each_kind_in_order_with_the_budget_line():
    fig = memory_figure(["rank 0", "rank 1"], KIND_BYTES, budget=3_000_000)
    (ax,) = fig.axes
    bars = _bars(ax)
    assert len(bars) == len(KINDS) * 2  # one bar per kind and role
    for j, kind in enumerate(KINDS):
        for i in range(2):
            _, bottom, _, height = bars[2 * j + i]
            assert height == pytest.approx(KIND_BYTES[kind][i] / 1e6)  # MB: the largest figure is 3.2 MB
            assert bottom == pytest.approx(sum(KIND_BYTES[k][i] for k in KINDS[:j]) / 1e6)
    (line,) = ax.get_lines()
    assert list(line.get_ydata()) == [3.0, 3.0]
    assert ax.get_ylabel() == "peak memory per rank (MB)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rank 0", "rank 1"]


def test_memory_without_a_budget_has_no_line(tmp_path):
    fig = memory_figure(["ranks 0-3"], {k: [v[0]] for k, v in KIND_BYTES.items()})
    assert fig.axes[0].get_lines() == []
    path = write_memory(tmp_path / "memory.png", ["ranks 0-3"], {k: [v[0]] for k, v in KIND_BYTES.items()}, 10**6)
    assert matplotlib.image.imread(path).shape == (450, 650, 4)  # 6.5 x 4.5 inches at 100 dpi, RGBA


NAMES = ["data zero 1", "pipeline pp2 m2", "data zero 0"]
TIMES = [{"compute": 0.010, "bubble": 0.0, "comm": 0.002, "transfers": 0.0, "step": 0.012},
         {"compute": 0.012, "bubble": 0.006, "comm": 0.0, "transfers": 0.0, "step": 0.018},
         {"compute": 0.014, "bubble": 0.0, "comm": 0.001, "transfers": 0.0005, "step": 0.0155}]
PEAKS = [360_000, 220_000, 420_000]


def test_candidates_stack_the_terms_and_mark_the_chosen_one_and_those_over_budget():
    fig = candidates_figure(NAMES, TIMES, PEAKS, [True, True, False], chosen=0, budget=400_000, skipped=2)
    times_ax, peaks_ax = fig.axes
    bars = _bars(times_ax)
    for j, term in enumerate(TERMS):
        for i in range(3):
            left, _, width, _ = bars[3 * j + i]
            assert width == pytest.approx(TIMES[i][term] * 1e3)  # ms
            assert left == pytest.approx(sum(TIMES[i][t] for t in TERMS[:j]) * 1e3)
    faded = [p.get_hatch() == "//" for p in times_ax.patches[:3]]
    assert faded == [False, False, True]  # the third is over the budget
    labels = times_ax.get_yticklabels()
    assert labels[0].get_text() == "\u2192 data zero 1" and labels[0].get_fontweight() == "bold"
    assert [t.get_text() for t in labels[1:]] == NAMES[1:]
    peaks = [width for _, _, width, _ in _bars(peaks_ax)]
    assert peaks == pytest.approx([p / 1e3 for p in PEAKS])  # KB, from 0
    (budget,) = peaks_ax.get_lines()
    assert list(budget.get_xdata()) == [400.0, 400.0] and peaks_ax.get_xscale() == "linear"
    assert "3 candidates planned, 2 fit; 2 more could not be planned" in fig.get_suptitle()


def test_candidates_against_a_budget_that_dwarfs_them_on_a_log_scale(tmp_path):
    fig = candidates_figure(NAMES, TIMES, PEAKS, [True] * 3, chosen=0, budget=16 * 10**9)
    assert fig.axes[1].get_xscale() == "log"
    path = write_candidates(tmp_path / "auto.png", NAMES, TIMES, PEAKS, [True] * 3, 0, 16 * 10**9)
    height, width, _ = matplotlib.image.imread(path).shape
    assert width == 1100 and height > 200
