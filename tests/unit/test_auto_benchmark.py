"""benchmarks/auto.py reads a run's step time as the framework logs it: the mean of its logged windows after the
warm-up, without a window of one step (the last step alone, under the memory watch)."""
import json

from benchmarks.auto import step_time


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
