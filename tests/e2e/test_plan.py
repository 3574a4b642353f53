"""launch/plan.py: the memory each rank will need, predicted before running, against what the run measures."""
import json
import os
import subprocess

import matplotlib.image
import pytest
import torch

from parallel.config import ConfigError
from parallel.planning import reference_runs
from tests import cli

PLAN = str(cli.ROOT / "launch" / "plan.py")
# Activations matter at this batch (the peak falls in backward for most strategies).
BIG = ["trainer.batch_size=512"]
GPT = ["model=gpt", "data.task=lm", "model.args.dim=32", "model.args.heads=4", "data.seq_len=16",
       "trainer.batch_size=16"]
HF = ["model=custom", "data.task=lm", "data.seq_len=16", "trainer.batch_size=64"]

# name -> (world size, overrides); the same overrides go to train.py and plan.py
CASES = {
    "data_zero0": (2, BIG + ["strategy=data"]),
    "data_zero3": (2, BIG + ["strategy=data", "strategy.zero=3"]),
    # Hybrid sharding (HSDP): sharded within 2 groups of 2 ranks, the gradient shards all-reduced across them.
    "data_zero3_dp_replicate2": (4, BIG + ["strategy=data", "strategy.zero=3", "strategy.dp_replicate=2"]),
    # Another optimizer's state (one momentum buffer per weight), sharded by ZeRO-1.
    "data_zero1_sgd": (2, BIG + ["strategy=data", "strategy.zero=1", "optim._target_=torch.optim.SGD",
                                 "+optim.args.momentum=0.9"]),
    "model_gpt": (2, GPT + ["strategy=model"]),
    "pipeline_1f1b": (2, ["trainer.batch_size=256", "strategy=pipeline", "strategy.balance=params"]),
    # An interleaved schedule holds its sends until the step ends; tensor-parallel stages send their
    # local pieces; two roles planned one after the other. Four microbatches, not the default eight: the run
    # and its plan took 23.5 s with eight here, 17.7 s with four.
    "hybrid_pp_tp_interleaved": (4, GPT + ["strategy=hybrid", "strategy.pp=2", "strategy.tp=2",
                                           "strategy.schedule=Interleaved1F1B", "strategy.microbatches=4"]),
    # Tensor-parallel all-reduces wrapped as async tensors; FSDP; blocks recomputed in backward.
    "hybrid_dp_tp_zero3_recompute": (4, BIG + ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.zero=3",
                                               "strategy.activations=checkpoint"]),
    # Each sequence split over the cp ranks: a quarter of the tokens' activations per rank; attention's
    # gathered keys and values are transient. Six blocks: in some runs one block's all-gather (its stacked
    # input and gathered output) outlives its last use, by a race (held by the collective's work, it seems):
    # 11% over a two-block plan in a CI suite run, exactly those bytes; 4.4-5.0% of a six-block peak in 4 of 8
    # runs in new interpreters here, the plan exact in the others.
    "context_gpt": (2, GPT + ["strategy=context", "data.seq_len=64", "model.args.seq_len=64", "model.args.layers=6"]),
    "hybrid_dp_cp_zero3": (4, GPT + ["strategy=hybrid", "strategy.dp=2", "strategy.cp=2", "strategy.zero=3",
                                     "data.seq_len=64", "model.args.seq_len=64", "model.args.layers=6"]),
    "offload_disk": (1, BIG + ["strategy=offload", "strategy.activations=disk"]),
    "user_model_zero3": (2, BIG + ["model=custom", "model._target_=tests.user_model.two_tower", "strategy=data",
                                   "strategy.zero=3"]),
    # Hugging Face models read their positions to skip the causal mask: the plan reads them too (Note [planner]).
    "hf_llama": (1, HF + ["model._target_=tests.hf_models.llama"]),
    "hf_gpt2": (1, HF + ["model._target_=tests.hf_models.gpt2"]),
    # Its own plan with the residual stream cut by the sequence and the logits split by the vocabulary.
    "hf_llama_tp2_sequence_loss": (2, HF + ["model._target_=tests.hf_models.llama", "strategy=model",
                                            "strategy.sequence_parallel=true", "strategy.loss_parallel=true"]),
    # Each rank holds half the experts; the plan sends a balanced share of the tokens to each through the
    # all-to-alls of the real run (Note [moe layer]).
    "moe_ep2": (2, ["model=moe", "data.task=lm", "model.args.experts=8", "strategy=expert"]),
}


