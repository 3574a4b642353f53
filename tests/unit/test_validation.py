"""Cross-field rules: each bad input names its key and fails before any worker starts."""
import pytest

from parallel.config import Config, ConfigError, StrategyConfig
from parallel.dims import Gpus, ParallelDims, check_gpus
from parallel.units import parse_bytes
from parallel.validate import validate


def cfg_with(**changes) -> Config:
    cfg = Config()
    cfg.model.args = {"in_features": 32, "out_features": 4}
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


# (changes, world size, the key the message must name)
BAD = [
    ({"trainer__steps": -1}, 1, "trainer.steps"),
    ({"trainer__steps": 0}, 1, "trainer.steps"),
    ({"trainer__batch_size": 0}, 1, "trainer.batch_size"),
    ({"trainer__log_every": 0}, 1, "trainer.log_every"),
    ({"trainer__grad_accum": 3}, 1, "trainer.grad_accum"),
    ({"trainer__clip_grad_norm": -1.0}, 1, "trainer.clip_grad_norm"),
    ({"trainer__device": "tpu"}, 1, "trainer.device"),
    ({"trainer__precision": "fp8"}, 1, "trainer.precision"),
    ({"trainer__timeout_s": 0.0}, 1, "trainer.timeout_s"),
    ({"trainer__init_timeout_s": 120.0}, 1, "trainer.init_timeout_s"),  # below trainer.timeout_s (300)
    ({"trainer__nonfinite": "ignore"}, 1, "trainer.nonfinite"),
    ({"trainer__nonfinite_limit": 0}, 1, "trainer.nonfinite_limit"),
    ({"trainer__peak_flops": 0.0}, 1, "trainer.peak_flops"),
    ({"trainer__peak_flops": -312e12}, 1, "trainer.peak_flops"),
    ({"trainer__peak_flops": float("inf")}, 1, "trainer.peak_flops"),
    ({"trainer__preempt_timeout_s": 0.0}, 1, "trainer.preempt_timeout_s"),
    ({"trainer__preempt_timeout_s": -30.0}, 1, "trainer.preempt_timeout_s"),
    ({"trainer__preempt_check_s": -0.1}, 1, "trainer.preempt_check_s"),
    ({"trainer__reduce_precision": "fp16"}, 1, "trainer.reduce_precision"),
    ({"trainer__profile": [3, 2]}, 1, "trainer.profile"),  # reversed
    ({"trainer__profile": [0, 2]}, 1, "trainer.profile"),  # steps count from 1
    ({"trainer__profile": [40, 51]}, 1, "trainer.profile"),  # past trainer.steps (50)
    ({"trainer__profile": [1, 2, 3]}, 1, "trainer.profile"),  # not two steps
    ({"strategy__name": "magic"}, 1, "strategy.name"),
    ({"strategy__name": "data", "strategy__zero": 4}, 2, "strategy.zero"),
    ({"strategy__name": "single"}, 2, "strategy"),
    ({"strategy__name": "single", "strategy__zero": 3}, 1, "strategy.zero"),
    ({"strategy__name": "data", "strategy__activations": "disk"}, 2, "strategy.activations"),
    ({"strategy__name": "pipeline", "strategy__activations": "sometimes"}, 2, "strategy.activations"),
    ({"strategy__activations": "selective", "strategy__selective": "0"}, 1, "strategy.selective"),
    ({"strategy__activations": "selective", "strategy__selective": "-2"}, 1, "strategy.selective"),
    ({"strategy__activations": "selective", "strategy__selective": "every"}, 1, "strategy.selective"),
    ({"strategy__name": "data", "strategy__selective": "2"}, 2, "strategy.selective"),  # without activations=selective
    ({"strategy__name": "offload", "strategy__activations": "selective"}, 1, "strategy.activations"),
    ({"strategy__name": "offload", "strategy__selective": "2"}, 1, "strategy.selective"),  # offload: no selective
    ({"trainer__compile": True, "strategy__activations": "selective"}, 1, "trainer.compile"),  # op: eager only
    ({"strategy__name": "expert", "strategy__activations": "selective"}, 2, "strategy.selective"),  # op: no ep
    ({"data__name": "parquet"}, 1, "data.name"),
    ({"strategy__name": "data", "trainer__batch_size": 33}, 2, "trainer.batch_size"),
    ({"strategy__name": "data", "strategy__dp": 3}, 2, "strategy.dp"),
    ({"strategy__name": "hybrid", "strategy__dp": 2, "strategy__pp": 2, "strategy__tp": 2}, 4, "strategy=hybrid"),
    ({"strategy__name": "hybrid", "strategy__pp": 3, "strategy__tp": 1}, 4, "strategy.dp"),  # cannot derive
    ({"strategy__name": "hybrid", "strategy__dp": 2}, 8, "strategy.pp"),  # pp x tp = 4: which?
    ({"strategy__name": "hybrid", "strategy__tp": 1, "strategy__tp_plan": ["inp:colwise"]}, 2, "strategy.tp_plan"),
    ({"strategy__name": "hybrid", "strategy__sequence_parallel": True}, 2, "strategy.sequence_parallel"),
    # Note [loss parallelism]: tp splitting the head, the built-in cross-entropy, no pipeline
    ({"strategy__name": "hybrid", "strategy__loss_parallel": True}, 2, "strategy.loss_parallel"),  # tp 1
    ({"strategy__name": "model", "strategy__loss_parallel": True}, 2, "strategy.loss_parallel"),  # mse
    ({"strategy__name": "model", "strategy__loss_parallel": True, "model__name": "gpt", "data__task": "lm",
      "loss__args": {"label_smoothing": 0.1}}, 2, "strategy.loss_parallel"),
    ({"strategy__name": "hybrid", "strategy__loss_parallel": True, "strategy__pp": 2, "strategy__tp": 2,
      "model__name": "gpt", "data__task": "lm"}, 4, "strategy.loss_parallel"),
    ({"strategy__name": "hybrid", "strategy__tp": 3}, 3, "strategy.tp"),  # hidden 64 over tp 3
    ({"strategy__name": "hybrid", "strategy__pp": 2, "strategy__microbatches": 3}, 4, "strategy.microbatches"),
    ({"strategy__name": "model", "strategy__zero": 2}, 2, "strategy.zero"),
    # Hybrid sharding (Note [hybrid sharding]): replicas of a sharded group, dividing dp.
    ({"strategy__name": "data", "strategy__zero": 3, "strategy__dp_replicate": 3}, 4, "strategy.dp_replicate"),
    ({"strategy__name": "data", "strategy__zero": 3, "strategy__dp_replicate": 0}, 4, "strategy.dp_replicate"),
    ({"strategy__name": "data", "strategy__zero": 1, "strategy__dp_replicate": 2}, 4, "strategy.dp_replicate"),
    ({"strategy__name": "hybrid", "strategy__zero": 3, "strategy__dp": 2, "strategy__tp": 2,
      "strategy__dp_replicate": 4}, 4, "strategy.dp_replicate"),  # more than dp
    ({"strategy__name": "single", "strategy__sync_batchnorm": True}, 1, "strategy.sync_batchnorm"),  # no dp ranks
    ({"strategy__name": "data", "strategy__sync_batchnorm": True}, 2, "strategy.sync_batchnorm"),  # no BatchNorm
    ({"strategy__name": "offload"}, 2, "strategy"),  # one process only
    ({"strategy__name": "offload", "strategy__params": "ssd"}, 1, "strategy.params"),
    ({"strategy__name": "offload", "strategy__activations": "gpu"}, 1, "strategy.activations"),
    ({"strategy__name": "offload", "strategy__prefetch": -1}, 1, "strategy.prefetch"),
    ({"strategy__name": "offload", "trainer__grad_accum": 2}, 1, "trainer.grad_accum"),
    ({"strategy__name": "offload", "strategy__path": __file__ + "/offload"}, 1, "strategy.path"),  # under a file
    ({"model__name": "stacked", "model__frozen_checkpoint": "/no/such/file.pt"}, 1, "model.frozen_checkpoint"),
    ({"model__freeze": ["blocks.0.*", "nope.*"]}, 1, "model.freeze"),  # a pattern matching nothing
    ({"model__freeze": ["*.weight", "*.bias"]}, 1, "model.freeze"),  # nothing left to train
    ({"data__task": "vision"}, 1, "data.task"),
    ({"model__name": "gpt", "model__args": {"vocab_size": 64, "seq_len": 32}}, 1, "data.task"),  # takes token ids
    ({"data__features": -3}, 1, "data.features"),
    ({"trainer__checkpoint_every": -1}, 1, "trainer.checkpoint_every"),
    ({"trainer__keep_checkpoints": 0}, 1, "trainer.keep_checkpoints"),
    ({"trainer__resume": "/no/such/run"}, 1, "trainer.resume"),
    ({"trainer__resume": __file__}, 1, "trainer.resume"),  # a file, not a run or checkpoint directory
    ({"optim__lr": 0.0}, 1, "optim.lr"),
    ({"optim__betas": [0.9]}, 1, "optim.betas"),
    ({"optim__schedule": "warmup"}, 1, "optim.schedule"),
    ({"optim___target_": "torch.nn.Linear"}, 1, "optim._target_"),  # not an Optimizer
    ({"optim___target_": "torch.optim.NoSuchThing"}, 1, "optim._target_"),
    ({"optim___target_": "torch.optim.SGD", "optim__args": {"momentun": 0.9}}, 1, "optim.args"),  # a typo
    ({"optim___target_": "torch.optim.SGD", "optim__args": {"momentum": -1.0}}, 1, "optim.args"),  # SGD refuses it
    ({"optim___target_": "torch.optim.SGD", "optim__args": {"lr": 0.1}}, 1, "optim.args.lr"),  # optim.lr's
    ({"optim___target_": "torch.optim.SparseAdam"}, 1, "optim.weight_decay"),  # takes none
    ({"strategy__name": "offload", "optim___target_": "torch.optim.Adam"}, 1, "optim._target_"),
    ({"strategy__name": "offload", "optim___target_": "torch.optim.SGD", "optim__args": {"maximize": True}}, 1,
     "optim.args"),
    ({"optim__no_decay": ["bias", "nope"]}, 1, "optim.no_decay"),  # a pattern matching nothing
    ({"optim__lr_scale": ["inp.*:fast"]}, 1, "optim.lr_scale"),
    ({"optim__lr_scale": ["nope.*:2"]}, 1, "optim.lr_scale"),
    ({"optim__schedule": "wsd", "optim__decay_steps": 51}, 1, "optim.decay_steps"),  # longer than the run
    ({"optim__decay_fraction": 0.0}, 1, "optim.decay_fraction"),
    ({"optim__name": "sgd"}, 1, "optim.name"),
    ({"optim__weight_decay": -0.1}, 1, "optim.weight_decay"),
    ({"optim__warmup_steps": -1}, 1, "optim.warmup_steps"),
    ({"optim__min_lr_ratio": 1.5}, 1, "optim.min_lr_ratio"),
    ({"data__noise": -1.0}, 1, "data.noise"),
    ({"data__vocab_size": 0}, 1, "data.vocab_size"),
    ({"trainer__seed": -1}, 1, "trainer.seed"),
    ({"strategy__name": "data", "strategy__balance": "luck"}, 2, "strategy.balance"),
    ({"strategy__name": "pipeline", "strategy__schedule": "2F2B"}, 2, "strategy.schedule"),
    ({"strategy__name": "pipeline", "strategy__stages_per_rank": 0}, 2, "strategy.stages_per_rank"),
    ({"strategy__name": "pipeline", "strategy__split_points": ["nope"]}, 2, "strategy.split_points"),
    ({"memory__budget": "lots"}, 1, "memory.budget"),
    ({"memory__fraction": 1.5}, 1, "memory.fraction"),
    ({"model__name": "resnet9000"}, 1, "model.name"),
    ({"model___target_": "no.such.module.fn"}, 1, "model._target_"),
    ({"model___target_": "tests.user_model.not_a_module", "model__name": "custom",
      "model__args": {}}, 1, "model._target_"),
    ({"model___target_": "tests.user_model.two_tower", "model__args": {"in_features": 32}}, 1, "model.args"),
    ({"model___target_": "tests.user_model.no_rule", "model__name": "custom", "model__args": {}, "model__init": "name"},
     1, "model.init"),
    ({"model__init": "random"}, 1, "model.init"),
    ({"model__name": "hf"}, 1, "model.path"),  # no directory given
    ({"model__name": "hf", "model__path": "/no/such/dir"}, 1, "model.path"),  # no config.json there
    ({"model__weights": "/no/such/weights.safetensors"}, 1, "model.weights"),
]


