"""Context parallelism without processes: each rank's chunks, and the bad inputs that stop a run before any
worker starts (parallel.strategies.context.check_context and the degrees)."""
import pytest
import torch

from parallel.config import Config, ConfigError
from parallel.strategies.context import attention_path
from parallel.strategies.context.attention import SequenceShard
from parallel.strategies.context.cuda import TorchSequenceShard
from parallel.strategies.context.traced import TracedAttention
from parallel.validate import validate

GPT = {"model__name": "gpt", "model__args": {"vocab_size": 64, "seq_len": 16, "dim": 16, "heads": 2, "layers": 1},
       "data__task": "lm", "data__seq_len": 16}


def cfg_with(**changes) -> Config:
    cfg = Config()
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def test_chunks_pair_the_first_with_the_last():
    """2 x cp chunks; rank r holds chunks r and 2cp-1-r, so every rank has the same causal work."""
    x = torch.arange(16).view(1, 16)
    got = [SequenceShard(4, r).shard(x).flatten().tolist() for r in range(4)]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert sorted(sum(got, [])) == list(range(16))
    shard = SequenceShard(2, 1)
    assert shard.position_ids(torch.zeros(3, 8)).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]


def test_cuda_takes_torchs_ring_attention_and_the_cpu_the_exchange():
    assert attention_path("cuda") == "torch"
    assert attention_path("cpu") == "exchange"


@pytest.mark.parametrize("cp,length", [(2, 8), (3, 12), (4, 32)])
def test_torchs_load_balanced_layout_is_the_cpu_paths(cp, length):
    """PyTorch's head-tail load balancer, sharded on the sequence, gives rank r the CPU path's chunks, in its
    order: positions, inputs and targets are the same on both paths."""
    x = torch.arange(3 * length).view(3, length)
    for r in range(cp):
        torch_shard, own = TorchSequenceShard(cp, r), SequenceShard(cp, r)
        assert torch_shard.positions(length).tolist() == own.positions(length).tolist()
        assert torch.equal(torch_shard.shard(x), own.shard(x))
        assert torch_shard.position_ids(own.shard(x)).tolist() == own.position_ids(own.shard(x)).tolist()


def test_cp_on_cuda_passes():
    validate(cfg_with(**GPT, strategy__name="context", trainer__device="cuda"), 2)  # bf16: the flash kernel
    fp32 = {**GPT, "data__seq_len": 128, "model__args": {**GPT["model__args"], "seq_len": 128}}
    validate(cfg_with(**fp32, strategy__name="context", trainer__device="cuda", trainer__precision="fp32"), 2)


CUDA_BAD = [
    ({"trainer__compile": True}, "strategy.cp=2: trainer.compile=true with context parallelism on CUDA"),
    ({"trainer__precision": "fp32"}, "strategy.cp=2: in fp32 on CUDA each of the 2 x cp chunks must hold a "
     "multiple of 32 tokens (PyTorch's ring attention on the memory-efficient kernel); data.seq_len=16 gives 4 "
     "(valid: ['data.seq_len=128', 'trainer.precision=bf16', '1'])"),
]


@pytest.mark.parametrize("changes,message", CUDA_BAD, ids=["compile", "fp32_chunks"])
def test_what_torchs_ring_attention_does_not_take_is_a_config_error(changes, message):
    with pytest.raises(ConfigError) as info:
        validate(cfg_with(**GPT, strategy__name="context", trainer__device="cuda", **changes), 2)
    assert str(info.value).startswith(message), str(info.value)


def test_traced_attention_takes_sdpas_arguments():
    """Note [traced attention over the cp ranks]: a traced sdpa call's arguments, grouped-query keys and values
    repeated for `enable_gqa`, the model's own mask left to the cp layout's causal attention."""
    class Whole:  # the attention of one rank holding the whole sequence
        def attend(self, q, k, v, scale=None):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 6, 4, generator=g) for heads in (4, 2, 2))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=0.3, enable_gqa=True)
    got = TracedAttention(Whole())(q, k, v, mask, 0.0, False, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want)


def test_gpt_with_cp_passes():
    validate(cfg_with(**GPT, strategy__name="context"), 4)
    # a sliding window as long as the sequence is causal attention over all of it
    validate(cfg_with(**{**GPT, "model__name": "custom", "model___target_": "tests.hf_models.mistral",
                         "model__args": {"sliding_window": 16}}, strategy__name="context"), 2)
    validate(cfg_with(**GPT, strategy__name="hybrid", strategy__dp=2, strategy__cp=2), 4)


# (changes, world size, the start of the message)
BAD = [
    ({"data__seq_len": 12}, 4, "strategy.cp=4: data.seq_len=12 must divide into 2 x cp = 8 chunks"),
    ({"model__name": "mlp", "model__args": {}, "data__task": "regression"}, 2,
     "strategy.cp=2: context parallelism splits causal self-attention, and MLP has none"),
    ({"data__task": "classification", "data__inputs": "tokens"}, 2, "strategy.cp=2: context parallelism splits "
     "sequences with a target per token"),
    # gpt's attention in a model of the user's, whose forward takes no positions
    ({"strategy__name": "hybrid", "strategy__cp": 2, "strategy__pp": 2, "model__name": "custom",
      "model___target_": "tests.hf_models.wrapped", "model__args": {"model": "gpt", **GPT["model__args"]}}, 4,
     "strategy.cp=2: context parallelism composes with pipeline parallelism for the built-in gpt and Hugging Face "
     "causal LMs; Wrapped's pipeline stages would need positions as a traced input"),
    ({"strategy__name": "hybrid", "strategy__cp": 2, "strategy__pp": 2, "model__name": "custom",
      "model___target_": "tests.hf_models.llama_without_sdpa", "model__args": {}}, 4,
     "strategy.cp=2: with pipeline parallelism LlamaForCausalLM is traced with its \"sdpa\" attention, which it "
     "does not take"),
    ({"strategy__cp": 3}, 4, "strategy.cp=3: the degrees must multiply to the world size: dp 1 x ep 1 x pp 1 x cp 3 "
     "x tp 1 = 3 != world size 4"),
    ({"strategy__name": "hybrid", "strategy__dp": 2, "strategy__cp": 2, "strategy__tp": 2, "strategy__pp": 1}, 4,
     "strategy=hybrid: the degrees must multiply to the world size: dp 2 x ep 1 x pp 1 x cp 2 x tp 2 = 8"),
    ({"strategy__tp": 2}, 4, "strategy.tp=2: strategy=context does not use a tp dimension"),
    ({"model__name": "custom", "model___target_": "tests.hf_models.mistral", "model__args": {"sliding_window": 8}}, 2,
     "strategy.cp=2: the attention over the cp ranks is causal over the whole sequence, and MistralForCausalLM "
     "attends over a sliding window of 8 tokens, shorter than data.seq_len=16"),
    ({"model__name": "custom", "model___target_": "tests.hf_models.gpt2", "model__args": {"dropout": 0.1}}, 2,
     "strategy.cp=2: the attention over the cp ranks has no dropout, and GPT2LMHeadModel's attention dropout is 0.1"),
]


@pytest.mark.parametrize("changes,world,message", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_cp_input_is_a_config_error(changes, world, message):
    cfg = cfg_with(**{**GPT, "strategy__name": "context", **changes})
    with pytest.raises(ConfigError) as info:
        validate(cfg, world)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)
