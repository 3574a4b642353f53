"""Synthetic, learnable data whose global batch at step k depends only on (seed, k)."""
from __future__ import annotations

import torch

from parallel.config import DataConfig
from parallel.init import name_seed


class SyntheticData:
    """Batches for the regression, classification and lm tasks.

    The whole global batch of a step is drawn from a generator seeded by
    (seed, step) and each data-parallel rank keeps its contiguous slice, so the
    samples a step sees never depend on how many ranks share them.

    Args:
        cfg: the data config.
        seed: the run's seed.
        batch_size: the global batch.
        dp_rank, dp_size: this rank's place among the data-parallel ranks.
        stream: the name batch k's generator is seeded by, with k appended: "data.step." for training,
            "data.eval." for the held-out eval batches (other samples of the same task and teacher).
    """

    num_batches = None  # unbounded: any batch index can be drawn

    def __init__(self, cfg: DataConfig, seed: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 stream: str = "data.step."):
        self.cfg, self.seed, self.batch_size, self.stream = cfg, seed, batch_size, stream
        per_rank = batch_size // dp_size
        self.lo, self.hi = dp_rank * per_rank, (dp_rank + 1) * per_rank
        # The hidden "teacher" that makes the task learnable; fixed by the seed alone.
        g = torch.Generator().manual_seed(name_seed(seed, "data.teacher"))
        width = {"regression": cfg.targets, "classification": cfg.classes}.get(cfg.task, 1)
        self.teacher = torch.randn(cfg.features, width, generator=g) / cfg.features ** 0.5
        self.shift = torch.randint(1, cfg.vocab_size, (1,), generator=g).item()

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (inputs, targets) batch of `step` (used by tests and by `batch`)."""
        c = self.cfg
        g = torch.Generator().manual_seed(name_seed(self.seed, f"{self.stream}{step}"))
        if c.task == "lm":
            # A noisy affine walk over the vocabulary: next = prev + shift (mod V),
            # replaced by a random token 10% of the time.
            start = torch.randint(0, c.vocab_size, (self.batch_size, 1), generator=g)
            offsets = torch.arange(c.seq_len + 1) * self.shift
            tokens = (start + offsets) % c.vocab_size
            noise = torch.rand(tokens.shape, generator=g) < 0.1
            tokens = torch.where(noise, torch.randint(0, c.vocab_size, tokens.shape, generator=g), tokens)
            return tokens[:, :-1], tokens[:, 1:]
        if c.inputs == "tokens":  # the class is read from the first token: learnable by any text classifier
            x = torch.randint(0, c.vocab_size, (self.batch_size, c.seq_len), generator=g)
            return x, x[:, 0] % c.classes if c.task == "classification" else \
                torch.randn(self.batch_size, c.targets, generator=g)
        x = torch.randn(self.batch_size, c.features, generator=g)
        logits = x @ self.teacher
        if c.task == "classification":
            return x, logits.argmax(dim=1)
        return x, logits + c.noise * torch.randn(logits.shape, generator=g)

    def batch(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch of `step`, on `device`."""
        x, y = self.global_batch(step)
        return x[self.lo:self.hi].to(device), y[self.lo:self.hi].to(device)

    def close(self) -> None:
        """Nothing to stop: batches are made on demand."""
