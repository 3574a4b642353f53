"""Sequence parallelism added to a plan that lacks it (a Hugging Face decoder's own plan), and loss parallelism
(the output head's logits left split by the vocabulary) added to any plan.

# Note [sequence parallelism for a model's own plan]
Hugging Face's plans split the projections (q, k, v and the MLP's up and gate
colwise, o and down rowwise) and leave the residual stream whole: every tp rank
holds every token's activations between the projections, its norms' inputs and
the block inputs a recomputed run saves. `strategy.sequence_parallel=true`
cuts that stream by the sequence, as torchtitan's Llama plan does and the
built-in gpt's `tp_plan` does, from the model's structure:
- the first block of its list of blocks takes its input cut into this rank's
  sequence shard (`seq_split`);
- in every block, each direct child that is a norm runs on the shards
  (`sequence`, SequenceParallel); each other child (the attention, the MLP) has
  its input gathered on entry (`seq_gather`: the first argument, positional or
  by name, as Hugging Face's decoder layers pass `hidden_states=`) and its
  rowwise layers reduce-scatter their outputs back into shards (`rowwise_seq`);
- the norm after the blocks runs on the shards, and the output head gathers
  them (`colwise_seq_gather` for a split head, `seq_gather` for a whole one).
The model's forward before the blocks sees whole tensors, so what it computes
from the sequence's length (the positions, the rotary tables, the causal mask)
is the whole sequence's; each block's attention sees the gathered sequence with
them. A block child that is not a norm and holds no rowwise layer (whose output
would not return to shards) is refused, as is a sequence that tp does not
divide. Each rank then holds 1/tp of the residual stream's bytes (the block
inputs a recomputed run saves, the norms' inputs and outputs).
"""
from __future__ import annotations

from torch import nn

from parallel.blocks import repeated_blocks
from parallel.config import ConfigError
from parallel.strategies.tensor.styles import SHARDS_INPUT


def is_norm(module: nn.Module) -> bool:
    """A normalization layer (PyTorch's LayerNorm and RMSNorm, Hugging Face's *RMSNorm, *LayerNorm)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def with_sequence_parallel(model: nn.Module, plan: dict[str, str], seq_len: int | None, tp: int) -> dict[str, str]:
    """`plan` (module name -> style, no sequence-parallel styles) with the residual stream cut by the sequence
    (Note [sequence parallelism for a model's own plan]).

    Raises:
        ConfigError: the model has no single list of blocks, a block child it cannot place, no output head it
            can find, or a sequence length tp does not divide.
    """
    kind = type(model).__name__
    if seq_len is not None and seq_len % tp:
        raise ConfigError(f"strategy.sequence_parallel=true: data.seq_len={seq_len} must divide by tp {tp} (each "
                          f"rank holds seq_len / tp tokens of the residual stream)")
    names = repeated_blocks(model)
    parents = {n.rpartition(".")[0] for n in names}
    if len(parents) != 1:
        raise ConfigError(f"strategy.sequence_parallel=true: {kind} has no single list of blocks to cut the "
                          f"sequence through ({len(parents)} lists); give strategy.tp_plan with the seq_* styles")
    out = dict(plan)
    for block in names:
        for child, module in model.get_submodule(block).named_children():
            name = f"{block}.{child}"
            if is_norm(module):
                out[name] = "sequence"
                continue
            rowwise = [n for n, style in plan.items() if n.startswith(name + ".") and style in SHARDS_INPUT]
            if not rowwise:
                if not any(True for _ in module.parameters()):
                    continue  # parameter-free (a dropout, an activation): runs on the shards as it is
                raise ConfigError(f"strategy.sequence_parallel=true: {kind}'s {name} ({type(module).__name__}) is "
                                  f"neither a norm nor ends in a rowwise layer of the plan, so its output cannot "
                                  f"return to sequence shards; give strategy.tp_plan with the seq_* styles")
            out[name] = "seq_gather"
            out.update({n: "rowwise_seq" for n in rowwise if plan[n] == "rowwise"})
    out[names[0]] = "seq_split"
    prefix = parents.pop().rpartition(".")[0]  # the module holding the list: its norm after the blocks
    for child, module in model.get_submodule(prefix).named_children():
        if is_norm(module):
            out[f"{prefix}.{child}" if prefix else child] = "sequence"
    head = _head(model)
    if head is None:
        raise ConfigError(f"strategy.sequence_parallel=true: {kind} has no output head (get_output_embeddings) "
                          f"to gather the sequence at; give strategy.tp_plan with the seq_* styles")
    out[head] = "colwise_seq_gather" if plan.get(head) == "colwise_gather" else "seq_gather"
    return out


def _head(model: nn.Module) -> str | None:
    """The name of the model's output head: Hugging Face's `get_output_embeddings`, else the last nn.Linear in
    module order (the built-in gpt's `head`); None without one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None:
        return next((n for n, m in model.named_modules() if m is head), None)
    return next((n for n, m in reversed(list(model.named_modules())) if isinstance(m, nn.Linear)), None)


# Note [loss parallelism]
# With strategy.loss_parallel=true the output head keeps its logits split by the vocabulary (a DTensor sharded on
# the last dimension, `colwise_loss` / `colwise_seq_loss`) instead of gathering them whole on every tp rank, and
# the built-in cross-entropy runs on the pieces under PyTorch's `loss_parallel()` (each rank's log-softmax
# needs only the max and the sum of exponentials over the ranks): the logits, their fp32 copy and their
# gradient take 1/tp of the bytes, which at a 128K vocabulary are most of a step's peak. The engine runs the
# forward, the loss and the backward of each microbatch inside that context (parallel.loss.Loss.over_pieces).
# It needs the head split by the vocabulary (colwise_gather or colwise_seq_gather in the plan), the built-in
# cross-entropy without label smoothing, and no pipeline (a stage computes its loss inside the schedule).
LOSS_STYLES = {"colwise_gather": "colwise_loss", "colwise_seq_gather": "colwise_seq_loss"}


def with_loss_parallel(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan` with the output head's logits left split by the vocabulary (Note [loss parallelism]).

    Raises:
        ConfigError: the model has no output head, or the plan does not split it by the vocabulary.
    """
    head = _head(model)
    style = plan.get(head) if head is not None else None
    if style in LOSS_STYLES.values():
        return plan
    if style not in LOSS_STYLES:
        what = f"its output head {head} is {style or 'left whole'} in the plan" if head else "it has no output head"
        raise ConfigError(f"strategy.loss_parallel=true: the cross-entropy runs on logits split by the vocabulary, "
                          f"and {type(model).__name__}'s {what}; split it with colwise_gather (or "
                          f"colwise_seq_gather under sequence parallelism), or set strategy.loss_parallel=false")
    return {**plan, head: LOSS_STYLES[style]}