@pytest.mark.parametrize("changes,world,key", BAD, ids=[b[2] + ":" + str(list(b[0].values())) for b in BAD])
def test_bad_input_names_the_key(changes, world, key):
    cfg = cfg_with(**changes)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world)
    assert str(info.value).startswith(key), str(info.value)


def test_good_config_passes():
    validate(cfg_with(), 1)
    validate(cfg_with(strategy__name="data", strategy__zero=3), 4)
    validate(cfg_with(strategy__name="data", strategy__zero=2, strategy__dp_replicate=2), 4)
    validate(cfg_with(strategy__name="data", strategy__dp_replicate=1), 4)  # 1: one group, at any zero level


def test_replicas_at_zero_0_and_1_say_what_the_level_holds():
    """Note [hybrid sharding]: zero 0 and 1 have no sharded group to replicate; the line says why."""
    for zero, why in ((0, "zero 0 holds every weight whole on every rank"),
                      (1, "zero 1 shards the optimizer state alone, over every dp rank")):
        with pytest.raises(ConfigError, match=why):
            validate(cfg_with(strategy__name="data", strategy__zero=zero, strategy__dp_replicate=2), 4)


def test_user_model_with_own_init_rule_passes():
    validate(cfg_with(model___target_="tests.user_model.Custom", model__name="custom", model__args={}), 1)


