"""benchmarks/auto.py reads a run's step time as the framework logs it: the mean of its logged windows after the
warm-up, without a window of one step (the last step alone, under the memory watch); and compares auto's pick
with the measured best by pairs run one after the other."""
import argparse
import json

import benchmarks.auto as bench
from benchmarks.auto import head_to_head, ratio_of_pairs, step_time


def _metrics(tmp_path, records):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_a_lone_last_step_under_the_memory_watch_is_left_out(tmp_path):
    # 13 steps at log_every 6: windows 1-6, 7-12 and the 13th alone (watched: reported as it is)
    run = _metrics(tmp_path, [{"step": 6, "step_time_s": 9.0}, {"step": 12, "step_time_s": 2.8},
                              {"step": 12, "eval_loss": 1.0}, {"step": 13, "step_time_s": 3.5}])
    assert step_time(run, 6) == 2.8


def test_every_window_of_several_steps_after_the_warm_up_counts(tmp_path):
    run = _metrics(tmp_path, [{"step": s, "step_time_s": t} for s, t in ((6, 9.0), (12, 1.0), (18, 2.0), (24, 3.0))])
    assert step_time(run, 6) == 2.0
    assert step_time(run, 12) == 2.5


def _runs(monkeypatch, times):
    """benchmarks.auto's runs recorded, not started: each run's step time the next of `times`."""
    started, times = [], iter(times)
    monkeypatch.setattr(bench, "run", lambda script, args, timeout: started.append(args[1]))
    monkeypatch.setattr(bench, "step_time", lambda run_dir, after: next(times))
    return started


def test_the_pick_and_the_best_run_in_turn_and_their_ratio_is_of_pairs(monkeypatch, tmp_path):
    started = _runs(monkeypatch, [1.0, 2.0, 1.1, 1.0])
    a = argparse.Namespace(pairs=2, nproc=2, steps=13, timeout=1.0)
    pick, best = {"name": "data zero 0", "overrides": ["pick"]}, {"name": "model tp2", "overrides": ["best"]}
    pairs = head_to_head("m", [], a, tmp_path, pick, best, [(2.9, 2.7), (2.7, 2.7)])
    assert started == ["pick", "best", "pick", "best"]
    assert pairs == [(2.9, 2.7), (2.7, 2.7), (1.0, 2.0), (1.1, 1.0)]
    assert ratio_of_pairs(pairs) == (1.0 + 2.9 / 2.7) / 2  # the median of 0.5, 1.0, 1.074 and 1.1


def test_a_pick_that_is_the_best_runs_no_more_pairs(monkeypatch, tmp_path):
    started = _runs(monkeypatch, [])
    a = argparse.Namespace(pairs=3, nproc=2, steps=13, timeout=1.0)
    pick = {"name": "data zero 0", "overrides": ["pick"]}
    assert head_to_head("m", [], a, tmp_path, pick, pick, [(1.0, 1.0)]) == [(1.0, 1.0)]
    assert started == []
