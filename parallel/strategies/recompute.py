"""strategy.activations=checkpoint outside offload: recompute each block's activations in backward.

A checkpointed block keeps only its input for backward and runs its forward
again when backward reaches it, so the activations held at the peak drop from
all blocks' to about one block's, for about one more forward pass of compute.

PyTorch's composable `checkpoint` is used (non-reentrant, hooks on the block
module) rather than `checkpoint_wrapper`, because it leaves parameter names
unchanged (Note [initialization by name]) and composes with the tensor plan,
DDP and FSDP2 units applied after it. Offload recomputes through its own
engine (parallel.strategies.offload.hooks).

Which modules are blocks: the children of the model's ModuleLists and
Sequentials (a transformer's layers, an MLP's hidden layers); a model without
any checkpoints each of its top-level children instead.
"""
from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from parallel.batchnorm import recompute_contexts
from parallel.blocks import candidates
from parallel.config import Config
from parallel.tensors import as_call


def recomputing(cfg: Config) -> bool:
    return cfg.strategy.activations == "checkpoint"


def block_names(names: list[str]) -> list[str]:
    """Of the candidate block names (parallel.blocks.candidates, in forward order), those
    of repeated blocks (inside a ModuleList or Sequential: dotted); all of them when there are none."""
    repeated = [n for n in names if "." in n]
    return repeated or list(names)


def recompute_blocks(root: nn.Module, names: list[str]) -> None:
    """Checkpoint the blocks `names` of `root` (on meta, before FSDP or DDP wraps them), in place."""
    for name in block_names(names):
        block = root.get_submodule(name)
        # A BatchNorm layer's running statistics move once per step, not again when the block is recomputed
        # (Note [batch norm]); random ops draw the same numbers again (checkpoint replays the generators).
        checkpoint(block, context_fn=recompute_contexts(block))


def recompute_model(model: nn.Module, example) -> None:
    """Checkpoint the blocks of a whole model (strategies that keep the whole model on each rank).

    Args:
        example: one batch's input as the data hands it out (parallel.data.example_input, on meta), to find
            the blocks the forward calls.
    """
    names, _ = candidates(model, *as_call(example))
    recompute_blocks(model, names)
