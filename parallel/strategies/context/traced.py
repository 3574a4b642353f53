"""Context parallelism in a traced pipeline stage: a Hugging Face model's attention, kept as the trace wrote
it, pointed at the cp ranks (Note [traced attention over the cp ranks]).

# Note [traced attention over the cp ranks]
A Hugging Face model's pipeline stages run their blocks as traced (Note [own or traced blocks] in
parallel/strategies/pipeline/stages.py): the model's own attention modules, which strategy=context points at
the cp ranks through transformers' attention interface, are not there. What is there is the op the
interface's "sdpa" implementation calls, `aten.scaled_dot_product_attention`, one per attention module, in
the graph of the traced copy of that module (the model is switched to "sdpa" before it is traced:
`traceable_attention`). Each such call is replaced by a call of a `TracedAttention` submodule, which takes
the same arguments and runs the rank's queries over the whole sequence (`SequenceShard.attend`, exact):
  - the attention mask the model built is its causal mask over the rank's own 2L tokens, as the trace saw
    them; the cp layout's causal attention over the whole sequence replaces it (as the attention interface's
    "context_parallel" function does without a pipeline). Padding masks never reach a stage: the engine
    hands the first stage tokens and positions only;
  - dropout is 0 (check_context);
  - grouped-query attention comes either with the keys and values already repeated to every query head (the
    graph's own ops, kept) or as `enable_gqa=True`, which repeats them here.
The rotary embeddings follow each chunk because the first stage is traced with `position_ids` as an input
(Note [context parallelism under the pipeline] in __init__.py). Every attention module of the model that a
stage holds must have had its call replaced: a stage where one did not is an error, not attention over the
rank's own tokens.
"""
from __future__ import annotations

import sys

import torch
from torch import fx, nn
from torch.export.unflatten import InterpreterModule

from parallel.strategies.context.attention import SequenceShard

SDPA = torch.ops.aten.scaled_dot_product_attention.default
NAME = "context_attention"  # the submodule each traced attention module gets


class TracedAttention(nn.Module):
    """What a traced `aten.scaled_dot_product_attention` call becomes: the same arguments, causal attention of
    this rank's queries over the cp ranks' keys and values (see the Note). It holds no weights, so the
    stage's state dict is unchanged."""

    def __init__(self, shard: SequenceShard):
        super().__init__()
        self.shard = shard

    def forward(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa:  # each key/value head serves q.shape[1] // k.shape[1] query heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return self.shard.attend(q, k, v, scale)


def traceable_attention(model: nn.Module) -> None:
    """Switch a Hugging Face model's attention to "sdpa" before it is traced, so each attention module traces
    to the one op `point_traced_attention` replaces (see the Note); other models are left as they are."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        model.set_attn_implementation("sdpa")


def point_traced_attention(stage: nn.Module, shard: SequenceShard, attention: list[str]) -> None:
    """Replace every traced attention call in `stage` by a `TracedAttention` over `shard`, in place.

    Args:
        attention: the names of the model's attention modules; each one the stage holds must have had a call
            replaced, else a RuntimeError names it.
    """
    replaced = set()
    for name, sub in list(stage.named_modules()):
        if isinstance(sub, (fx.GraphModule, InterpreterModule)) and _replace(sub, shard):
            replaced.add(name)
    held = {name for name, _ in stage.named_modules()} & set(attention)
    missed = sorted(n for n in held if not any(r == n or r.startswith(n + ".") for r in replaced))
    if missed:
        raise RuntimeError(f"context parallelism: the traced attention of {', '.join(missed)} was not found as "
                           "one scaled_dot_product_attention call (Note [traced attention over the cp ranks])")


def _replace(sub: nn.Module, shard: SequenceShard) -> bool:
    """Replace the attention calls in one traced module's own graph; whether there were any."""
    g = sub.graph
    calls = [n for n in g.nodes if n.op == "call_function" and n.target is SDPA]
    if not calls:
        return False
    attention = TracedAttention(shard)
    # An InterpreterModule runs its graph or the code generated from it (pipeline/chain.py `compiled`), which
    # reads submodules off the InterpreterModule; the graph itself belongs to that code's GraphModule.
    code = sub if isinstance(sub, fx.GraphModule) else sub.__dict__.get("graph_module")
    for holder in {id(m): m for m in (sub, code) if m is not None}.values():
        holder.add_module(NAME, attention)
    for node in calls:
        with g.inserting_before(node):
            new = g.call_module(NAME, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
    if code is not None:  # both ways of running see the change once the code is generated again
        code.recompile()
    return True
