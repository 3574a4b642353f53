"""The framework's own reference runs that launch/calibrate.py fits the in-step cost of collectives to
(Note [calibration] in parallel/planning/calibration.py): each run planned in this process, priced with the
calibration being made, then trained on N workers from this process, and the fit of its measured step times.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile

from parallel.config import ConfigError, RunError
from parallel.planning.calibration import CALL_CLASSES, OVERLAPPED, call_class
from parallel.planning.calibration_runs import fit_in_step
from parallel.planning.cost import comm_time

# The framework's own runs the collectives in a step are fitted to (Note [calibration]): each strategy's, the
# width of its MLP, and whether it is run only where the overlap of DDP's all-reduces with backward is fitted
# (GPUs; a CPU's workers fill its cores, and a collective's copies and sums take core time from the
# computation beside it: comm_scale 1). Data zero 0's is wide, its gradients' all-reduces large beside its
# compute (57 MB of them at hidden 1536, 0.04-0.07 s alone here): what the overlap is fitted to; the others'
# small calls fix the time per call.
REFERENCE_RUNS = ((["strategy=data", "strategy.zero=0"], 1536, True),
                  (["strategy=data", "strategy.zero=3"], 512, False),
                  (["strategy=model"], 512, False),
                  (["strategy=pipeline", "strategy.microbatches=8"], 512, False))
# 54 steps: the mean of each 6 after the sixth, and the median of those eight means, which a stretch of a few
# slow steps (another process on the cores) moves less than their mean. One run's windows here spread as far
# as runs do (five runs of data zero 3 one after another: windows 63-84 ms, medians 68-78 ms); with four
# windows (30 steps) the same run measured 75-101 ms in six calibrations made over two days, with eight 68-75 ms
# in six made within an hour (not alternated: the machine's own speed moves as much).
REFERENCE_MODEL = ["model.args.depth=6", "trainer.steps=54", "trainer.log_every=6", "trainer.progress=false"]


@contextlib.contextmanager
def _quiet():
    """This process's standard output, and its workers' (forked with it), to /dev/null: a reference run's log
    lines are not calibrate's."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def _train(cfg, overrides: list[str], nproc: int, run_dir: str) -> None:
    """A reference run on `nproc` workers started from this process (as launch/train.py starts them; here
    without a second interpreter's imports, ~3 s a run); this process's environment as it was before."""
    from parallel.config import to_dict
    from parallel.launcher import launch

    environ = dict(os.environ)
    try:
        with _quiet():
            launch(to_dict(cfg), run_dir, nproc)
    except Exception as e:  # noqa: BLE001 - named in one line, as a failed script's last line was
        raise RunError(f"calibrate: the reference run `{' '.join(overrides)}` failed: "
                       f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    finally:  # the launch API sets variables for its workers (TORCHELASTIC_SIGNALS_TO_HANDLE): the next run's own
        os.environ.clear()
        os.environ.update(environ)


def _planned(overrides: list[str], nproc: int, cal, conf: str):
    """The reference run's config, its plans and their predicted step time, priced with `cal`, planned in this
    process (as launch/plan.py would with plan.calibration; a plan a process makes costs a second of imports
    less here).

    Raises:
        ConfigError: a configuration this world size cannot take.
    """
    from hydra import compose, initialize_config_dir

    from parallel.planning.cost import replay_for, step_times
    from parallel.planning.planner import plan
    from parallel.validate import to_config, validate

    with initialize_config_dir(config_dir=conf, version_base=None):
        cfg = to_config(compose("config", overrides=overrides))
    validate(cfg, nproc)
    plans = plan(cfg, nproc)
    return cfg, plans, step_times(cfg, plans, cal, nproc, replay=replay_for(cfg, cal, nproc))


def fit_to_runs(cal, nproc: int, cuda: bool, conf: str) -> list[str]:
    """Run REFERENCE_RUNS on `nproc` workers (those this world size can take), plan each priced with `cal`, and
    fit cal.comm_scale, cal.call_s, cal.send_s and cal.sync_s to their measured step times (`fit_in_step`); one
    line per run: measured, predicted before the fit (kept in cal.runs). `conf`: the config directory."""
    runs, lines = [], []
    device = ["trainer.device=cuda" if cuda else "trainer.device=cpu"]
    with tempfile.TemporaryDirectory(prefix="calibrate-runs-") as tmp:
        for i, (strategy, hidden, overlap_only) in enumerate(REFERENCE_RUNS):
            if overlap_only and not cuda:
                continue
            common = [*strategy, f"model.args.hidden={hidden}", *REFERENCE_MODEL, *device,
                      f"trainer.batch_size={64 * nproc}"]
            try:
                cfg, plans, t = _planned(common, nproc, cal, conf)
            except ConfigError as e:
                lines.append(f"{' '.join(strategy)}: left out ({e})")
                continue
            run = os.path.join(tmp, f"run{i}")
            _train(cfg, common, nproc, run)
            with open(os.path.join(run, "metrics.jsonl")) as f:
                times = [r["step_time_s"] for r in map(json.loads, f) if "step_time_s" in r and r["step"] > 6]
            measured = statistics.median(times)
            comm = max((p.work["comm"] for p in plans), key=lambda c: sum(n for n, _ in c.values()))
            hooked, sends, other = (sum(n for k, (n, _) in comm.items() if call_class(k.split("/")[0]) == c)
                                    for c in CALL_CLASSES)
            # alone: cal's in-step terms are not fitted yet
            overlapped = comm_time({"comm": {k: v for k, v in comm.items() if k.split("/")[0] in OVERLAPPED[cal.kind]}},
                                   cal)
            runs.append((measured, t["step"] - t["comm"], overlapped, t["comm"] - overlapped, hooked, sends, other))
            cal.runs.append({"run": " ".join(common), "measured_s": measured, "predicted_s": t["step"],
                             "compute_s": t["compute"], "bubble_s": t["bubble"], "comm_s": t["comm"],
                             "hooked": hooked, "sends": sends, "other": other})
            lines.append(f"{' '.join(strategy)} (hidden {hidden}): measured {measured * 1e3:.1f} ms, predicted "
                         f"{t['step'] * 1e3:.1f} (compute {t['compute'] * 1e3:.1f}, bubble {t['bubble'] * 1e3:.1f}, "
                         f"comm {t['comm'] * 1e3:.1f}; {hooked} calls from hooks, {sends} sends, {other} other "
                         f"collectives)")
    cal.comm_scale, cal.call_s, cal.send_s, cal.sync_s = fit_in_step(runs, overlap=cuda)
    return lines
