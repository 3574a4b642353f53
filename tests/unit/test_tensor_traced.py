"""Tensor parallelism over traced blocks without processes (Note [tensor parallelism over traced blocks] in
parallel/strategies/tensor/traced.py): a traced Llama stage's split layers become the model's own, holding the
traced weights, and its grouped-query attention, each rank's heads computed on their own, sums to the whole one."""
import copy

import torch
from torch import nn

from parallel.config import Config
from parallel.runtime import Runtime
from parallel.strategies.pipeline.chain import chain
from parallel.strategies.pipeline.split import plan_split
from parallel.strategies.pipeline.trace import retarget
from parallel.strategies.tensor import resolve_plan
from parallel.strategies.tensor.traced import _groups, traced_layers
from parallel.validate import resolve
from tests.hf_models import llama


def test_groups_pair_dimensions_whose_sizes_multiply_out_alike():
    assert _groups((2, 2, 2, 16, 8), (2, 4, 16, 8)) == [([0], [0]), ([1, 2], [1]), ([3], [2]), ([4], [3])]
    assert _groups((2, 16, 32), (2, 16, 4, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert _groups((2, 1, 16), (2, 16, 1)) == [([0], [0]), ([1, 2], [1, 2])]
    assert _groups((6, 4), (4, 6)) == [([0, 1], [0, 1])]


def _traced_stage():
    """Stage 0 of a two-stage split of the test Llama (grouped-query attention: 4 heads, 2 kv heads), on the
    CPU with the model's weights, the model, and its own plan for tp 2."""
    torch.manual_seed(0)
    model = llama()
    cfg = Config()
    cfg.model.name, cfg.model._target_ = "custom", "tests.hf_models.llama"
    cfg.data.task, cfg.data.seq_len, cfg.trainer.batch_size = "lm", 16, 8
    cfg.strategy.name, cfg.strategy.pp = "pipeline", 2
    resolve(cfg, 2)
    with torch.device("meta"):
        meta = llama()
    stage = chain(plan_split(meta, cfg, 1, Runtime(time_blocks=False)).pipe)[0]
    retarget(stage, "cpu")
    stage.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.copy_(model.get_parameter(name))
    return stage, meta, resolve_plan(meta, 2, example=(torch.zeros(8, 16, dtype=torch.long, device="meta"),))


def _inputs(attention: nn.Module) -> list[torch.Tensor]:
    """Random inputs of the shapes the trace gave the attention module (its mask causal)."""
    torch.manual_seed(1)
    out = []
    for node in (n for n in attention.graph.nodes if n.op == "placeholder"):
        v = node.meta["val"]
        out.append(torch.ones(v.shape).tril().bool() if v.dtype == torch.bool else torch.randn(v.shape))
    return out


def _rank(attention: nn.Module, rank: int) -> nn.Module:
    """`attention` as tp rank `rank` of 2 holds it: q, k and v its half of the heads, o its half of the inputs."""
    mine = copy.deepcopy(attention)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w = getattr(mine, name).weight.detach()
        half = w.shape[0 if name != "o_proj" else 1] // 2
        w = w.narrow(0 if name != "o_proj" else 1, rank * half, half)
        layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight = nn.Parameter(w.clone())
        setattr(mine, name, layer)
    return mine


def test_each_ranks_heads_of_the_traced_attention_sum_to_the_whole():
    stage, model, plan = _traced_stage()
    # retarget left no dtype asserts of the trace, which a run's bf16 parameters would fail (Note [tracing for
    # the pipeline] in parallel/strategies/pipeline/trace.py)
    assert not any(n.target is torch.ops.aten._assert_tensor_metadata.default
                   for m in stage.modules() if hasattr(m, "graph") for n in m.graph.nodes)
    name = "model.layers.0.self_attn"
    before = copy.deepcopy(stage.get_submodule(name))
    weight = stage.get_parameter(f"{name}.q_proj.weight")
    traced_layers(stage, model, plan)
    attention = stage.get_submodule(name)
    assert type(attention.q_proj) is nn.Linear and attention.q_proj.weight is weight  # the traced weight itself
    assert type(stage.get_submodule("model.layers.0.input_layernorm")) is type(before)  # left traced
    x = _inputs(attention)
    with torch.no_grad():
        whole = attention(*x)
        torch.testing.assert_close(whole, before(*x), rtol=0, atol=0)  # shapes read at run time: the same values
        torch.testing.assert_close(_rank(attention, 0)(*x) + _rank(attention, 1)(*x), whole)
