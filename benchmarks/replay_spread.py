"""How far one plan's predicted step time moves between processes: the same plan priced by launch/plan.py in
fresh processes one after another, its op calls timed again in each (Note [cost model]).

    python benchmarks/replay_spread.py [--processes 6] [--calibration PATH] [overrides ...]

The overrides name the plan (default: the built-in MLP of benchmarks/auto.py, hidden 512, depth 6, batch 128,
strategy=data strategy.zero=0, 2 ranks). Without --calibration, one is made first with
`launch/calibrate.py runs=false` (about 15 s) and every process uses it, so that only the replay differs.
Prints each process's terms and their spread (largest over smallest), and writes
benchmarks/results/replay_spread.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["model.args.hidden=512", "model.args.depth=6", "trainer.batch_size=128", "strategy=data",
           "strategy.zero=0"]
TERMS = ("products", "memory", "compute", "comm", "step")
TIMEOUT_S = 600  # one plan takes seconds here; a process that has not ended by then hung


def priced(overrides: list[str], world: int, calibration: str, run_dir: Path) -> dict[str, float]:
    """One fresh launch/plan.py process: the predicted terms of its plan.json, in seconds."""
    subprocess.run([sys.executable, str(ROOT / "launch" / "plan.py"), *overrides, f"nproc={world}",
                    f"plan.calibration={calibration}", f"run_dir={run_dir}"],
                   check=True, capture_output=True, cwd=ROOT, timeout=TIMEOUT_S)
    return json.loads((run_dir / "plan.json").read_text())["step_time"]["predicted_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calibration", help="a calibration.json made on this machine (default: made first)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "replay_spread.json"))
    ap.add_argument("overrides", nargs="*", default=DEFAULT)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="replay-spread-") as tmp:
        calibration = a.calibration
        if calibration is None:
            calibration = str(Path(tmp) / "calibration.json")
            print(f"calibrating ({a.world} processes, runs=false) ...", flush=True)
            subprocess.run([sys.executable, str(ROOT / "launch" / "calibrate.py"), f"nproc={a.world}", "runs=false",
                            f"out={calibration}"], check=True, capture_output=True, cwd=ROOT, timeout=TIMEOUT_S)
        rows = []
        print(f"{'process':>7} " + " ".join(f"{t:>9}" for t in TERMS) + "   (ms)")
        for i in range(a.processes):
            t = priced(a.overrides, a.world, calibration, Path(tmp) / f"plan{i}")
            rows.append({k: t[k] for k in TERMS})
            print(f"{i + 1:>7} " + " ".join(f"{t[k] * 1e3:9.1f}" for k in TERMS), flush=True)
    spread = {k: max(r[k] for r in rows) / min(r[k] for r in rows) if min(r[k] for r in rows) > 0 else None
              for k in TERMS}
    print(f"{'spread':>7} " + " ".join(f"{spread[k]:9.3f}" if spread[k] else f"{'-':>9}" for k in TERMS)
          + "   (largest / smallest)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"overrides": a.overrides, "world": a.world, "processes": rows,
                                       "spread": spread}, indent=1))
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
