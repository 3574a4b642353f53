"""The optimizer from config (Note [optimizer]): its class and arguments, parameter groups by name, and the
state a checkpoint holds for any optimizer."""
import pytest
import torch
from torch import nn

from parallel.config import Config, ConfigError, OptimConfig
from parallel.optim import (
    build_optimizer,
    check_optimizer,
    matches,
    optimizer_kwargs,
    param_state,
    state_per_weight,
    state_shapes,
)
from parallel.planning.planner import plan
from parallel.strategies.pipeline.partition import BlockCost, held_shares, stage_memory
from parallel.validate import validate


@pytest.mark.parametrize("name,pattern,hit", [
    ("blocks.0.attn.bias", "bias", True),
    ("blocks.0.attn.bias", "attn.*", True),
    ("blocks.0.ln_1.weight", "*norm*", False),
    ("blocks.0.layernorm.weight", "*norm*", True),
    ("head.weight", "head.*", True),
    ("blocks.0.head_bias", "bias", False),  # a whole part after a dot, not any ending
])
def test_patterns_match_the_name_or_its_end_after_a_dot(name, pattern, hit):
    assert matches(name, pattern) is hit


def test_kwargs_take_lr_and_weight_decay_from_their_keys_and_betas_only_where_taken():
    o = OptimConfig(lr=0.1, weight_decay=0.02, args={"momentum": 0.9})
    assert optimizer_kwargs(o, torch.optim.SGD) == {"lr": 0.1, "weight_decay": 0.02, "momentum": 0.9}
    o = OptimConfig(lr=0.1, betas=[0.8, 0.9], eps=1e-6, args={"amsgrad": True})
    assert optimizer_kwargs(o, torch.optim.Adam) == {"lr": 0.1, "weight_decay": 0.01, "betas": (0.8, 0.9),
                                                     "eps": 1e-6, "amsgrad": True}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)


