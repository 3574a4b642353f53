"""strategy=auto: the candidates are planned, those over memory.budget dropped, the fastest run."""
import json

import matplotlib.image
import pytest

from tests import cli

# Weights and AdamW state dominate this model's memory: half of what `single` needs leaves offload.
WIDE = ["model.args.hidden=256", "model.args.depth=8", "trainer.batch_size=64", "trainer.steps=2",
        "trainer.log_every=1", "trainer.progress=false"]


@pytest.mark.timeout(300)
def test_auto_under_half_the_plain_runs_memory_picks_a_plan_that_fits_and_stays_under_it(tmp_path):
    single = tmp_path / "single"
    cli.run(WIDE + [f"run_dir={single}"], cwd=tmp_path)
    budget = cli.metrics(single)[-1]["mem_peak_bytes"] // 2
    auto = tmp_path / "auto"
    proc = cli.run(WIDE + ["strategy=auto", f"memory.budget={budget}", f"run_dir={auto}"], cwd=tmp_path)
    assert "auto: running" in proc.stdout
    record = json.loads((auto / "auto.json").read_text())
    assert record["chosen"] != ["strategy=single"]
    by_name = {c["name"]: c for c in record["candidates"]}
    assert "> budget" in by_name["single"]["dropped"]  # dropped, with the reason
    chosen = next(c for c in record["candidates"] if c["overrides"] == record["chosen"])
    assert chosen["dropped"] is None and chosen["peak"] <= budget
    assert cli.metrics(auto)[-1]["mem_peak_bytes"] <= budget  # the run stays under it


@pytest.mark.timeout(300)
def test_auto_on_two_workers_ranks_every_candidate(tmp_path):
    proc = cli.run(["strategy=auto", "nproc=2", "trainer.steps=2", "trainer.progress=false", f"run_dir={tmp_path}"],
                   cwd=tmp_path)
    record = json.loads((tmp_path / "auto.json").read_text())
    names = [c["name"] for c in record["candidates"]]
    assert {"data zero 0", "data zero 3", "model tp2", "pipeline pp2 m2", "pipeline pp2 m8"} <= set(names)
    fits = [c for c in record["candidates"] if c["dropped"] is None]
    steps = [c["times"]["step"] for c in fits]
    assert steps == sorted(steps) and fits[0]["overrides"] == record["chosen"]  # the fastest runs
    # auto.png beside auto.json: a row per planned candidate (tests/unit/test_plan_pictures.py checks the drawing).
    planned = [c for c in record["candidates"] if c["times"]]
    height, width, _ = matplotlib.image.imread(tmp_path / "auto.png").shape
    assert width == 1100 and height == pytest.approx(100 * (1.2 + 0.32 * len(planned)), abs=1)
    assert cli.metrics(tmp_path)[-1]["loss"] > 0 and "auto: running" in proc.stdout
    # the run logs auto's prediction beside its measured step time (Note [cost model])
    for record in cli.metrics(tmp_path):
        assert record["predicted_step_time_s"] == pytest.approx(fits[0]["times"]["step"], rel=1e-12)
    assert "auto predicted" in (tmp_path / "logs" / "rank0.log").read_text()
    assert all(t in fits[0]["times"] for t in ("products", "memory", "ops", "compute", "bubble", "comm", "step"))


@pytest.mark.parametrize("budget,message", [("1KB", "no plan fits; the smallest is"),
                                            ("lots", "memory.budget='lots'")])
def test_bad_budget_is_a_config_error(tmp_path, budget, message):
    proc = cli.run(["strategy=auto", f"memory.budget={budget}", f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_auto_plans_context_parallelism_for_a_batch_too_small_to_split(tmp_path):
    """One long sequence per step: data parallelism cannot split it; context parallelism (cp 2) is planned."""
    gpt = ["model=gpt", "data.task=lm", "data.seq_len=512", "trainer.batch_size=1", "trainer.steps=1",
           "trainer.progress=false"]
    cli.run(gpt + ["strategy=auto", "nproc=2", f"run_dir={tmp_path}"], cwd=tmp_path)
    found = {c["name"]: c for c in json.loads((tmp_path / "auto.json").read_text())["candidates"]}
    assert found["context cp2"]["dropped"] is None and found["context cp2"]["peak"] > 0
    assert "batch" in found["data zero 0"]["dropped"]
