"""strategy=auto's predicted step times against every candidate run by name (Note [cost model] in parallel/planning/cost.py).

    python benchmarks/auto.py [--models mlp,gpt] [--nproc 2] [--rounds 2] [--steps 24] [--calibration PATH]
                              [--calibrate-each-round] [--pairs 3]

For each model: `launch/calibrate.py nproc=N` (unless --calibration is given), then `launch/plan.py
strategy=auto` with that calibration, which plans and prices every candidate; then every candidate that fits
is trained by name for --steps steps, the candidates taken in turn and the whole round repeated (--rounds:
A B C ... A B C), each run's step time the mean of its unwatched steps after step 6 (metrics.jsonl
step_time_s of the records at steps 12, 18, 24), a candidate's the median over rounds. Prints predicted,
measured and the error per candidate, its rounds' spread ((slowest - fastest) / median: how far this machine
moves the same run from round to round, which bounds what any prediction can meet), and how much slower auto's
pick is than the measured fastest; writes benchmarks/results/auto.json. Targets: every |error| <= 15%; the pick
within 5% of the measured best.

Pick / best is a ratio of two things run alternately: the median over pairs of the pick's step time over the
measured fastest's (the candidate with the least median), one pair per round and, where the two differ,
--pairs more pairs run one right after the other (pick, best, pick, best ...). The ratio of their medians over
the rounds alone is kept beside it (pick_over_best_of_medians).

--calibrate-each-round: a calibration and plan made again before every round after the first (about a minute
each here), so that the predictions sample the machine over the same minutes as the runs: a candidate's
prediction is then the median of its rounds' (a calibration is a few seconds' snapshot, and this machine's speed
moves by more than the targets within minutes: docs/planning.md, "What is left"). The pick stays the first plan's, as a user runs
auto once; the table also shows each candidate's error against the first calibration alone.

Models (2 ranks, as in the issue that asked for it):
    mlp    model.args.hidden=512 model.args.depth=6 trainer.batch_size=128
    gpt    model=gpt data.task=lm model.args.dim=128 model.args.layers=4 data.seq_len=64 trainer.batch_size=32
    llama  the 125M Hugging Face Llama of benchmarks/hf.py (slow on a CPU, 3-6 s a step: --models llama --rounds 2
           --steps 13 --out benchmarks/results/auto_llama.json, about 27 minutes here; one round, about 15)

The results in benchmarks/results/ were made with --calibrate-each-round and --rounds 3: auto.json (the MLP and the
gpt, about 17 minutes here) and auto_llama.json (40 minutes); auto_llama_rounds2.json with --rounds 2 (26 minutes,
before pick / best was measured by pairs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "auto.json"

MODELS = {
    "mlp": ["model.args.hidden=512", "model.args.depth=6", "trainer.batch_size=128"],
    "gpt": ["model=gpt", "data.task=lm", "model.args.dim=128", "model.args.layers=4", "data.seq_len=64",
            "trainer.batch_size=32"],
}


def llama() -> list[str]:
    """The overrides of benchmarks/hf.py's 125M Llama at its default sizes."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.hf import model_args

    return model_args(argparse.Namespace(vocab=32000, seq=128, hidden=768, layers=12, heads=12, kv_heads=4,
                                         ffn=2048, batch=4))


