"""Measure this machine for the step-time model (docs/planning.md, "Step time"; Note [calibration] in
parallel/calibration.py).

    python launch/calibrate.py [nproc=N] [trainer.device=auto|cpu|cuda] [out=calibration.json] [runs=true|false]

Starts N processes at once, as a run of N workers does (N: the GPUs under CUDA, else 1), measures matrix
products by size, memory-bound ops, reference training steps, and every collective kind on every group size
dividing N; then (N > 1) runs the framework itself on N workers twice (data zero 0 and 3) to fit what
collectives cost inside a step (runs=false: not, ~30 s less; collectives are then priced as measured alone);
writes calibration.json. Use it with `plan.calibration=PATH` in launch/plan.py and with
strategy=auto; made on one node of a cluster, it prices plans for that cluster.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from parallel.calibration import HOOKED_KINDS, calibrate, nnls  # noqa: E402
from parallel.config import ConfigError, RunError  # noqa: E402
from parallel.cost import describe  # noqa: E402
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


# The framework's own runs the collectives in a step are fitted to (Note [calibration]).
REFERENCE_RUNS = (["strategy=data", "strategy.zero=0"], ["strategy=data", "strategy.zero=3"])
REFERENCE_MODEL = ["model.args.hidden=512", "model.args.depth=6", "trainer.steps=24", "trainer.log_every=6",
                   "trainer.progress=false"]


def _script(name: str, args: list[str]) -> None:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", name), *args], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RunError(f"calibrate: the reference run `{name} {' '.join(args)}` failed: "
                       f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def fit_to_runs(cal, nproc: int, cuda: bool) -> list[str]:
    """Run REFERENCE_RUNS on `nproc` workers, plan each priced with `cal`, and fit cal.comm_scale and cal.call_s
    to their measured step times (Note [calibration]); one line per run: measured, predicted before the fit."""
    rows, target, lines = [], [], []
    device = ["trainer.device=cuda" if cuda else "trainer.device=cpu"]
    with tempfile.TemporaryDirectory(prefix="calibrate-runs-") as tmp:
        rates = os.path.join(tmp, "calibration.json")
        cal.write(rates)
        for i, strategy in enumerate(REFERENCE_RUNS):
            common = [*strategy, *REFERENCE_MODEL, *device, f"trainer.batch_size={64 * nproc}"]
            run, planned = os.path.join(tmp, f"run{i}"), os.path.join(tmp, f"plan{i}")
            _script("train.py", [*common, f"nproc={nproc}", f"run_dir={run}"])
            _script("plan.py", [*common, f"world_size={nproc}", f"plan.calibration={rates}", f"run_dir={planned}"])
            with open(os.path.join(run, "metrics.jsonl")) as f:
                times = [r["step_time_s"] for r in map(json.loads, f) if "step_time_s" in r and r["step"] > 6]
            measured = sum(times) / len(times)
            with open(os.path.join(planned, "plan.json")) as f:
                record = json.load(f)
            t = record["step_time"]["predicted_s"]
            calls = max(sum(c for k, (c, _) in r["work"]["comm"].items() if k.split("/")[0] in HOOKED_KINDS)
                        for r in record["ranks"])
            rows.append([t["comm"], calls])
            target.append(measured - t["compute"])
            lines.append(f"{' '.join(strategy)}: measured {measured * 1e3:.1f} ms, predicted {t['step'] * 1e3:.1f} "
                         f"(compute {t['compute'] * 1e3:.1f}, comm {t['comm'] * 1e3:.1f}, {calls} all-gathers and reduce-scatters)")
    # relative errors: each run's excess weighed alike
    cal.comm_scale, cal.call_s = nnls([[a / y, b / y] for (a, b), y in zip(rows, target)], [1.0] * len(rows)) \
        if all(y > 0 for y in target) else (1.0, 0.0)
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
        print(f"calibrate: the framework's own runs on {options['nproc']} workers (data zero 0 and 3) ...",
              flush=True)
        for line in fit_to_runs(cal, options["nproc"], options["cuda"]):
            print(f"calibrate: {line}")
        print(f"calibrate: collectives in a step: x {cal.comm_scale:.2f} their measured time, + "
              f"{cal.call_s * 1e3:.2f} ms an all-gather or reduce-scatter")
    cal.write(options["out"])
    print(f"calibrate: {describe(cal)}")
    print(f"written: {options['out']} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
