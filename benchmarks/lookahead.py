"""The stacked model under strategy=offload, its frozen extractor run one batch ahead of the head or not.

    python benchmarks/lookahead.py [--pairs 3] [--steps 5]

A frozen extractor with most of the weights feeding a trainable head, weights
and optimizer state on disk (the defaults on a CPU-only machine). Runs, in one
invocation: `strategy=single` once (the reference), then `strategy.lookahead=false`
and `strategy.lookahead=true` alternately (A B A B ...). Prints each pair's
step times and their ratio, and the median ratio over pairs; losses must match
`single` in every run (checked). Writes benchmarks/results/lookahead.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import ROOT, run  # noqa: E402  (a sibling script)

MODEL = ["model=stacked", "data.features=2048", "model.args.hidden=2048", "model.args.frozen_depth=8",
         "model.args.head_depth=3", "trainer.batch_size=512", "trainer.clip_grad_norm=0"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lookahead.json"))
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        ref = run(MODEL + ["strategy=single"], a.steps, Path(tmp) / "single")
        print(f"single: step {ref['step_time_s']:.3f} s, peak RSS {ref['rss_peak_bytes'] / 1e6:.0f} MB")
        print(f"{'pair':>4} {'serial s':>9} {'ahead s':>8} {'ahead / serial':>14} {'head waited s':>13} "
              f"{'RSS serial MB':>13} {'RSS ahead MB':>12}")
        for i in range(a.pairs):
            out = {}
            for lookahead in (False, True):
                r = run(MODEL + ["strategy=offload", f"strategy.lookahead={lookahead}"], a.steps,
                        Path(tmp) / f"{i}-{lookahead}")
                if abs(r["loss"] - ref["loss"]) > 1e-4 * abs(ref["loss"]):
                    raise SystemExit(f"lookahead={lookahead}: loss {r['loss']} != single's {ref['loss']}")
                out[lookahead] = r
            row = {"serial_step_s": out[False]["step_time_s"], "ahead_step_s": out[True]["step_time_s"],
                   "ratio": out[True]["step_time_s"] / out[False]["step_time_s"],
                   "frozen_wait_s": out[True]["offload_frozen_wait_s"],
                   "rss_peak_bytes": {"serial": out[False]["rss_peak_bytes"], "ahead": out[True]["rss_peak_bytes"]}}
            rows.append(row)
            print(f"{i:>4} {row['serial_step_s']:>9.3f} {row['ahead_step_s']:>8.3f} {row['ratio']:>14.3f} "
                  f"{row['frozen_wait_s']:>13.3f} {out[False]['rss_peak_bytes'] / 1e6:>13.0f} "
                  f"{out[True]['rss_peak_bytes'] / 1e6:>12.0f}", flush=True)
    median = statistics.median(r["ratio"] for r in rows)
    print(f"median step-time ratio, lookahead / serial: {median:.3f} over {len(rows)} pairs")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "model": MODEL, "single": ref, "pairs": rows,
                                       "median_ratio": median}, indent=2))


if __name__ == "__main__":
    main()
