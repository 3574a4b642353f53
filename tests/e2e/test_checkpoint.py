"""Checkpoints from the command line: a run resumed under another strategy and world size continues as the
uninterrupted one; a truncated checkpoint is skipped; a worker killed under torchrun --max-restarts is
replaced and the run ends as a clean one; Ctrl-C leaves the last checkpoint loadable; bad resumes refused."""
import json
import os
import shutil
import signal
import time

import pytest
import torch

from tests import cli, parity

STEPS = 8
BASE = ["trainer.log_every=1", "trainer.progress=false", "trainer.save_final=true", "trainer.timeout_s=60",
        f"trainer.steps={STEPS}", "trainer.checkpoint_every=4"]
MODELS = {"mlp": [], "gpt": ["model=gpt", "data.task=lm", "model.args.tie_embeddings=true", "model.args.dim=32"]}


@pytest.fixture
def uninterrupted(reference):
    """The uninterrupted single-process run of each model (with its checkpoints at steps 4 and 8)."""
    return lambda model: reference(BASE + MODELS[model])


def by_step(run_dir) -> dict[int, float]:
    """The loss of each logged step (the last record of a step, should a run have logged it twice)."""
    return {r["step"]: r["loss"] for r in cli.metrics(run_dir)}


def assert_continues(run_dir, ref_dir, first: int) -> None:
    """`run_dir` logged steps first..STEPS with the reference's losses, and ended with its weights."""
    got, want = by_step(run_dir), by_step(ref_dir)
    assert sorted(got) == list(range(first, STEPS + 1)), sorted(got)
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64),
                               torch.tensor([want[s] for s in sorted(got)], dtype=torch.float64), rtol=1e-5, atol=0)
    parity.assert_same_weights(cli.final_weights(run_dir), cli.final_weights(ref_dir), parity.run_reach(ref_dir))


