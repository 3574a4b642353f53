"""Measure this machine for the step-time model (docs/planning.md, "Step time"; Note [calibration] in
parallel/calibration.py).

    python launch/calibrate.py [nproc=N] [trainer.device=auto|cpu|cuda] [out=calibration.json] [runs=true|false]

Starts N processes at once, as a run of N workers does (N: the GPUs under CUDA, else 1), measures matrix
products by size, memory-bound ops, reference training steps, and every collective kind on every group size
dividing N; then (N > 1) runs the framework itself on N workers (data zero 3, model, pipeline; on GPUs also
data zero 0) to fit what collectives and sends cost inside a step (runs=false: not, ~20 s less here; they
are then priced as measured alone); writes calibration.json. Use it with `plan.calibration=PATH` in
launch/plan.py and with strategy=auto; made on one node of a cluster, it prices plans for that cluster.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from parallel.calibration import CALL_CLASSES, OVERLAPPED, call_class  # noqa: E402
from parallel.calibration_runs import calibrate, fit_in_step  # noqa: E402
from parallel.config import ConfigError, RunError  # noqa: E402
from parallel.cost import comm_time, describe  # noqa: E402
from parallel.entry import reported  # noqa: E402

OPTIONS = {"nproc": None, "trainer.device": "auto", "out": "calibration.json", "runs": "true"}


def parse(argv: list[str]) -> dict:
    """The options of the command line (key=value), checked."""
    options = dict(OPTIONS)
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key not in OPTIONS or not eq:
            raise ConfigError(f"{arg!r}: not an option of launch/calibrate.py (options: "
                              f"{', '.join(f'{k}=' for k in OPTIONS)})")
        options[key] = value
    device = options["trainer.device"]
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.device={device!r}: one of auto, cpu, cuda")
    cuda = device == "cuda" or device == "auto" and torch.cuda.is_available()
    if cuda and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda: no GPU visible here (calibrate on a node of the machine that will "
                          "run it)")
    if options["runs"] not in ("true", "false"):
        raise ConfigError(f"runs={options['runs']!r}: true or false")
    gpus = torch.cuda.device_count() if cuda else 0
    try:
        nproc = int(options["nproc"]) if options["nproc"] is not None else max(1, gpus)
        if nproc < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"nproc={options['nproc']!r}: an integer >= 1") from None
    if cuda and nproc > gpus:
        raise ConfigError(f"nproc={nproc}: {gpus} GPU(s) visible (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); one process per GPU")
    return {"nproc": nproc, "cuda": cuda, "out": options["out"], "runs": options["runs"] == "true"}


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


def _planned(overrides: list[str], nproc: int, cal):
    """The reference run's config, its plans and their predicted step time, priced with `cal`, planned in this
    process (as launch/plan.py would with plan.calibration; a plan a process makes costs a second of imports
    less here).

    Raises:
        ConfigError: a configuration this world size cannot take.
    """
    from hydra import compose, initialize_config_dir

    from parallel.cost import replay_for, step_times
    from parallel.planner import plan
    from parallel.validate import to_config, validate

    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        cfg = to_config(compose("config", overrides=overrides))
    validate(cfg, nproc)
    plans = plan(cfg, nproc)
    return cfg, plans, step_times(cfg, plans, cal, nproc, replay=replay_for(cfg, cal, nproc))


def fit_to_runs(cal, nproc: int, cuda: bool) -> list[str]:
    """Run REFERENCE_RUNS on `nproc` workers (those this world size can take), plan each priced with `cal`, and
    fit cal.comm_scale, cal.call_s, cal.send_s and cal.sync_s to their measured step times (`fit_in_step`); one
    line per run: measured, predicted before the fit (kept in cal.runs)."""
    runs, lines = [], []
    device = ["trainer.device=cuda" if cuda else "trainer.device=cpu"]
    with tempfile.TemporaryDirectory(prefix="calibrate-runs-") as tmp:
        for i, (strategy, hidden, overlap_only) in enumerate(REFERENCE_RUNS):
            if overlap_only and not cuda:
                continue
            common = [*strategy, f"model.args.hidden={hidden}", *REFERENCE_MODEL, *device,
                      f"trainer.batch_size={64 * nproc}"]
            try:
                cfg, plans, t = _planned(common, nproc, cal)
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


@reported
def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(__doc__.strip())
        return
    options = parse(sys.argv[1:])
    print(f"calibrate: {options['nproc']} process(es) on {'CUDA' if options['cuda'] else 'the CPU'}: products, "
          f"memory-bound ops, op cost" + (", collectives" if options["nproc"] > 1 else "") + " ...", flush=True)
    t0 = time.perf_counter()
    cal = calibrate(options["nproc"], options["cuda"])
    if options["nproc"] > 1 and options["runs"]:
        print(f"calibrate: the framework's own runs on {options['nproc']} workers ("
              f"{'data zero 0 and 3' if options['cuda'] else 'data zero 3'}, model, pipeline) ...", flush=True)
        for line in fit_to_runs(cal, options["nproc"], options["cuda"]):
            print(f"calibrate: {line}")
        overlap = (f"x {cal.comm_scale:.2f} the measured time of those that overlap compute "
                   f"({', '.join(OVERLAPPED[cal.kind])})" if options["cuda"] else
                   "DDP's all-reduces as measured alone (the workers fill the cores)")
        print(f"calibrate: collectives in a step: {overlap}, + {cal.call_s * 1e3:.2f} ms a call from hooks (FSDP2's, "
              f"DDP's buckets), + {cal.send_s * 1e3:.2f} ms a send, + {cal.sync_s * 1e3:.2f} ms any other call")
    cal.write(options["out"])
    print(f"calibrate: {describe(cal)}")
    print(f"written: {options['out']} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
