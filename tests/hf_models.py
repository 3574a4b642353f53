"""Small models as users bring them, for tests: Hugging Face models built from a config (nothing downloaded),
hand-written models with their own initialization, and the plain PyTorch loop a user would write to train
them, which every strategy is compared with."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from parallel.config import DataConfig
from parallel.data import SyntheticData
from tests import cli, parity

# Every HF test runs with these (a constant learning rate keeps the plain loop the user's own).
HF_FAST = ["trainer.steps=4", "trainer.log_every=1", "trainer.progress=false", "trainer.save_final=true",
           *cli.TIMEOUTS, "optim.schedule=constant", "trainer.batch_size=8"]


def llama(vocab_size: int = 64, seq_len: int = 16, dim: int = 32, layers: int = 2, heads: int = 4,
          kv_heads: int = 2, tie: bool = False, use_cache: bool = False, **config):
    """LlamaForCausalLM: grouped-query attention (kv_heads < heads), rotary embeddings, RMSNorm. `use_cache`:
    true is the config's default (the framework turns it off, as model=hf does)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                      tie_word_embeddings=tie, use_cache=use_cache, **config)
    return LlamaForCausalLM(cfg)


def qwen3(vocab_size: int = 64, seq_len: int = 16, dim: int = 32, layers: int = 2, heads: int = 4,
          kv_heads: int = 2):
    """Qwen3ForCausalLM: a norm over each head's features of q and of k (q_norm, k_norm), which its own
    tensor-parallel plan keeps whole with their gradients summed over the ranks (replicated_with_grad_allreduce)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim // heads,
                      max_position_embeddings=seq_len, tie_word_embeddings=False, use_cache=False)
    return Qwen3ForCausalLM(cfg)


def mistral(vocab_size: int = 64, seq_len: int = 16, dim: int = 32, layers: int = 2, heads: int = 4,
            kv_heads: int = 2, sliding_window: int | None = 8):
    """MistralForCausalLM: Llama's layout with sliding-window attention over `sliding_window` tokens."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=vocab_size, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                        sliding_window=sliding_window, use_cache=False)
    return MistralForCausalLM(cfg)


def gpt2(vocab_size: int = 64, seq_len: int = 16, dim: int = 32, layers: int = 2, heads: int = 4,
         dropout: float = 0.0, use_cache: bool = False):
    """GPT2LMHeadModel: Conv1D layers, learned positions, the output head tied to the token embedding.
    `use_cache`: true is the config's default (the framework turns it off, as model=hf does)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=dim, n_layer=layers, n_head=heads,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=use_cache,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def bert_classifier(vocab_size: int = 64, seq_len: int = 16, classes: int = 4, dim: int = 32, layers: int = 2,
                    heads: int = 4, dropout: float = 0.0):
    """BertForSequenceClassification: an encoder with a pooler and a classification head."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=vocab_size, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * dim, max_position_embeddings=seq_len, num_labels=classes,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertForSequenceClassification(cfg)