def test_groups_by_name_pattern():
    cfg = Config()
    cfg.optim._target_ = "torch.optim.SGD"
    cfg.optim.lr, cfg.optim.weight_decay = 0.1, 0.01
    cfg.optim.no_decay, cfg.optim.lr_scale = ["bias", "norm.*"], ["head.*:0.5"]
    model = Net()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(model, names, cfg.optim)
    got = {names[id(p)]: (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    assert got == {"inp.weight": (0.1, 0.01), "inp.bias": (0.1, 0.0), "norm.weight": (0.1, 0.0),
                   "norm.bias": (0.1, 0.0), "head.weight": (0.05, 0.01), "head.bias": (0.05, 0.0)}


def test_default_is_adamw_in_one_group():
    model = Net()
    opt = build_optimizer(model, {}, Config().optim)
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1
    assert opt.param_groups[0]["params"] == list(model.parameters())


@pytest.mark.parametrize("target,args", [
    ("torch.optim.AdamW", {}), ("torch.optim.SGD", {"momentum": 0.9, "dampening": 0.1}), ("torch.optim.SGD", {}),
    ("torch.optim.Adam", {"amsgrad": True}), ("torch.optim.RMSprop", {"momentum": 0.5}),
])
def test_state_made_before_the_first_step_is_the_optimizers_own_layout(target, args):
    """What a checkpoint load fills in place: the keys and shapes the optimizer's own step makes, made
    without moving a weight; the meta-device prediction the resume check uses agrees."""
    cfg = Config()
    cfg.optim._target_, cfg.optim.args = target, args
    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, {}, cfg.optim)
    made = param_state(opt, list(model.parameters()))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    twin = Net()
    real = build_optimizer(twin, {}, cfg.optim)
    for p in twin.parameters():
        p.grad = torch.ones_like(p)
    real.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        want = {k: v.shape for k, v in real.state[q].items() if torch.is_tensor(v)}
        assert {k: v.shape for k, v in made[p].items()} == want
    with torch.device("meta"):
        meta = Net()
    shapes = state_shapes(cfg, meta)
    assert shapes == {n: {k: tuple(v.shape) for k, v in made[p].items()} for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy,world", [("single", 1), ("data", 2)])
def test_planner_counts_the_chosen_optimizers_state(strategy, world):
    """SGD with momentum holds one buffer per weight, without momentum none, Adam two (and a step counter per
    parameter); ZeRO-1 shares them over the data-parallel ranks."""
    got = {}
    for name, target, args in (("sgd", "torch.optim.SGD", {"momentum": 0.9}), ("plain", "torch.optim.SGD", {}),
                               ("adam", "torch.optim.Adam", {})):
        cfg = Config()
        cfg.optim._target_, cfg.optim.args, cfg.strategy.name = target, args, strategy
        cfg.strategy.zero = 1 if strategy == "data" else 0
        validate(cfg, world)
        got[name] = plan(cfg, world)[0]
    params = got["sgd"].params
    assert got["plain"].optimizer == 0
    if strategy == "single":
        tensors = 2 * (2 + 4)  # weight and bias of the input, 4 blocks and the head (model=mlp)
        assert got["sgd"].optimizer == params
        assert got["adam"].optimizer == 2 * params + 4 * tensors  # the moments, and a float32 step each
    else:  # ZeRO-1 gives each rank whole tensors, about half of them
        assert got["sgd"].optimizer == pytest.approx(params / 2, rel=0.1)
        assert got["adam"].optimizer == pytest.approx(params, rel=0.1)


class SignSGD(torch.optim.Optimizer):
    """A user's own optimizer (reached as tests.unit.test_optim.SignSGD): steps by the gradient's sign."""

    def __init__(self, params, lr: float = 0.01, weight_decay: float = 0.0, scale: float = 1.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, scale=scale))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.mul_(1 - g["lr"] * g["weight_decay"]).add_(p.grad.sign(), alpha=-g["lr"] * g["scale"])


def test_a_users_optimizer_class_with_its_arguments():
    cfg = Config()
    cfg.optim._target_, cfg.optim.args, cfg.optim.no_decay = "tests.unit.test_optim.SignSGD", {"scale": 2.0}, ["bias"]
    check_optimizer(cfg, Net())
    model = Net()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(model, names, cfg.optim)
    assert type(opt) is SignSGD and {g["scale"] for g in opt.param_groups} == {2.0}
    cfg.optim.args = {"scael": 2.0}
    with pytest.raises(ConfigError, match=r"optim\.args.*scael.*valid: \['scale'\]"):
        check_optimizer(cfg, Net())


@pytest.mark.parametrize("target,args,state", [
    (None, {}, 2.0), ("torch.optim.SGD", {"momentum": 0.9}, 1.0), ("torch.optim.SGD", {}, 0.0),
    ("torch.optim.Adam", {"amsgrad": True}, 3.0),
])
def test_state_per_weight_the_pipeline_balancer_counts(target, args, state):
    cfg = Config()
    cfg.optim._target_, cfg.optim.args = target, args
    assert state_per_weight(cfg) == state
    block = BlockCost(name="b", params=10, param_bytes=40, act_bytes=8)
    assert stage_memory([block], in_flight=2, state=state) == (2 + state) * 40 + 2 * 8
    # ZeRO over 4 ranks: the state from zero 1, the gradients from 2, the weights at 3 held a quarter each
    for zero, held in ((1, 2 + state / 4), (2, 1 + 1 / 4 + state / 4), (3, (2 + state) / 4)):
        assert stage_memory([block], 2, state, held_shares(zero, 4)) == int(held * 40) + 2 * 8


def _zero1_worker(rank: int, world: int, store_path: str, bucket: int) -> None:
    """Two ranks step AdamW with ZeRO 1 over weights of mixed sizes and dtypes, in buckets of `bucket` bytes:
    each ends with the weights of an unsharded AdamW stepping the same gradients."""
    import torch.distributed as dist

    import parallel.optim as optim_module
    from parallel.optim import ShardedOptimizer, StateSharding

    optim_module.BROADCAST_BUCKET = bucket
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    calls = []
    broadcast = dist.broadcast
    dist.broadcast = lambda t, *a, **k: (calls.append(t.nbytes), broadcast(t, *a, **k))[1]
    try:
        g = torch.Generator().manual_seed(0)
        shapes = [(40, 30), (7,), (300,), (16, 16), (5, 5), (1000,)]
        weights = [torch.randn(s, generator=g, dtype=torch.float64 if i == 3 else torch.float32) for i, s in
                   enumerate(shapes)]
        grads = [[torch.randn(w.shape, generator=g, dtype=w.dtype) for w in weights] for _ in range(3)]
        mine = [nn.Parameter(w.clone()) for w in weights]
        plain = [nn.Parameter(w.clone()) for w in weights]
        sharded = ShardedOptimizer([{"params": mine}], torch.optim.AdamW, {"lr": 0.1}, StateSharding(dist.group.WORLD))
        reference = torch.optim.AdamW(plain, lr=0.1)
        for step in grads:
            for p, q, grad in zip(mine, plain, step):
                p.grad, q.grad = grad.clone(), grad.clone()
            sharded.step()
            reference.step()
        for p, q in zip(mine, plain):
            torch.testing.assert_close(p.data, q.data, rtol=0, atol=0)
        held = sum(len(s) for s in sharded.optim.state.values())
        assert 0 < held < 3 * len(weights)  # this rank's share of the state
        assert sum(calls) == 3 * sum(w.nbytes for w in weights)  # every weight broadcast once a step
        if bucket < 1 << 20:  # small buckets: more calls than owners x dtypes, none above the bucket but a lone weight
            assert len(calls) > 3 * 4 and all(n <= bucket or n in {w.nbytes for w in weights} for n in calls)
        else:
            assert len(calls) == 3 * len({(o, w.dtype) for (w, _, o) in sharded.owned})
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bucket", [25 << 20, 1024])
def test_zero_1_broadcasts_in_buckets_and_ends_with_the_unsharded_weights(tmp_path, bucket):
    """ZeRO 1's broadcast (Note [ZeRO 1]): a bucket per owner and dtype where they fit, several where they do
    not (a weight larger than a bucket alone), and either way every rank's weights those of plain AdamW."""
    import torch.multiprocessing as mp

    mp.start_processes(_zero1_worker, args=(2, str(tmp_path / "store"), bucket), nprocs=2, join=True,
                       start_method="fork")
