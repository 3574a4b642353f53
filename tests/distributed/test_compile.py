"""trainer.compile=true (each repeated block compiled: Note [regional compilation] in parallel/strategies/compile.py)
trains to the numbers of the eager strategy=single, under the strategies that compile (and with recomputed
activations), without recompiling after the first step."""
import pytest

from tests import cli

GPT = ["model=gpt", "data.task=lm", "model.args.dim=32", "model.args.heads=4", "data.seq_len=16"]
# Context and expert parallelism compile too (trainer.compile under strategy=context or expert); their
# compiled runs (~20 s each here) are left out of the suite for its time.
CASES = {
    # Two microbatches of 16 accumulated: the shape a block of data_zero3 sees on each of its 2 ranks, and of
    # pipeline's microbatches, so that a case run after another finds that block compiled in the session's cache.
    "single": (1, ["strategy=single", "trainer.grad_accum=2"]),
    "single_recomputed": (1, ["strategy=single", "strategy.activations=checkpoint", "trainer.grad_accum=2"]),
    "data_zero3": (2, ["strategy=data", "strategy.zero=3"]),
    "model": (2, ["strategy=model"]),
    # 2 microbatches of 16 (4 of 8 by default), as above.
    "pipeline": (2, ["strategy=pipeline", "strategy.microbatches=2"]),
}


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(shared_dir):
    """One inductor cache for this session's compiled runs (its xdist workers too): the blocks of a case
    compile to the graphs another case compiled already, and a session starts from none of a previous one's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared_dir / "inductor"))
        yield


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_blocks_train_as_eager_single(reference, tmp_path, case):
    world, args = CASES[case]
    ref = reference(cli.FAST + GPT)  # the eager reference test_tensor_parallel's cases share
    compiled = tmp_path / "compiled"
    proc = cli.run(cli.FAST + GPT + args + [f"nproc={world}", "trainer.compile=true", f"run_dir={compiled}"],
                   cwd=tmp_path)
    cli.assert_same_training(compiled, ref)
    records = cli.metrics(compiled)
    # Compiled in the first step (from the cache when another case compiled the same graphs), logged once;
    # never again after it.
    assert records[0]["compiles"] >= 1 and records[0]["compile_time_s"] > 0, records[0]
    assert all(r["compiles"] == records[0]["compiles"] for r in records), [r["compiles"] for r in records]
    assert (proc.stdout + proc.stderr).count("compilations") == 1


def test_where_blocks_cannot_compile_the_run_stops_before_any_worker(tmp_path):
    proc = cli.run(GPT + ["strategy=offload", "trainer.compile=true", f"run_dir={tmp_path}"], cwd=tmp_path,
                   check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "trainer.compile=True" in proc.stderr and "strategy=offload" in proc.stderr, proc.stderr[-2000:]