def run(script: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the Llama's factory lives in benchmarks/
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / script), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{script} {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def step_time(run_dir: Path, after: int) -> float:
    """The mean step time of a run's logged windows after step `after`, each the mean of its unwatched steps.

    A window of one step (the last step, logged right after a logging step: the 13th of 13 at log_every 6) holds
    only a step under the memory watch, which the run reports as it is (parallel/trainer.py: _Window): left out,
    as the watch's dispatch per op is no part of a step (the 125M Llama's data zero 0: 2.73-2.88 s a step, its
    watched 13th 3.37-3.63 s)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    logged = [r for r in records if "step_time_s" in r]
    times = [r["step_time_s"] for prev, r in zip([{"step": 0}] + logged, logged)
             if r["step"] > after and r["step"] - prev["step"] > 1]
    return statistics.fmean(times)


def train(candidate: dict, model: list[str], a: argparse.Namespace, prefix: Path) -> float:
    """Train `candidate` by name for --steps steps (its run directory `prefix`-<its name>); its step time."""
    run_dir = Path(f"{prefix}-{candidate['name'].replace(' ', '_')}")
    run("train.py", [f"nproc={a.nproc}", *candidate["overrides"], *model, f"trainer.steps={a.steps}",
                     "trainer.log_every=6", "trainer.progress=false", f"run_dir={run_dir}"], a.timeout)
    return step_time(run_dir, 6)


def calibrate_and_plan(name: str, model: list[str], a: argparse.Namespace, tmp: Path, r: int) -> tuple[str, list]:
    """A calibration (--calibration, or `launch/calibrate.py` run now) and `launch/plan.py strategy=auto` priced
    with it: (the calibration's path, the candidates that fit, the chosen one first)."""
    cal = a.calibration
    if cal is None:
        cal = str(tmp / f"{name}-calibration-{r}.json")
        print(f"{name}: calibrating ({a.nproc} processes) ...", flush=True)
        run("calibrate.py", [f"nproc={a.nproc}", f"out={cal}"], a.timeout)
    plan_dir = tmp / f"{name}-plan-{r}"
    run("plan.py", ["strategy=auto", f"nproc={a.nproc}", *model, f"plan.calibration={cal}", f"run_dir={plan_dir}"],
        a.timeout)
    found = json.loads((plan_dir / "plan.json").read_text())["auto"]
    return cal, [c for c in found if c["dropped"] is None]


def bench(name: str, model: list[str], a: argparse.Namespace, tmp: Path) -> dict:
    cal, fits = calibrate_and_plan(name, model, a, tmp, 0)
    cals, predicted = [cal], {c["name"]: [c["times"]["step"]] for c in fits}
    print(f"{name}: {len(fits)} candidates fit; each run {a.steps} steps, {a.rounds} rounds", flush=True)
    measured: dict[str, list[float]] = {c["name"]: [] for c in fits}
    for r in range(a.rounds):
        if r and a.calibrate_each_round:
            cal, again = calibrate_and_plan(name, model, a, tmp, r)
            cals.append(cal)
            times = {c["name"]: c["times"]["step"] for c in again}
            for c in fits:  # the same candidates fit: memory is planned to the byte, not measured
                predicted[c["name"]].append(times[c["name"]])
        for c in fits:
            measured[c["name"]].append(train(c, model, a, tmp / f"{name}-{len(measured[c['name']])}"))
            print(f"  round {r + 1} {c['name']}: {measured[c['name']][-1] * 1e3:.1f} ms", flush=True)
    rows = []
    for c in fits:
        runs, priced = measured[c["name"]], predicted[c["name"]]
        m, p = statistics.median(runs), statistics.median(priced)
        rows.append({"candidate": c["name"], "overrides": c["overrides"], "predicted_s": p, "measured_s": m,
                     "error_pct": 100 * (p - m) / m, "first_error_pct": 100 * (priced[0] - m) / m,
                     "terms_s": c["times"], "predicted_rounds_s": priced, "runs_s": runs,
                     "spread_pct": 100 * (max(runs) - min(runs)) / m})
    best = min(rows, key=lambda r: r["measured_s"])
    pick = rows[0]  # the first plan.json lists the chosen candidate first
    pairs = head_to_head(name, model, a, tmp, fits[0], next(c for c in fits if c["name"] == best["candidate"]),
                         list(zip(pick["runs_s"], best["runs_s"])))
    return {"model": model, "calibration": json.loads(Path(cals[0]).read_text()),
            "calibrations": [json.loads(Path(c).read_text()) for c in cals[1:]], "rows": rows,
            "pick": pick["candidate"], "best": best["candidate"], "pairs_s": pairs,
            "pick_over_best": ratio_of_pairs(pairs),
            "pick_over_best_of_medians": pick["measured_s"] / best["measured_s"],
            "max_abs_error_pct": max(abs(r["error_pct"]) for r in rows)}


def head_to_head(name: str, model: list[str], a: argparse.Namespace, tmp: Path, pick: dict, best: dict,
                 pairs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The pick's and the measured best's step times, a pair per round, and --pairs more pairs run one right
    after the other (pick, best, pick, best ...) where the best is another candidate (a round runs every
    candidate in turn, minutes apart, and this machine has moved the same run by up to a half between rounds)."""
    if pick is best:
        return pairs
    for i in range(a.pairs):
        pair = []
        for c in (pick, best):
            pair.append(train(c, model, a, tmp / f"{name}-pair{i}"))
        print(f"  pair {i + 1}: {pick['name']} {pair[0] * 1e3:.1f} ms, {best['name']} {pair[1] * 1e3:.1f} ms",
              flush=True)
        pairs.append(tuple(pair))
    return pairs


def ratio_of_pairs(pairs: list[tuple[float, float]]) -> float:
    """Pick / best: the median of the pairs' ratios."""
    return statistics.median(p / b for p, b in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--calibration", default=None, help="a calibration.json to use (default: made first)")
    ap.add_argument("--calibrate-each-round", action="store_true",
                    help="a new calibration and plan before every round; a candidate's prediction is the median of "
                         "its rounds' (with --calibration: that file, planned again)")
    ap.add_argument("--pairs", type=int, default=3,
                    help="where auto's pick is not the measured best: this many more runs of the two, one after "
                         "the other (pick/best is the median of every pair's ratio, the rounds' included)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.steps < 13:
        ap.error("--steps: at least 13 (the windows after step 6 are measured)")
    result = {"nproc": a.nproc, "rounds": a.rounds, "steps": a.steps, "pairs": a.pairs,
              "calibrate_each_round": a.calibrate_each_round,
              "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench-auto-") as tmp:
        for name in a.models.split(","):
            model = llama() if name == "llama" else MODELS[name]
            result["models"][name] = bench(name, model, a, Path(tmp))
    each = a.calibrate_each_round and a.rounds > 1  # a first-calibration column only where there were others
    for name, res in result["models"].items():
        print(f"\n{name} ({a.nproc} ranks; predicted vs measured, ms)")
        print(f"  {'candidate':<36}{'predicted':>10}{'measured':>10}{'error':>9}{'rounds spread':>15}"
              + (f"{'first calibration':>19}" if each else ""))
        for r in res["rows"]:
            mark = "->" if r["candidate"] == res["pick"] else "  "
            print(f"{mark}{r['candidate']:<36}{r['predicted_s'] * 1e3:>10.1f}{r['measured_s'] * 1e3:>10.1f}"
                  f"{r['error_pct']:>8.1f}%{r['spread_pct']:>14.0f}%" + (f"{r['first_error_pct']:>18.1f}%" if each else ""))
        within = sum(abs(r["error_pct"]) <= 15 for r in res["rows"])
        spread = sum(r["spread_pct"] > 15 for r in res["rows"])
        print(f"  pick {res['pick']}, measured best {res['best']}: pick / best = {res['pick_over_best']:.3f} "
              f"(median of {len(res['pairs_s'])} pairs; of the medians {res['pick_over_best_of_medians']:.3f}); "
              f"largest |error| {res['max_abs_error_pct']:.0f}%; {within} of {len(res['rows'])} within 15%; "
              f"{spread} whose own rounds spread more than 15%")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
