"""Measure this machine for the step-time model (docs/planning.md, "Step time"; Note [calibration] in
parallel/planning/calibration.py).

    python launch/calibrate.py [nproc=N] [trainer.device=auto|cpu|cuda] [out=calibration.json] [runs=true|false]
                               [rounds=3] [profile=hardware/NAME.yaml]

Starts N processes at once, as a run of N workers does (N: the GPUs under CUDA, else 1), measures matrix
products by size, memory-bound ops, reference training steps, and every collective kind on every group size
dividing N; then (N > 1) runs the framework itself on N workers (data zero 3, model, pipeline; on GPUs also
data zero 0) to fit what collectives and sends cost inside a step (runs=false: not, ~20 s less here; they
are then priced as measured alone); writes calibration.json. The reference steps are timed `rounds` times
between the other measurements (default 3; rounds=1 calibrates in about half the time, less steady where
the machine's speed drifts). Use it with `plan.calibration=PATH` in
launch/plan.py and with strategy=auto; made on one node of a cluster, it prices plans for that cluster.
On CUDA it also writes a hardware profile of the GPU (parallel/planning/gpu_profile.py: its products measured by
shape, its memory's and host link's bandwidth, its peaks from its name) to `profile` (default
hardware/NAME.yaml, NAME from the GPU's name), which `launch/plan.py --config-dir DIR hardware=NAME` prices
plans on without a GPU (Note [hardware profiles] in parallel/hardware.py).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from parallel.config import ConfigError  # noqa: E402
from parallel.entry import reported  # noqa: E402
from parallel.planning.calibration import OVERLAPPED  # noqa: E402
from parallel.planning.calibration_runs import calibrate  # noqa: E402
from parallel.planning.cost import describe  # noqa: E402
from parallel.planning.gpu_profile import known_profile, measure_gpu, profile_text, slug, write_profile  # noqa: E402
from parallel.planning.reference_runs import fit_to_runs  # noqa: E402

OPTIONS = {"nproc": None, "trainer.device": "auto", "out": "calibration.json", "runs": "true", "rounds": "3",
           "profile": None}


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
    rounds = options["rounds"]
    if not rounds.isdigit() or not 1 <= int(rounds) <= 10:
        raise ConfigError(f"rounds={rounds!r}: an integer from 1 to 10")
    if options["profile"] is not None and not cuda:
        raise ConfigError(f"profile={options['profile']!r}: a hardware profile is written of a GPU (trainer.device=cuda)")
    return {"nproc": nproc, "cuda": cuda, "out": options["out"], "runs": options["runs"] == "true",
            "rounds": int(rounds), "profile": options["profile"]}


@reported
def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(__doc__.strip())
        return
    options = parse(sys.argv[1:])
    print(f"calibrate: {options['nproc']} process(es) on {'CUDA' if options['cuda'] else 'the CPU'}: products, "
          f"memory-bound ops, op cost" + (", collectives" if options["nproc"] > 1 else "") + " ...", flush=True)
    t0 = time.perf_counter()
    cal = calibrate(options["nproc"], options["cuda"], rounds=options["rounds"])
    if options["nproc"] > 1 and options["runs"]:
        print(f"calibrate: the framework's own runs on {options['nproc']} workers ("
              f"{'data zero 0 and 3' if options['cuda'] else 'data zero 3'}, model, pipeline) ...", flush=True)
        for line in fit_to_runs(cal, options["nproc"], options["cuda"], os.path.join(ROOT, "conf")):
            print(f"calibrate: {line}")
        overlap = (f"x {cal.comm_scale:.2f} the measured time of those that overlap compute "
                   f"({', '.join(OVERLAPPED[cal.kind])})" if options["cuda"] else
                   "DDP's all-reduces as measured alone (the workers fill the cores)")
        print(f"calibrate: collectives in a step: {overlap}, + {cal.call_s * 1e3:.2f} ms a call from hooks (FSDP2's, "
              f"DDP's buckets), + {cal.send_s * 1e3:.2f} ms a send, + {cal.sync_s * 1e3:.2f} ms any other call")
    cal.write(options["out"])
    print(f"calibrate: {describe(cal)}")
    print(f"written: {options['out']} ({time.perf_counter() - t0:.0f} s)")
    if options["cuda"]:
        _write_profile(options["profile"])


def _write_profile(where: str | None) -> None:
    """The GPU's hardware profile (parallel/planning/gpu_profile.py), at `where` or hardware/NAME.yaml."""
    print("calibrate: the GPU's hardware profile: products by shape, memory and host link ...", flush=True)
    measured = measure_gpu(torch.device("cuda", 0))
    path = Path(where) if where else Path("hardware") / f"{slug(measured['gpu'])}.yaml"
    write_profile(path, profile_text(measured, known_profile(measured["gpu"], Path(ROOT) / "conf")))
    print(f"written: {path} (python launch/plan.py --config-dir {path.parent.parent} hardware={path.stem} ...)")


if __name__ == "__main__":
    main()
