"""Losses, a padded text dataset and a model a user would write, for the loss and evaluation tests (importable by
the workers as tests.user_loss.<name>)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

IGNORE = -100


class PaddedLM(Dataset):
    """n token sequences of `seq_len` ids, each real for a length of its own (1 .. seq_len, drawn from the seed)
    and padded after it: inputs with id 0, targets with -100. So the microbatches of a step, and the
    data-parallel ranks' shares of it, hold different numbers of real tokens."""

    def __init__(self, n: int = 32, seq_len: int = 16, vocab_size: int = 64, seed: int = 3):
        self.vocab_size = vocab_size  # read by data=custom for the built-in sizes
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (n, 1), generator=g)
        tokens = (start + torch.arange(seq_len + 1) * 5) % vocab_size  # a learnable walk, as data=synthetic's
        self.lengths = torch.randint(1, seq_len + 1, (n,), generator=g)
        real = torch.arange(seq_len) < self.lengths[:, None]
        self.x = torch.where(real, tokens[:, :-1], 0)
        self.y = torch.where(real, tokens[:, 1:], IGNORE)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def padded_lm(n: int = 32, seq_len: int = 16, vocab_size: int = 64, seed: int = 3) -> PaddedLM:
    return PaddedLM(n, seq_len, vocab_size, seed)


def token_sum(out, target):
    """Summed cross-entropy over the real tokens (loss.reduction=sum)."""
    return F.cross_entropy(out.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORE, reduction="sum")


def token_mean(out, target):
    """Mean cross-entropy over the real tokens (loss.reduction=mean), as most training scripts write it."""
    return F.cross_entropy(out.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORE)


def squared_sum(out, target):
    """A sum over the samples: wrong with loss.reduction=mean."""
    return ((out - target) ** 2).sum()


def squared_mean(out, target, weight: float = 1.0):
    """A mean over the samples, with a keyword argument (loss.args)."""
    return weight * ((out - target) ** 2).mean()


def per_sample(out, target):
    """One value per sample: not a scalar."""
    return ((out - target) ** 2).mean(dim=1)


def not_callable():
    pass


NOT_CALLABLE = 3


class DrawsInEval(nn.Module):
    """An MLP with dropout that also draws a random number in eval mode (a model's own sampling, say): an
    evaluation that let that draw move the generators would change the next steps' dropout masks."""

    def __init__(self, features: int = 32, out: int = 4, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, out))

    def forward(self, x):
        if not self.training:
            torch.rand(1)
        return self.net(x)


def draws_in_eval(features: int = 32, out: int = 4) -> nn.Module:
    return DrawsInEval(features, out)