def bert_base(vocab_size: int = 64, seq_len: int = 16, dim: int = 32, layers: int = 2, heads: int = 4):
    """BertModel, the encoder alone with its pooler (as a sentence-transformers checkpoint holds it): loaded
    with AutoModelForMaskedLM, its `cls.predictions` head is missing and its pooler unexpected."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=vocab_size, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * dim, max_position_embeddings=seq_len, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertModel(cfg)


class BatchNormCNN(nn.Module):
    """Convolutions with BatchNorm over a flat feature vector read as a one-channel square image."""

    def __init__(self, features: int, classes: int, width: int, depth: int):
        super().__init__()
        self.side = int(features ** 0.5)
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width),
                                                  nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x.view(x.shape[0], 1, self.side, self.side))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def batchnorm_cnn(features: int = 64, classes: int = 10, width: int = 8, depth: int = 2) -> nn.Module:
    return BatchNormCNN(features, classes, width, depth)


class Bare(nn.Module):
    """Bare parameters set in the constructor (a learned position table of zeros, a scale of ones), a weight
    tied between the token embedding and the output head, and a non-persistent buffer computed in __init__."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.scale = nn.Parameter(torch.ones(dim))
        self.register_buffer("decay", 0.5 ** torch.arange(dim, dtype=torch.float32) / dim, persistent=False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            self.pos.normal_(0.0, 0.02)

    def forward(self, x):
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = h + block(h) * (1 + self.decay)
        return self.head(h * self.scale)


def bare(vocab_size: int = 64, seq_len: int = 16, dim: int = 32, layers: int = 2) -> nn.Module:
    return Bare(vocab_size, seq_len, dim, layers)


class Wrapped(nn.Module):
    """A model kept one level down, as Hugging Face keeps its decoder under `model.`: its blocks are nested
    (`inner.blocks.N`, Note [nested blocks] in parallel/blocks.py)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def wrapped(model: str, **kwargs) -> nn.Module:
    """`model` (a factory of this file, or a built-in model's name) inside a `Wrapped`."""
    from parallel.models import MODELS

    return Wrapped(globals()[model](**kwargs) if model in globals() else MODELS[model](**kwargs))


def llama_without_sdpa(**kwargs):
    """A Llama that says it has no "sdpa" attention (as some Hugging Face models do), running its eager one."""
    model = llama(**kwargs)
    model.set_attn_implementation("eager")
    model._supports_sdpa = False
    return model


def hidden_states_only(vocab_size: int = 64, seq_len: int = 16, dim: int = 32):
    """A Hugging Face base model: its output holds hidden states, no logits (a bad input for training)."""
    return llama(vocab_size, seq_len, dim).model


def logits(out):
    """What a user's loop reads from a model's output."""
    return out if isinstance(out, torch.Tensor) else out.logits


def plain_loop(factory, kwargs: dict, data: DataConfig, steps: int = 4, batch_size: int = 8, seed: int = 0,
               lr: float = 5e-3, weight_decay: float = 0.01, clip: float = 1.0, model: nn.Module | None = None):
    """The user's own training script: seed, build, AdamW, the same batches; returns (losses, final state)."""
    torch.manual_seed(seed)
    model = factory(**kwargs) if model is None else model
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    source = SyntheticData(data, seed, batch_size)
    losses = []
    for step in range(1, steps + 1):
        x, y = source.global_batch(step)
        out = logits(model(x)).float()
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten()) if data.task == "lm" else \
            F.cross_entropy(out, y) if data.task == "classification" else F.mse_loss(out, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), {k: v.detach().clone() for k, v in model.state_dict().items()}


# Comparing a CLI run with the plain loop (tests/distributed/test_hf_*.py).
DATA = {  # the data each model takes, as CLI overrides and as the plain loop's DataConfig
    "llama": (["data.task=lm", "data.seq_len=16"], DataConfig(task="lm", seq_len=16)),
    "gpt2": (["data.task=lm", "data.seq_len=16"], DataConfig(task="lm", seq_len=16)),
    "qwen3": (["data.task=lm", "data.seq_len=16"], DataConfig(task="lm", seq_len=16)),
    "bert_classifier": (["data.task=classification", "data.inputs=tokens", "data.seq_len=16", "data.classes=4"],
                        DataConfig(task="classification", inputs="tokens", seq_len=16, classes=4)),
    "batchnorm_cnn": (["data.task=classification", "data.features=64"],
                      DataConfig(task="classification", features=64)),
    "bare": (["data.task=lm", "data.seq_len=16"], DataConfig(task="lm", seq_len=16)),
}


def args(model: str) -> list[str]:
    return HF_FAST + ["model=custom", f"model._target_=tests.hf_models.{model}"] + DATA[model][0]


@functools.lru_cache(maxsize=None)
def plain(model: str, pretrained: str | None = None):
    """(losses, final state) of the user's own loop; from `pretrained` (a save_pretrained directory) if given."""
    start = None
    if pretrained is not None:
        from transformers import AutoModelForCausalLM

        start = AutoModelForCausalLM.from_pretrained(pretrained)
    return plain_loop(globals()[model], {}, DATA[model][1], model=start)


@functools.lru_cache(maxsize=None)
def plain_from_pretrained(path: str, auto_class: str, seed: int = 0):
    """(losses, final state) of the user's own loop on lm data (DATA["llama"]) started from
    `torch.manual_seed(seed); AutoX.from_pretrained(path)`: what the directory lacks initialised by it."""
    import transformers

    torch.manual_seed(seed)
    start = getattr(transformers, auto_class).from_pretrained(path)
    return plain_loop(None, {}, DATA["llama"][1], seed=seed, model=start)


def assert_as_plain(run_dir, model: str, pretrained: str | None = None, first_step: int = 1) -> None:
    """Loss per step and final weights those of the plain loop, as Note [parity tolerances] in tests/parity.py
    says."""
    assert_as(run_dir, plain(model, pretrained), first_step)


def assert_as(run_dir, reference: tuple, first_step: int = 1) -> None:
    """`assert_as_plain` against `reference`, a plain loop's (losses, final state); the reach of a rounding
    difference is that of the run's own optimizer, lr and steps (.hydra/config.yaml), the plain loop's too."""
    losses, state = reference
    parity.assert_same_losses(cli.losses(run_dir), losses[first_step - 1:])
    parity.assert_same_weights(cli.final_weights(run_dir), state, parity.run_reach(run_dir))


def mixtral(vocab_size: int = 64, seq_len: int = 16, dim: int = 32, layers: int = 2, heads: int = 4,
            kv_heads: int = 2, experts: int = 4, top_k: int = 2):
    """MixtralForCausalLM: each layer's MLP a router (`mlp.gate`) over `experts` experts held fused
    (`mlp.experts.gate_up_proj`, `down_proj`), `top_k` of them per token."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=vocab_size, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                        num_local_experts=experts, num_experts_per_tok=top_k, use_cache=False)
    return MixtralForCausalLM(cfg)


def qwen3_moe(vocab_size: int = 64, seq_len: int = 16, dim: int = 32, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, experts: int = 4, top_k: int = 2):
    """Qwen3MoeForCausalLM: Qwen3's attention (q_norm, k_norm) and a sparse MLP in every layer, `top_k` of
    `experts` per token, its routing weights renormalised."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=dim, moe_intermediate_size=dim, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim // heads,
                         max_position_embeddings=seq_len, num_experts=experts, num_experts_per_tok=top_k,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], use_cache=False,
                         tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg)


DATA.update({name: DATA["llama"] for name in ("mixtral", "qwen3_moe", "gpt_oss")})


def gpt_oss(vocab_size: int = 64, seq_len: int = 16, dim: int = 32, layers: int = 2, heads: int = 4,
            kv_heads: int = 2, experts: int = 4, top_k: int = 2):
    """GptOssForCausalLM: attention sinks, sliding and full attention in turn, and experts with biases whose
    gate and up projections are interleaved (`gate_up_proj` (E, H, 2I), transposed)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=vocab_size, hidden_size=dim, intermediate_size=dim, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim // heads,
                       max_position_embeddings=seq_len, num_local_experts=experts, num_experts_per_tok=top_k,
                       sliding_window=8, use_cache=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 150000.0})  # no YaRN at 16 positions
    return GptOssForCausalLM(cfg)
