"""strategy.activations=checkpoint (blocks recomputed in backward) and selective (the products' outputs saved, the
rest recomputed; or every N-th block recomputed) under every strategy: the training of single without it, in less
memory, planned to the byte."""
import pytest
from omegaconf import OmegaConf

from parallel.planning.planner import plan
from parallel.validate import to_config, validate
from tests import cli

# Activations dominate at this batch, so recomputing them shows in the measured peak.
BIG = ["trainer.batch_size=512"]

CASES = {
    "single": (1, ["strategy=single"]),
    "data_zero3": (2, ["strategy=data", "strategy.zero=3"]),
    "pipeline": (2, ["strategy=pipeline"]),
    "hybrid_dp_tp_zero3": (4, ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.zero=3"]),
}


@pytest.fixture
def single(reference):
    return reference(cli.FAST + BIG)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_recomputed_activations_train_as_single_in_less_memory(single, tmp_path, case):
    world, args = CASES[case]
    recomputed = tmp_path / "recomputed"
    common = cli.FAST + BIG + args + [f"nproc={world}"]
    cli.run(common + ["strategy.activations=checkpoint", f"run_dir={recomputed}"], cwd=tmp_path)
    cli.assert_same_training(recomputed, single)
    if case not in ("single", "data_zero3"):
        return
    # Less memory than the same run keeping its activations (single: the reference run itself).
    plain = single
    if case != "single":
        plain = tmp_path / "plain"
        cli.run(common + [f"run_dir={plain}"], cwd=tmp_path)
    less = cli.metrics(recomputed)[-1]["mem_peak_bytes_per_rank"]
    more = cli.metrics(plain)[-1]["mem_peak_bytes_per_rank"]
    assert all(a < b for a, b in zip(less, more)), (less, more)


# The gpt whose eager single run test_compile's and test_tensor_parallel's cases share: attention, norms, GELU.
GPT = ["model=gpt", "data.task=lm", "model.args.dim=32", "model.args.heads=4", "data.seq_len=16"]
SELECTIVE = {
    "single_op": (1, {"name": "single"}, "op"),
    "single_2": (1, {"name": "single"}, "2"),
    "single_op_alternate": (1, {"name": "single"}, "op_alternate"),
    "data_zero3_op": (2, {"name": "data", "zero": 3}, "op"),
    "data_zero3_2": (2, {"name": "data", "zero": 3}, "2"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(SELECTIVE))
def test_selective_recomputation_trains_as_single_in_the_planned_bytes(reference, tmp_path, case):
    """The losses and weights of single without recomputation; each rank's measured peak is its plan's, to the
    byte, and below the reference's (parallel.strategies.recompute, Note [selective recomputation])."""
    world, strategy, selective = SELECTIVE[case]
    ref = reference(cli.FAST + GPT)
    args = [f"strategy={strategy['name']}", *(f"strategy.{k}={v}" for k, v in strategy.items() if k != "name")]
    cli.run(cli.FAST + GPT + args + [f"nproc={world}", "strategy.activations=selective",
                                     f"strategy.selective={selective}", f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, ref)
    measured = cli.metrics(tmp_path)[-1]["mem_peak_bytes_per_rank"]
    assert max(measured) < cli.metrics(ref)[-1]["mem_peak_bytes"], measured
    cfg = to_config(OmegaConf.to_container(OmegaConf.load(tmp_path / ".hydra" / "config.yaml")))  # the run's own
    validate(cfg, world)
    (role,) = plan(cfg, world)  # in this process, on fake tensors
    assert [role.total] * world == measured
    if selective == "op_alternate":  # half the products' outputs recomputed: less than op keeps
        cfg.strategy.selective = "op"
        (op,) = plan(cfg, world)
        assert role.total < op.total and role.flops > op.flops, (role.total, op.total, role.flops, op.flops)


@pytest.mark.parametrize("args,message", [
    (["strategy=data", "nproc=2", "strategy.activations=cpu"],
     "strategy.activations='cpu': strategy=data keeps activations on the device or recomputes them"),
    (["strategy.activations=selective", "strategy.selective=0"], "strategy.selective='0': op (the products'"),
    (["strategy.selective=op_alternate"], "strategy.selective='op_alternate': chooses what "
                                          "strategy.activations=selective recomputes"),
    (["strategy=offload", "strategy.activations=selective"], "strategy.activations='selective': strategy=offload "
                                                             "streams the activations it saves to its own tiers"),
])
def test_tiers_below_the_device_are_offloads_own_and_selective_is_the_devices(tmp_path, args, message):
    proc = cli.run(args + [f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"config error: {message}" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
