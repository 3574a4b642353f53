"""The seeds of the run's named random streams (`name_seed`), and the random numbers a run draws while it trains
(dropout, random masking, noise), on every rank.

# Note [random numbers]
Initial values and data never use the global generators (each tensor's and
each step's own generator: Note [initial values], Note [shard order]); what a
model draws during training does (`nn.Dropout`, `torch.rand` in a forward).
Before step 1, every rank seeds its global generators (torch's CPU generator,
every CUDA device's, Python's `random` and numpy's) with its stream's seed:

    stream (dp rank d, pp rank p) -> trainer.seed            for (0, 0)
                                     name_seed(seed, "rng.dp<d>.pp<p>")  otherwise

Tensor-parallel ranks of one (d, p) share a stream: they hold replicated
activations (a residual stream, a whole attention output), and a dropout mask
that differed between them would make those replicas disagree. Data-parallel
ranks and pipeline stages draw from streams of their own, so different samples
(and different layers) get independent masks, as one process drawing for the
whole batch gives them. Nothing else draws from these generators between
steps, and a checkpoint holds every rank's generator states
(parallel.checkpoint), so:

- the same seed, strategy and world size give the same run, bit for bit, and
  a run resumed from a checkpoint on the same world size continues it exactly
  (on another world size the streams restart from their seeds, and the run
  says so);
- `strategy=single` draws what the user's own loop draws when it calls
  `torch.manual_seed(trainer.seed)` after building the model and before its
  first step; `strategy=offload` and recomputed activations
  (`strategy.activations=checkpoint`, which replays a block's generator state
  when it runs the block again) draw exactly what `single` draws, so with
  dropout on they still give `single`'s losses and weights;
- tensor-parallel ranks (with dp = pp = 1, as under strategy=model) draw from
  `single`'s own stream, so dropout on a whole activation (replicated on every
  tp rank: embeddings, the residual stream, a rowwise layer's summed output,
  the attention of heads that are not split) draws `single`'s masks and the run
  gives `single`'s numbers; dropout on a split activation (the attention
  probabilities of a rank's share of the heads) draws over another shape;
- data-parallel ranks (each drawing for its share of the batch from its own
  stream) and pipeline microbatches (drawn one after another on each stage's
  rank) draw the same kinds of masks, but other ones than one process draws:
  with dropout on, such a run is another sample of the same training, not
  `single`'s numbers. Parity with `single` to 1e-4 holds there with dropout
  off (p = 0).
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def name_seed(seed: int, fqn: str) -> int:
    """A stable 63-bit seed from (seed, name), the seed of every named random stream (a tensor's initial value,
    a step's batch, a rank's training stream); Python's hash() is salted per process."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def stream_seed(seed: int, dp_rank: int, pp_rank: int) -> int:
    """The seed of the stream of data-parallel rank `dp_rank` and pipeline rank `pp_rank` (Note [random
    numbers]); `seed` itself for (0, 0), so one process draws what `torch.manual_seed(seed)` gives."""
    return seed if dp_rank == 0 and pp_rank == 0 else name_seed(seed, f"rng.dp{dp_rank}.pp{pp_rank}")


def seed_all(seed: int) -> None:
    """Seed torch's CPU and CUDA generators (`torch.manual_seed` seeds every device), Python's and numpy's."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict:
    """This process's generator states, as a checkpoint keeps them."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned (a checkpoint written before numpy's state was kept lacks it)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