def plan(args: list[str], cwd, check: bool = True) -> subprocess.CompletedProcess:
    proc = cli.run_script(PLAN, list(map(str, args)), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"plan.py {args} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(CASES))
def test_predicted_peak_is_within_10_percent_of_the_measured_one(tmp_path, case):
    world, args = CASES[case]
    measured_dir, plan_dir = tmp_path / "run", tmp_path / "plan"
    # Two steps, each watched: the second holds the optimizer state the first made.
    cli.run(args + [f"nproc={world}", "trainer.steps=2", "trainer.log_every=1", "trainer.progress=false",
                    f"run_dir={measured_dir}"], cwd=tmp_path)
    out = plan(args + [f"nproc={world}", f"run_dir={plan_dir}"], cwd=tmp_path)
    assert "total" in out.stdout and "peak in" in out.stdout  # the table
    measured = cli.metrics(measured_dir)[-1]["mem_peak_bytes_per_rank"]
    ranks = json.loads((plan_dir / "plan.json").read_text())["ranks"]
    assert sorted(r for p in ranks for r in p["same_as"]) == list(range(world))  # every rank has a role
    for p in ranks:
        kinds = [p[k] for k in ("params", "grads", "optimizer", "activations", "temp")]
        assert sum(kinds) == p["total"] and min(kinds) >= 0
        for r in p["same_as"]:
            assert abs(p["total"] / measured[r] - 1) <= 0.10, (case, r, p["total"], measured[r])


@pytest.mark.timeout(120)
def test_plan_json_goes_to_hydras_run_directory(tmp_path):
    """hydra.run.dir (run_dir: the cases above; Hydra's dated default takes the same way): plan.json and its
    picture there, and the printed paths are theirs."""
    mine = tmp_path / "mine"
    out = plan([f"hydra.run.dir={mine}"], cwd=tmp_path).stdout
    for name in ("plan.json", "memory.png"):
        assert f"written: {mine / name}" in out and (mine / name).is_file(), out


@pytest.mark.timeout(60)
def test_plan_for_64_ranks_runs_here_in_under_a_minute(tmp_path):
    plan(["strategy=data", "strategy.zero=3", "nproc=64", "trainer.batch_size=64", f"run_dir={tmp_path}"],
         cwd=tmp_path)
    ranks = json.loads((tmp_path / "plan.json").read_text())["ranks"]
    assert len(ranks) == 1 and ranks[0]["same_as"] == list(range(64))
    # Sharded over 64: each rank keeps about 1/64 of the gradients and AdamW state (the mlp has 19,012
    # fp32 parameters); the parameters at the peak include the blocks FSDP has gathered.
    whole = 19012 * 4
    assert ranks[0]["grads"] < whole / 16 and ranks[0]["optimizer"] < 2 * whole / 16
    assert ranks[0]["params"] < whole


def test_pipeline_plan_has_a_row_per_stage_and_a_picture(tmp_path):
    out = plan(["strategy=pipeline", "strategy.balance=params", "nproc=4", "memory.budget=1MB",
                f"run_dir={tmp_path}"], cwd=tmp_path)
    ranks = json.loads((tmp_path / "plan.json").read_text())["ranks"]
    assert [p["rank"] for p in ranks] == [0, 1, 2, 3] and all(p["params"] > 0 for p in ranks)
    # Beside plan.json, memory.png: a bar per stage against the budget (drawn as tests/unit/test_plan_pictures.py
    # checks), 6.5 inches (or wider for more roles) by 4.5 at 100 dpi.
    assert f"written: {tmp_path / 'memory.png'}" in out.stdout
    height, width, _ = matplotlib.image.imread(tmp_path / "memory.png").shape
    assert (height, width) == (450, 650)


def test_by_module_report_lists_the_locally_connected_layer(tmp_path):
    """model=local at the user's sizes (feature size 5000, batch 40): per module, largest first."""
    out = plan(["model=local", "trainer.batch_size=40", "plan.by_module=true", f"run_dir={tmp_path}"], cwd=tmp_path)
    assert "by module" in out.stdout
    rows = json.loads((tmp_path / "plan.json").read_text())["by_module"]
    totals = [r["total"] for r in rows]
    assert totals == sorted(totals, reverse=True)
    by_name = {r["name"]: r for r in rows}
    assert by_name["local"]["type"] == "LocallyConnected2d"
    assert by_name["local"]["params"] == (5000 * 4 + 5000) * 4  # one 4-weight kernel and a bias per position
    # Saved for backward: one copy of its input's patches (positions x batch x channels), not one per position.
    assert by_name["local"]["saved"] == 5000 * 40 * 4 * 4
    assert by_name["head"]["params"] == (5000 + 1) * 4


@pytest.mark.parametrize("args,message", [
    (["strategy=data", "strategy.dp=3", "nproc=4"], "strategy.dp=3"),
    (["nproc=0"], "nproc=0: must be"),
    (["world_size=4"], "world_size='4': launch/plan.py takes the world size as train.py does: nproc=4"),
    (["plan.top=0"], "plan.top=0: must be an integer >= 1"),
    (["plan.by_module=maybe"], "plan.by_module=maybe: Value 'maybe' is not a valid bool"),
    (["strategy=pipeline", "strategy.activations=disk", "nproc=2"], "strategy.activations='disk'"),
    (["strategy=pipeline", "strategy.zero=3", "nproc=2"], "strategy.zero=3: not a key of strategy=pipeline"),
    (["plan.calibration=nope.json"], "plan.calibration='nope.json': no such file"),
])
def test_bad_input_is_a_config_error_naming_the_key(tmp_path, args, message):
    proc = plan(args + [f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "config error" in proc.stderr and message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_a_calibration_made_here_prices_the_plan(tmp_path):
    """launch/calibrate.py on 2 processes (products, memory, reference steps in one round, every collective; the
    framework's own reference runs left out), then a plan priced with it (Note [cost model]): the predicted step
    time and its terms, printed and in plan.json."""
    cal = tmp_path / "calibration.json"
    out = cli.run_script(str(cli.ROOT / "launch" / "calibrate.py"), ["nproc=2", f"out={cal}", "runs=false", "rounds=1"],
                         cwd=tmp_path, timeout=100).stdout
    assert f"written: {cal}" in out and "2 process(es)" in out
    rates = json.loads(cal.read_text())
    assert rates["world"] == 2 and rates["threads"] >= 1 and rates["dtensor_op_s"] > 0
    # the reference steps' fit (non-negative least squares): which terms it keeps differs between CPUs (an
    # AMD EPYC put no time on op_s), but it keeps one, and it reproduces the steps it was fitted to
    fitted = [rates[k] for k in ("products_scale", "memory_scale", "op_s", "step_s")]
    assert min(fitted) >= 0 and max(fitted) > 0 and 0 <= rates["fit_error"] < 1
    assert rates["replay_scale"] > 0 and rates["replay_op_s"] >= 0
    assert 0 < rates["probe_s"] < 0.1  # a 128 x 128 product, timed by the process that replayed the steps
    assert {f"{k}/2" for k in ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "send")} == \
        set(rates["comm"]) and all([n for n, _ in pts] == [4096, 64 << 10, 1 << 20, 16 << 20, 64 << 20] and
                                  all(t > 0 for _, t in pts) for pts in rates["comm"].values())
    out = plan(["strategy=data", "strategy.zero=3", "nproc=2", f"plan.calibration={cal}", f"run_dir={tmp_path}"],
               cwd=tmp_path).stdout
    assert "step time: predicted" in out and "rates launch/calibrate.py" in out
    step = json.loads((tmp_path / "plan.json").read_text())["step_time"]
    t = step["predicted_s"]
    assert step["calibration"] == str(cal) and t["comm"] > 0 and t["bubble"] == 0
    assert t["step"] == pytest.approx(t["products"] + t["memory"] + t["ops"] + t["comm"])
    for arg, words in (("nproc=0", "nproc='0'"), ("rounds=0", "rounds='0': an integer from 1 to 10")):
        bad = cli.run_script(str(cli.ROOT / "launch" / "calibrate.py"), [arg], cwd=tmp_path)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr


def _validated(overrides: list[str], world: int):
    from hydra import compose, initialize_config_dir

    from parallel.validate import to_config, validate

    with initialize_config_dir(config_dir=str(cli.ROOT / "conf"), version_base=None):
        cfg = to_config(compose("config", overrides=overrides))
    validate(cfg, world)
    return cfg


def test_calibrate_leaves_out_a_reference_run_the_world_size_cannot_take():
    """launch/calibrate.py fits collectives in a step to the framework's own runs (data zero 3, model, pipeline;
    on GPUs data zero 0 too); one a world size cannot take (tensor parallelism of hidden 512 over 3 ranks) is a
    config error before anything runs, and left out."""
    with pytest.raises(ConfigError, match="must divide by tp 3"):
        reference_runs._planned(["strategy=model", "model.args.hidden=512", *reference_runs.REFERENCE_MODEL,
                                 "trainer.batch_size=192"], 3, None, str(cli.ROOT / "conf"))


@pytest.mark.timeout(120)
def test_calibrate_starts_a_reference_run_from_its_own_process(tmp_path, capfd):
    """launch/calibrate.py's reference runs: workers started from its own process (no second interpreter), their
    step times in the run's metrics.jsonl, their log lines not on calibrate's output."""
    overrides = ["strategy=data", "strategy.zero=3", "model.args.hidden=32", "trainer.steps=8",
                 "trainer.log_every=4", "trainer.progress=false", "trainer.device=cpu", "trainer.batch_size=8"]
    cfg = _validated(overrides, 2)
    capfd.readouterr()
    environ = dict(os.environ)
    reference_runs._train(cfg, overrides, 2, str(tmp_path / "run"))
    out = capfd.readouterr().out
    assert dict(os.environ) == environ  # the launch API's variables gone (later runs here use the zygote)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "step_time_s" in r] == [4, 8]
    assert all(r["step_time_s"] > 0 for r in records if "step_time_s" in r)
    assert "step 8" not in out and "done:" not in out
    print("calibrate's own line")  # the output is this process's again
    assert capfd.readouterr().out == "calibrate's own line\n"


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.accelerator.is_available(), reason="workers are spawned there: the patch is not theirs")
def test_a_reference_run_that_fails_is_one_line_naming_it(tmp_path, monkeypatch):
    """A reference run whose workers fail: calibrate's one-line error names the run and the workers' error."""
    from parallel.config import RunError

    def broken(*args, **kwargs):
        raise RuntimeError("the workers' training broke")

    overrides = ["strategy=data", "model.args.hidden=32", "trainer.steps=2", "trainer.device=cpu"]
    cfg = _validated(overrides, 2)
    monkeypatch.setattr("parallel.launcher.run_training", broken)  # the forked workers' too
    with pytest.raises(RunError, match=r"^calibrate: the reference run `strategy=data model.args.hidden=32 "
                                       r"trainer.steps=2 trainer.device=cpu` failed: .*the workers' training broke"):
        reference_runs._train(cfg, overrides, 2, str(tmp_path / "run"))
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ


@pytest.mark.timeout(120)
def test_a_plan_for_cuda_says_so_and_names_what_it_leaves_out(tmp_path):
    """trainer.device=cuda on any host (Note [planning for CUDA]): the table is the caching allocator's bytes."""
    out = plan(["trainer.device=cuda", f"run_dir={tmp_path}"], cwd=tmp_path).stdout
    assert "plan for CUDA: strategy=single" in out and "torch.cuda.max_memory_allocated" in out
    assert "cuBLAS workspaces" in out and "the CUDA context" in out and "NCCL buffers" in out
    record = json.loads((tmp_path / "plan.json").read_text())
    assert record["device"] == "cuda" and record["cuda"]["precision"] == "bf16 autocast"
    assert {"the CUDA context", "NCCL buffers"} <= set(record["cuda"]["left_out"])
    assert record["ranks"][0]["workspaces"] == 2 * record["cuda"]["cublas_workspace"]  # forward's and backward's
    rank = record["ranks"][0]  # the caching allocator's segments (Note [caching allocator])
    assert rank["reserved"] >= rank["total"] and rank["reserved_expandable"] >= rank["total"]
    assert "CUDA, reserved: rank 0:" in out and "expandable_segments:True" in out


@pytest.mark.timeout(200)
def test_auto_plans_a_cuda_run_against_the_budget_given(tmp_path):
    out = plan(["strategy=auto", "trainer.device=cuda", "memory.budget=80GB", f"run_dir={tmp_path}"],
               cwd=tmp_path).stdout
    assert "budget 80.0 GB per rank" in out and "->single" in out and "plan for CUDA: strategy=single" in out
    record = json.loads((tmp_path / "plan.json").read_text())
    assert record["device"] == "cuda" and record["strategy"] == "single"
    assert [c["name"] for c in record["auto"] if c["dropped"] is None][0] == "single"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU's own memory is the budget there")
def test_auto_for_cuda_without_a_gpu_needs_the_budget(tmp_path):
    proc = plan(["strategy=auto", "trainer.device=cuda", f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "memory.budget=None" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(200)
def test_a_plan_on_a_gpu_profile_prices_its_step_from_the_profile(tmp_path):
    """hardware=h100 (Note [step time on a profile]): the step of a tiny GPT under FSDP2 on two H100s priced from
    the profile's figures on this CPU host, its terms, tokens/s and MFU in plan.json, nothing replayed."""
    out = plan(GPT + ["hardware=h100", "strategy=data", "strategy.zero=3", "nproc=2", f"run_dir={tmp_path}"],
               cwd=tmp_path).stdout
    assert "plan for CUDA" in out and "step time on hardware=h100: predicted" in out  # auto meant cuda
    assert "step time: left out: the gaps between kernels" in out and "MFU" in out
    record = json.loads((tmp_path / "plan.json").read_text())
    t = record["step_time"]
    assert t["hardware"] == "h100" and t["calls_timed_here"] is False and t["calibration"] is None
    p = t["predicted_s"]
    assert p["step"] == pytest.approx(p["compute"] + p["comm"] + p["bubble"] + p["transfers"])
    assert p["compute"] == pytest.approx(p["products"] + p["attention"] + p["memory"]) and p["attention"] > 0
    assert set(p["comm_exposed"]) >= {"allgather", "reducescatter"}
    assert 0 < p["comm"] <= p["comm_alone"]
    assert t["comm_by_kind"]["allgather"]["groups"] == ["2 ranks on 1 node"]
    tokens = 16 * 16  # the global batch's tokens
    assert t["tokens_per_s_per_device"] == pytest.approx(tokens / p["step"] / 2)
    assert t["mfu"] == pytest.approx(t["model_flops"] / 2 / p["step"] / 989.4e12) and 0 < t["mfu"] < 1


@pytest.mark.parametrize("args,message", [
    (["hardware=h300"], "hardware=h300: no such hardware (valid: a100, b200, cpu, h100, h100_96gb, h200)"),
    (["hardware=h100", "memory.budget=90GB"], "memory.budget='90GB': above hardware=h100's memory, 85.0 GB"),
    (["hardware=a100", "trainer.device=cpu"], "hardware='a100': a GPU profile prices a CUDA run"),
])
def test_a_bad_hardware_setting_is_one_line(tmp_path, args, message):
    proc = plan(args + [f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