def test_degrees_message_shows_the_arithmetic():
    with pytest.raises(ConfigError, match=r"dp 3 x ep 1 x pp 1 x cp 1 x tp 1 = 3 != world size 4"):
        ParallelDims.from_config(StrategyConfig(name="data", dp=3), 4)
    with pytest.raises(ConfigError, match=r"dp 2 x ep 1 x pp 2 x cp 1 x tp 2 = 8 != world size 4"):
        ParallelDims.from_config(StrategyConfig(name="hybrid", dp=2, pp=2, tp=2), 4)


def test_degrees_message_shows_all_five_dimensions():
    with pytest.raises(ConfigError, match=r"strategy=hybrid: .*dp 2 x ep 1 x pp 1 x cp 2 x tp 1 = 4 != world size 8"):
        ParallelDims.from_config(StrategyConfig(name="hybrid", dp=2, cp=2, pp=1, tp=1), 8)
    with pytest.raises(ConfigError, match=r"strategy.cp=3: .*dp 1 x ep 1 x pp 1 x cp 3 x tp 1 = 3 != world size 4"):
        ParallelDims.from_config(StrategyConfig(name="context", cp=3), 4)
    with pytest.raises(ConfigError, match=r"strategy.tp=2: strategy=context does not use a tp dimension"):
        ParallelDims.from_config(StrategyConfig(name="context", tp=2), 4)


