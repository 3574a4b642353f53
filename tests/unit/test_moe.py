"""The moe model's pieces in one process: routing with a capacity, the load-balancing gradient, the routing
figures, and the bad inputs of expert parallelism (config errors before any worker starts)."""
import pytest
import torch

from parallel.config import Config, ConfigError
from parallel.models.moe import balance_loss, build_moe, route
from parallel.models.moe_stats import moe_record
from parallel.validate import validate


def test_capacity_keeps_the_earliest_choices_per_sequence():
    # One sequence of 4 tokens, 2 experts, top-1: every token picks expert 0; capacity ceil(0.5 x 4 x 1 / 2) = 1.
    logits = torch.tensor([[[2.0, 0.0]] * 4])
    r = route(logits, top_k=1, capacity_factor=0.5)
    assert r.kept.flatten().tolist() == [True, False, False, False]
    assert r.weights.flatten().tolist() == [1.0, 0.0, 0.0, 0.0]
    # Without a capacity every choice is kept, and the chosen k are softmaxed among themselves.
    r = route(torch.tensor([[[1.0, 2.0, 3.0]]]), top_k=2)
    assert r.chosen.tolist() == [[2, 1]]
    torch.testing.assert_close(r.weights, torch.tensor([[1.0, 2.0]]).softmax(-1)[:, [1, 0]])


def test_the_load_balancing_gradient_is_that_of_the_mean_over_sequences():
    """Backward of the model alone (a plain loop) gives the gradient of loss + coef x mean_s(aux_s) per layer."""
    torch.manual_seed(0)
    model = build_moe(vocab_size=16, seq_len=8, dim=16, heads=2, layers=1, experts=4, top_k=2, aux_coef=0.5)
    x = torch.randint(0, 16, (3, 8))
    model(x).sum().backward()
    got = model.blocks[0].mlp.router.weight.grad.clone()
    model.zero_grad()
    captured = {}
    layer = model.blocks[0].mlp
    hook = layer.router.register_forward_hook(lambda m, i, o: captured.setdefault("logits", o))
    model.blocks[0].mlp.aux_coef = 0.0  # the explicit term instead of the injected one
    out = model(x)
    aux = balance_loss(route(captured["logits"], 2))
    (out.sum() + 0.5 * aux / 3).backward()
    hook.remove()
    torch.testing.assert_close(got, layer.router.weight.grad)
    assert layer.stats["tokens"].sum() == 2 * 3 * 8 * 2  # two training forwards, 24 tokens x top 2


def test_routing_figures_and_their_reset():
    torch.manual_seed(0)
    model = build_moe(vocab_size=16, seq_len=8, dim=16, heads=2, layers=2, experts=4, capacity_factor=0.5)
    model(torch.randint(0, 16, (2, 8))).sum().backward()
    record = moe_record([model])
    assert sum(record["moe_tokens_per_expert"]) + record["moe_dropped_tokens"] == 2 * 16 * 2
    assert record["moe_dropped_tokens"] > 0 and record["moe_load_imbalance"] >= 1.0
    assert record["moe_aux_loss"] > 0
    assert moe_record([model]) == {}  # read once: the next log counts the next steps


def _moe(**strategy) -> Config:
    cfg = Config()
    cfg.model.name, cfg.data.task = "moe", "lm"
    cfg.model.args = {"vocab_size": 64, "seq_len": 32, "experts": 4}
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    return cfg


def test_ep_must_divide_the_experts():
    cfg = _moe(name="hybrid", ep=8, dp=1)
    with pytest.raises(ConfigError, match=r"^strategy.ep=8: must divide the number of experts: blocks.0.mlp has 4"):
        validate(cfg, 8)


def test_moe_under_context_parallelism_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^strategy.cp=2: blocks.0.mlp is a mixture-of-experts layer"):
        validate(_moe(name="hybrid", cp=2, dp=1), 2)


def test_ep_needs_a_model_with_experts():
    cfg = Config()
    cfg.model.args = {"in_features": 32, "out_features": 4}
    cfg.strategy.name = "expert"
    with pytest.raises(ConfigError, match=r"^strategy.ep=2: MLP has no mixture-of-experts layer"):
        validate(cfg, 2)


def test_moe_validates_under_ep():
    validate(_moe(name="expert"), 2)
    validate(_moe(name="hybrid", dp=2, ep=2, zero=3), 4)


def test_top_k_beyond_the_experts_is_a_config_error():
    cfg = _moe()
    cfg.model.args["top_k"] = 5
    with pytest.raises(ConfigError, match="top_k=5 must be in"):
        validate(cfg, 1)

