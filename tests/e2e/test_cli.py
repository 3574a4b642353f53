"""The command line as a user runs it: launch ways, sweeps, TensorBoard, errors."""
import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests import cli, gpus

DATA2 = ["nproc=2", "strategy=data", "strategy.zero=3", "model.args.depth=2"]


@pytest.mark.timeout(120)
def test_default_run_trains(tmp_path):
    """The quick start: `python launch/train.py` with nothing else."""
    cli.run([], cwd=tmp_path)
    (run_dir,) = list((tmp_path / "outputs").glob("*/*"))
    records = cli.metrics(run_dir)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50]
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    for key in ("loss", "lr", "grad_norm", "step_time_s", "data_time_s", "samples_per_s",
                "mem_peak_bytes", "mem_peak_bytes_per_rank", "rss_peak_bytes_per_rank"):
        assert key in records[-1]
    assert records[-1]["mem_peak_bytes"] > 0
    assert (run_dir / ".hydra" / "config.yaml").exists()


@pytest.mark.timeout(400)
def test_three_launch_ways_agree(tmp_path):
    """python nproc=2, torchrun, and a job of a Hydra sweep give the same run."""
    spawn = tmp_path / "spawn"
    cli.run(cli.FAST + DATA2 + [f"run_dir={spawn}"], cwd=tmp_path)
    tr = tmp_path / "torchrun"  # Hydra's own key for the directory, honored under torchrun too
    args = [a for a in DATA2 if not a.startswith("nproc")]
    cli.run(cli.FAST + args + [f"hydra.run.dir={tr}"], cwd=tmp_path, launcher=cli.torchrun(2))
    sweep = tmp_path / "sweep"
    cli.run(["-m"] + cli.FAST + DATA2 + ["trainer.seed=0,1", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name.split("-")[0] for p in jobs] == ["0", "1"]  # two jobs, two run dirs

    cli.assert_same_training(tr, spawn)
    cli.assert_same_training(jobs[0], spawn)
    for run_dir in (spawn, tr, *jobs):
        assert len(cli.metrics(run_dir)) == 6
        assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
        assert (run_dir / ".hydra" / "config.yaml").exists()
    # The second job ran with another seed: its own run, not a copy of the first.
    assert cli.losses(jobs[1])[0] != cli.losses(jobs[0])[0]
    # Under torchrun no per-process Hydra directories appear beside the run.
    assert not (tmp_path / "outputs").exists()


@pytest.mark.timeout(120)
def test_a_worker_builds_its_run_with_its_imports_frozen(tmp_path):
    """Note [the collector in a worker]: each worker of a command-line run (a new interpreter, as a user starts
    it) freezes what it imported before it builds the run, so the collections of the run walk the run's
    objects only."""
    cli.run(cli.FAST + ["nproc=2", "strategy=data", "model=custom", "model._target_=tests.user_model.gc_probe",
                        f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, fresh=True)
    probes = [json.loads(p.read_text()) for p in tmp_path.glob("gc_probe-*.json")]
    workers = sorted((p for p in probes if p["rank"] is not None), key=lambda p: p["rank"])
    assert [p["rank"] for p in workers] == ["0", "1"], probes
    for p in workers:
        assert p["frozen"] > 100_000 and p["tracked"] < p["frozen"] / 10, p
    assert cli.losses(tmp_path / "run")[-1] < cli.losses(tmp_path / "run")[0]


@pytest.mark.timeout(120)
def test_user_config_dir_in_instantiate_shape_trains_and_logs_lines(tmp_path):
    """A model and an optimizer of the user's own config directory, in Hydra's instantiate shape, train; with
    the console captured, the progress bar (on by default) gives way to one line per logged step."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "mine.yaml").write_text("_target_: tests.user_model.two_tower\nfeatures: ${data.features}\n"
                                              "width: 8\n")
    (conf / "optim").mkdir()
    (conf / "optim" / "sgd.yaml").write_text("_target_: torch.optim.SGD\nlr: 0.05\nmomentum: 0.9\n")
    run_dir = tmp_path / "run"
    proc = cli.run(["--config-dir", str(conf), "model=mine", "optim=sgd", "trainer.steps=4", "trainer.log_every=2",
                    f"run_dir={run_dir}"], cwd=tmp_path)
    assert len(cli.metrics(run_dir)) == 2
    saved = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "two_tower" in saved and "SGD" in saved
    assert "\r" not in proc.stdout + proc.stderr
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("step ")] == ["2", "4"]


@pytest.mark.timeout(120)
def test_tensorboard_holds_the_loss(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = reference(cli.FAST)
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "time/step_time_s", "time/data_time_s",
            "train/samples_per_s", "memory/mem_peak_bytes/rank0", "memory/rss_peak_bytes/rank0",
            "throughput/flops_per_step", "throughput/tflops_per_rank", "throughput/mfu"} <= set(scalars)
    logged = [e.value for e in acc.Scalars("train/loss")]
    want = [r["loss"] for r in cli.metrics(run_dir)]
    assert logged == pytest.approx(want, rel=1e-6)


@pytest.mark.timeout(60)
def test_cfg_job_shows_the_resolved_config(tmp_path):
    out = cli.run(["--cfg", "job", "strategy=data", "data.features=12"], cwd=tmp_path).stdout
    assert "name: data" in out and "in_features: 12" in out


BAD_CLI = [
    (["strategy=warp"], "strategy"),
    (["strategy.name=warp"], "strategy.name"),
    (["trainer.nope=1"], "nope"),
    (["trainer.steps=1.5"], "trainer.steps"),
    (["trainer.steps=-2"], "trainer.steps"),
    (["trainer.batch_size=abc"], "trainer.batch_size"),
    (["nproc=3", "strategy=data"], "trainer.batch_size"),
    (["model=custom", "model._target_=nowhere.fn"], "model._target_"),
    (["model=custom", "model._target_=tests.user_model.not_a_module"], "model._target_"),
    (["model=transformer9"], "model"),
    (["trainer.checkpoint_every=often"], "trainer.checkpoint_every"),
    (["trainer.profile=[2.5,3]"], "trainer.profile"),  # not steps
    (["trainer.resume=nowhere"], "trainer.resume"),
    (["model=gpt"], "data.task"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,key", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_bad_input_exits_cleanly_naming_the_key(tmp_path, args, key):
    proc = cli.run(args + ["trainer.steps=2" if "trainer.steps" not in key else "trainer.log_every=1"],
                   cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    assert key in proc.stderr + proc.stdout
    assert not list(tmp_path.glob("outputs/*/*/metrics.jsonl"))  # nothing trained


OTHERS_KEYS = [
    (["strategy=pipeline", "strategy.zero=3"], "config error: strategy.zero=3: not a key of strategy=pipeline, but "
                                               "of strategy=data, context, expert, hybrid (valid: ['activations', "),
    (["strategy=data", "strategy.schedule=GPipe"], "config error: strategy.schedule='GPipe': not a key of "
                                                   "strategy=data, but of strategy=pipeline, hybrid, auto (valid: "),
]


USER_MISTAKES = [
    (["strategy=pipline"], "config error: strategy=pipline: no such strategy (valid: auto, context, data, expert, "
                           "hybrid, model, offload, pipeline, single)"),
    (["-m", "strategy=single,dat"], "config error: strategy=dat: no such strategy (valid: auto, context, data, "),
    (["model=gtp"], "config error: model=gtp: no such model (valid: cnn, custom, gpt, hf, local, mlp, moe, stacked)"),
    # Hydra's own hint after `trainer.step=5`; `+` appends a key whatever the schema, and nothing would read it
    (["+trainer.step=5"], "config error: trainer.step=5: no such key of trainer; did you mean trainer.steps? (valid: "
                          "['steps', "),
    (["+model.lora.rr=2"], "config error: model.lora.rr=2: no such key of model.lora; did you mean model.lora.r? "),
    (["+foo=1"], "config error: foo=1: no such key (valid: ['strategy', "),
    # a key no schema has, and a value its type cannot take: Hydra's paragraph and exit 1 before
    (["trainer.stepz=5"], "config error: trainer.stepz=5: no such key of trainer; did you mean trainer.steps? "),
    (["trainer.steps=abc"], "config error: trainer.steps=abc: Value 'abc' of type 'str' could not be converted to "
                            "Integer"),
    # hybrid sharding's replicas split the dp ranks into equal groups (Note [hybrid sharding])
    (["nproc=4", "strategy=data", "strategy.zero=3", "strategy.dp_replicate=3"],
     "config error: strategy.dp_replicate=3: must divide the data-parallel degree strategy.dp=4: the dp ranks split "
     "into 3 groups of equal size (valid: [1, 2, 4])"),
    # a forward the batch cannot fill fails before the first step, not with a TypeError in it
    (["model=custom", "model._target_=tests.user_model.needs_a_mask"],
     "config error: model._target_='tests.user_model.needs_a_mask': its forward(x, mask) takes arguments a batch "
     "cannot fill (missing a required argument: 'mask')"),
    # a plan whose styles fit their layers but not the forward between them (SwiGLU's up left whole), rehearsed on
    # fake tensors (Note [plan rehearsal]): the workers would fail at their first forward
    (["model=custom", "model._target_=tests.user_model.swiglu", "nproc=2", "strategy=model",
      "strategy.tp_plan=[blocks.*.w1:colwise,blocks.*.w2:rowwise]"],
     "config error: strategy.tp_plan=['blocks.*.w1:colwise', 'blocks.*.w2:rowwise']: a rank's forward in blocks.0 "
     "(SwiGLUBlock, which holds blocks.0.w1:colwise, blocks.0.w2:rowwise) under tp 2 fails (RuntimeError: "),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,line", USER_MISTAKES, ids=[" ".join(a) for a, _ in USER_MISTAKES])
def test_a_user_mistake_is_one_line_exit_2_before_any_worker(tmp_path, args, line):
    """Hydra's own message for a group option no file holds is a paragraph and exit status 1; the project's is
    one line naming the options, exit 2, as for every configuration error; so is a key appended (`+`) where no
    schema has it."""
    proc = cli.run(args, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    (only,) = proc.stderr.splitlines()
    assert only.startswith(line), only


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,line", OTHERS_KEYS, ids=[" ".join(a) for a, _ in OTHERS_KEYS])
def test_a_key_of_another_strategy_is_one_line_before_any_worker(tmp_path, args, line):
    """Each strategy takes its own keys (Note [strategy schemas] in parallel/strategy_specs.py): another's is
    refused in one line, exit status 2, before the workers start."""
    proc = cli.run(args + ["nproc=2", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    (only,) = proc.stderr.splitlines()
    assert only.startswith(line), only
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(60)
def test_a_sweep_under_torchrun_is_refused(tmp_path, monkeypatch):
    """Each job of a sweep starts its own workers: a torchrun worker (its variables, here) refuses `-m`."""
    for key, value in {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    proc = cli.run(["-m", "trainer.seed=0,1"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "config error: -m (a sweep) under torchrun" in proc.stderr and "nproc=1" in proc.stderr


@pytest.mark.timeout(120)
def test_failed_worker_ends_the_run_with_its_rank_and_error(tmp_path):
    proc = cli.run(cli.FAST + ["nproc=2", "strategy=data", "model=custom",
                               "model._target_=tests.user_model.exploding", "trainer.timeout_s=30",
                               f"run_dir={tmp_path}"], cwd=tmp_path, check=False, timeout=100)
    assert proc.returncode == 1
    assert "worker rank 1 failed" in proc.stderr
    assert "boom from the user's forward" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1  # rank 1's, once; rank 0 only stopped


@pytest.mark.timeout(120)
def test_failed_worker_under_torchrun_shows_its_error_once(tmp_path):
    proc = cli.run(cli.FAST + ["strategy=data", "model=custom", "model._target_=tests.user_model.exploding",
                               "trainer.timeout_s=30", f"run_dir={tmp_path}"], cwd=tmp_path, check=False,
                   timeout=100, launcher=cli.torchrun(2))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: worker rank 1 failed: RuntimeError: boom from the user's forward" in out
    # Rank 0 says one line when its collective fails first; when torchrun's SIGTERM reaches it first (a loaded
    # machine), it is stopped before it can say anything. Either way, no traceback of its own (below).
    assert all("stopped: another worker failed" in line for line in out.splitlines() if line.startswith("rank 0:"))
    # torchrun's own, and its summary's of the first failure (rank 1): no worker prints one besides
    assert out.count("Traceback (most recent call last)") == 2, out


OOM = ["model=custom", "model._target_=tests.user_model.out_of_memory_at", "trainer.timeout_s=30"]


@pytest.mark.timeout(120)
def test_out_of_gpu_memory_is_one_line_with_where_and_what_to_change(tmp_path):
    """CUDA's out-of-memory error raised by the model in step 3's forward (on the CPU: no figures); Note [out of
    memory]."""
    proc = cli.run(cli.FAST + OOM + [f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line == ("error: out of GPU memory on rank 0 at step 3 in forward (2: OutOfMemoryAt): allocated and "
                    "limit unknown on the cpu (memory.fraction unset); no plan was made for this run (python "
                    "launch/plan.py <its overrides> nproc=1 predicts each rank's peak); try "
                    "strategy.activations=checkpoint, then trainer.grad_accum=2, then strategy=offload, then "
                    "trainer.batch_size=16")
    assert [r["step"] for r in cli.metrics(tmp_path)] == [1, 2]
    # The third forward is the evaluation after step 2: the phase says so.
    proc = cli.run(cli.FAST + OOM + ["trainer.eval_every=2", "trainer.eval_batches=1", f"run_dir={tmp_path / 'eval'}"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: out of GPU memory on rank 0 at step 2 in evaluation (2: OutOfMemoryAt): " in proc.stderr
    # strategy=auto planned the run (auto.json): the line gives its prediction.
    proc = cli.run(cli.FAST + OOM + ["strategy=auto", f"run_dir={tmp_path / 'auto'}"], cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"; the plan predicts [\d.]+ KB at its largest rank \(strategy=auto, auto.json\); try ",
                     proc.stderr), proc.stderr


@pytest.mark.timeout(120)
def test_out_of_gpu_memory_in_a_worker_is_its_line_alone(tmp_path):
    """Rank 1 of 2 runs out in step 2's backward: its line, no traceback, no launcher's report besides."""
    proc = cli.run(cli.FAST + OOM + ["nproc=2", "strategy=data", "+model.args.at=2", "+model.args.phase=backward",
                                     "+model.args.rank=1", f"run_dir={tmp_path}"], cwd=tmp_path, check=False,
                   timeout=100)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and errors[0].startswith(
        "error: out of GPU memory on rank 1 at step 2 in backward: allocated and limit unknown on the cpu"), errors
    assert errors[0].endswith("try strategy.activations=checkpoint, then trainer.grad_accum=2, then strategy.zero=3, "
                              "then trainer.batch_size=16")


@pytest.mark.timeout(60)
def test_more_processes_than_gpus_stops_before_any_worker(tmp_path):
    """One process more than this machine's GPUs (none here: trainer.device=cuda finds none) is a config error."""
    proc = cli.run(["trainer.device=cuda", f"nproc={gpus.count() + 1}", f"run_dir={tmp_path}"], cwd=tmp_path,
                   check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.splitlines()
    visible = json.loads(os.environ[gpus.SAVED])  # this run sees the machine's GPUs (Note [tests on a GPU machine])
    assert line.startswith("config error: ") and ("CUDA_VISIBLE_DEVICES unset" if visible is None else
                                                  f"CUDA_VISIBLE_DEVICES={visible!r}") in line
    assert ("no CUDA device is visible" if gpus.count() == 0 else f"nproc={gpus.count() + 1}: ") in line
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "logs").exists()


def test_train_script_is_importable_without_running():
    sys.path.insert(0, str(cli.ROOT / "launch"))
    import importlib

    module = importlib.import_module("train")
    assert callable(module.main)
    assert Path(module.__file__).name == "train.py"


def _override(dotted: str, value) -> str | None:
    """A Hydra command-line override for one row of the validation table (None: no plain override for it)."""
    key = dotted.replace("__", ".")
    if isinstance(value, dict):
        return None
    if isinstance(value, bool):
        value = str(value).lower()
    elif isinstance(value, list):
        value = "[" + ",".join(map(str, value)) + "]"
    return f"{key}={value}"


def _table_rows():
    from tests.unit.test_validation import BAD

    rows = []
    for changes, world, key in BAD:
        overrides = [_override(k, v) for k, v in changes.items()]
        if None not in overrides:
            rows.append(pytest.param(overrides + [f"nproc={world}"], key, id=" ".join(overrides)))
    return rows


@pytest.mark.parametrize("overrides,key", _table_rows())
def test_every_row_of_the_validation_table_fails_cleanly_from_the_command_line(overrides, key, tmp_path,
                                                                              monkeypatch, capsys):
    """Each row of tests/unit/test_validation.BAD given as overrides to launch/train.py (in this process):
    exit status 2, one line naming the key, no traceback, nothing started."""
    import runpy

    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [cli.TRAIN, *overrides, "hydra.run.dir=run"])
    GlobalHydra.instance().clear()
    with pytest.raises(SystemExit) as info:
        runpy.run_path(cli.TRAIN, run_name="__main__")
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.startswith(f"config error: {key}"), err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(60)
def test_a_model_too_large_to_build_whole_on_this_host_is_one_line(tmp_path):
    """model.init=module (the default) builds the whole model once on the host at start: a 1.3 TB MLP there is
    one config line naming model.init=name, exit status 2, before any worker starts."""
    proc = cli.run(["model.args.hidden=400000", "model.args.depth=2", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path,
                   check=False)
    assert proc.returncode == 2, proc.stderr
    (only,) = proc.stderr.splitlines()
    assert only.startswith("config error: model.init='module': builds the whole model once in host memory at "
                           "start, 1.3 TB of tensors, and this host has "), only
    assert "model.init=name" in only and not (tmp_path / "run" / "metrics.jsonl").exists()