@pytest.mark.parametrize("name,given,derived", [
    ("context", dict(), dict(cp=4, dp=1)),  # context spreads over cp alone
    ("hybrid", dict(dp=2, cp=2), dict(dp=2, cp=2, pp=1, tp=1, ep=1)),  # dp x cp make the world: pp = tp = 1
    ("hybrid", dict(cp=2), dict(dp=2, cp=2)),  # dp takes what cp leaves
    ("hybrid", dict(cp=2, tp=2), dict(dp=1, cp=2, tp=2)),
])
def test_cp_degrees_derive(name, given, derived):
    dims = ParallelDims.from_config(StrategyConfig(name=name, **given), 4)
    assert {k: getattr(dims, k) for k in derived} == derived


def test_mesh_order_and_planner_roles():
    from parallel.planning.planner import roles

    dims = ParallelDims(dp=2, pp=2, tp=1, cp=2, ep=1, world_size=8)
    assert dims.names == ("dp", "ep", "pp", "cp", "tp") and dims.shape == (2, 1, 2, 2, 1)
    # mesh order dp, ep, pp, cp, tp: pp stage 0 holds the ranks whose pp coordinate is 0
    assert roles(dims) == [(0, [0, 1, 4, 5]), (2, [2, 3, 6, 7])]
    assert roles(ParallelDims(dp=2, pp=2, tp=2, world_size=8)) == [(0, [0, 1, 4, 5]), (2, [2, 3, 6, 7])]