# (model, saved under, resumed under): every strategy saves and loads; world sizes 1, 2 and 4.
PAIRS = [
    ("mlp", "nproc=4 strategy=hybrid strategy.dp=2 strategy.pp=2", "strategy=single"),
    ("mlp", "nproc=2 strategy=data strategy.zero=3", "nproc=2 strategy=model"),
    ("mlp", "strategy=offload strategy.params=disk strategy.optimizer=disk", "nproc=2 strategy=data strategy.zero=1"),
    ("mlp", "strategy=single", "strategy=offload strategy.params=cpu strategy.optimizer=cpu"),
    ("gpt", "nproc=2 strategy=pipeline strategy.schedule=Interleaved1F1B", "nproc=2 strategy=data strategy.zero=2"),
    ("gpt", "strategy=single", "nproc=4 strategy=hybrid strategy.dp=1 strategy.pp=2 strategy.tp=2"),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model,saved,resumed", PAIRS, ids=[f"{m}:{a} -> {b}" for m, a, b in PAIRS])
def test_resume_under_another_strategy_continues_the_run(tmp_path, uninterrupted, model, saved, resumed):
    ref = uninterrupted(model)
    if saved == "strategy=single":
        first = ref
    else:
        first = tmp_path / "first"
        cli.run(BASE + MODELS[model] + saved.split() + [f"run_dir={first}"], cwd=tmp_path, timeout=300)
        assert_continues(first, ref, 1)  # the saving run is itself the reference run
    second = tmp_path / "second"
    cli.run(BASE + MODELS[model] + resumed.split() + [f"trainer.resume={first}/checkpoints/step-000004",
                                                      f"run_dir={second}"], cwd=tmp_path, timeout=300)
    assert_continues(second, ref, 5)
    meta = json.loads((second / "checkpoints" / "step-000008" / "trainer.json").read_text())
    assert meta["step"] == STEPS and meta["strategy"]["name"] == resumed.split("strategy=")[1].split()[0]


@pytest.mark.timeout(300)
def test_truncated_checkpoint_is_skipped_for_the_one_before(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted("mlp"), run_dir)
    newest = run_dir / "checkpoints" / "step-000008"
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # a copy cut short
    (run_dir / "checkpoints" / "step-000012.partial").mkdir()  # a writer that stopped midway
    proc = cli.run(BASE + [f"run_dir={run_dir}", "trainer.resume=auto"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "step-000008: " in out and "truncated" in out and "step-000012.partial: unfinished" in out
    assert "resumed from" in out and "step-000004" in out
    # metrics.jsonl reads as one run: the steps past 4 logged before are replaced, not repeated
    assert [r["step"] for r in cli.metrics(run_dir)] == list(range(1, STEPS + 1))
    assert_continues(run_dir, uninterrupted("mlp"), 1)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000004", "step-000008"]


@pytest.mark.timeout(300)
def test_killed_worker_is_restarted_from_the_last_checkpoint(tmp_path, monkeypatch):
    """SIGKILL of rank 1 in step 5 under torchrun --max-restarts=1: the agent restarts both workers, which
    resume from step 3 in the same run directory; losses and weights equal a run without the fault."""
    args = ["model=custom", "model._target_=tests.user_model.dies_once", "strategy=data",
            "trainer.log_every=1", "trainer.progress=false", "trainer.save_final=true", "trainer.timeout_s=60",
            f"trainer.steps={STEPS}", "trainer.checkpoint_every=3"]
    clean = tmp_path / "clean"
    cli.run(args + ["nproc=2", f"run_dir={clean}"], cwd=tmp_path)
    # Set after the clean run (restarts need it, the rendezvous store only): with it, a run of this process
    # starts a new interpreter instead of the zygote's child (tests/cli.py).
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as docs/checkpoints.md says for restarts
    faulty = tmp_path / "faulty"
    proc = cli.run(args + ["+model.args.die_at=5", f"run_dir={faulty}"], cwd=tmp_path, timeout=240,
                   launcher=cli.torchrun(2) + ["--max-restarts=1"])
    out = proc.stdout + proc.stderr
    # The killed worker's status, or (when its peer ended first: workers leave at once, Note [ending a worker])
    # the peer's line saying another worker failed, is what the agent reports before it restarts them.
    assert "exitcode: -9" in out or "stopped: another worker failed" in out, out[-3000:]
    assert "restart 1 of the workers" in out and "resumed from" in out and "step-000003" in out
    assert_continues(faulty, clean, 1)


def test_torchrun_restart_keeps_the_run_directory(tmp_path, monkeypatch):
    """Restarted torchrun workers go on in the directory of its first start, whatever their Hydra names now
    (a dated default names another second); that directory, still empty, is removed."""
    import torch.distributed as dist

    from parallel.launcher import _agree_on_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    first, later, other = (tmp_path / name for name in ("07-00-00", "07-00-05", "07-00-09"))
    for d in (first, later, other):
        d.mkdir()  # as each start's Hydra makes them
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert _agree_on_run_dir(None, {}, str(first)) == str(first)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        assert _agree_on_run_dir(None, {}, str(later)) == str(first)
        assert not later.exists()
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # another torchrun run: its own directory
        assert _agree_on_run_dir(None, {}, str(other)) == str(other)
        assert first.exists() and (first / ".hydra" / "config.yaml").exists()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
def test_ctrl_c_stops_every_worker_and_keeps_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = cli.start(["nproc=2", "strategy=data", "trainer.steps=1000000", "trainer.log_every=50",
                      "trainer.checkpoint_every=5", "trainer.progress=false", f"run_dir={run_dir}"], cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not (run_dir / "checkpoints" / "step-000010").exists():
            assert proc.poll() is None and time.time() < deadline, "no checkpoint written"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does: the whole process group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err and "interrupted" in err
    from parallel.checkpoint import newest_complete

    newest, _ = newest_complete(run_dir)
    assert newest is not None
    step = int(newest.name.split("-")[1])
    after = tmp_path / "after"  # it loads: the run goes on from it
    cli.run(["nproc=2", "strategy=data", f"trainer.steps={step + 2}", "trainer.log_every=1",
             "trainer.progress=false", f"trainer.resume={run_dir}", f"run_dir={after}"], cwd=tmp_path)
    assert [r["step"] for r in cli.metrics(after)] == [step + 1, step + 2]


# Bad resumes: (overrides, text the one-line error must hold). `REF` is replaced by the reference run.
BAD_RESUME = [
    (["trainer.resume=REF/checkpoints/step-000004", "model=gpt", "data.task=lm"], "saved from another model"),
    (["trainer.resume=REF/checkpoints/step-000004", "model.args.hidden=48"], "shapes differ"),
    (["trainer.resume=REF", "trainer.steps=8"], "nothing left to train"),
    (["trainer.resume=REF/checkpoints/step-000099"], "no such directory"),
    (["trainer.resume=REF/metrics.jsonl"], "not a directory"),
    (["trainer.resume=REF/tensorboard"], "no complete checkpoint"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,text", BAD_RESUME, ids=[" ".join(a) for a, _ in BAD_RESUME])
def test_bad_resume_exits_cleanly_naming_the_key(tmp_path, uninterrupted, args, text):
    ref = str(uninterrupted("mlp"))
    args = [a.replace("REF", ref) for a in args]
    proc = cli.run(["trainer.progress=false", f"run_dir={tmp_path / 'run'}", *args], cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "trainer.resume=" in out and text in out, out[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