@pytest.mark.parametrize("dims", [ParallelDims(dp=4, pp=1, tp=1, world_size=4),
                                  ParallelDims(dp=2, pp=1, tp=1, cp=2, world_size=4)], ids=["dp4", "dp2_cp2"])
def test_hybrid_sharding_groups_are_consecutive_ranks(dims):
    """Note [hybrid sharding]: the dense weights' 4 data-parallel ranks (dp, or dp x cp) as 2 groups of 2
    consecutive ranks, (dp_replicate, dp_shard); rank 1 shards with rank 0 and replicates with rank 3."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel.dims import fsdp_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh = fsdp_mesh(dims.build_mesh("cpu"), 2)
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard") and mesh.mesh.tolist() == [[0, 1], [2, 3]]
        assert dist.get_process_group_ranks(mesh["dp_shard"].get_group()) == [0, 1]
        assert dist.get_process_group_ranks(mesh["dp_replicate"].get_group()) == [1, 3]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("given,derived", [
    (dict(), (8, 1, 1)),  # all unset: dp takes the world
    (dict(tp=2), (4, 1, 2)),
    (dict(dp=2, tp=2), (2, 2, 2)),  # the one unset degree takes the rest
    (dict(dp=2, pp=4), (2, 4, 1)),
    (dict(dp=8), (8, 1, 1)),
])
def test_hybrid_derives_unset_degrees(given, derived):
    dims = ParallelDims.from_config(StrategyConfig(name="hybrid", **given), 8)
    assert (dims.dp, dims.pp, dims.tp) == derived


@pytest.mark.parametrize("text,value", [("512MB", 512 * 10**6), ("1.5GiB", int(1.5 * 2**30)),
                                        ("1000", 1000), ("80gb", 80 * 10**9)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_disk_check_names_the_bytes_needed(tmp_path):
    from parallel.strategies.offload.tiers import check_disk

    assert check_disk(tmp_path / "new" / "dir", 1) is None
    why = check_disk(tmp_path, 10**18)
    assert "1000000.0 TB needed" in why and "free at" in why  # parallel.units.human_bytes


ONE_GPU = Gpus(count=1, visible=None)  # what a machine with one GPU shows (injected: this one may have none)


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_processes_than_gpus_is_a_config_error_naming_the_fix(device):
    with pytest.raises(ConfigError) as info:
        check_gpus(device, 2, gpus=ONE_GPU)
    message = str(info.value)
    assert "\n" not in message and message.startswith("nproc=2: 2 processes")
    assert f"trainer.device={device}" in message and "1 GPU is visible (CUDA_VISIBLE_DEVICES unset)" in message
    assert "nproc=1" in message and "trainer.device=cpu" in message and "more GPUs" in message  # the fixes
    torchrun = r"LOCAL_WORLD_SIZE=4: .*2 GPUs are visible \(CUDA_VISIBLE_DEVICES='0,1'\).*--nproc-per-node 2"
    with pytest.raises(ConfigError, match=torchrun):
        check_gpus(device, 4, "torchrun", Gpus(count=2, visible="0,1"))


def test_processes_within_the_gpus_or_on_the_cpu_pass():
    check_gpus("cuda", 1, gpus=ONE_GPU)
    check_gpus("auto", 1, gpus=ONE_GPU)
    check_gpus("cpu", 8, gpus=ONE_GPU)
    check_gpus("auto", 8, gpus=Gpus(count=0, visible=""))  # no GPU: auto is the CPU
    check_gpus("cuda", None, "torchrun", ONE_GPU)  # a launcher that says nothing of its local processes
    with pytest.raises(ConfigError, match=r"trainer.device='cuda': no CUDA device is visible here "
                                          r"\(CUDA_VISIBLE_DEVICES=''"):
        check_gpus("cuda", 1, gpus=Gpus(count=0, visible=""))
