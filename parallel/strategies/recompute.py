"""strategy.activations=checkpoint | selective outside offload: recompute activations in backward.

A checkpointed block keeps only its input for backward and runs its forward
again when backward reaches it, so the activations held at the peak drop from
all blocks' to about one block's, for about one more forward pass of compute.

# Note [selective recomputation]
`strategy.activations=selective` recomputes part of what `checkpoint` does, by
`strategy.selective`:

    op   (the default) inside every block, the outputs of the matrix products
         (aten mm, addmm, bmm, baddbmm, the grouped mm: what a Linear and a
         matmul dispatch to) and of the attention kernels
         (`_scaled_dot_product_*`) are saved; every other op (norms,
         activations, dropout, residual sums, softmax, views that copy) runs
         again in backward. This is the op-level policy of the large public
         Llama runs: torch's `create_selective_checkpoint_contexts` with a
         policy of MUST_SAVE for those ops and PREFER_RECOMPUTE for the rest.
         Every product is saved, not every second one (the variant that trades
         half the products' outputs for recomputing them): the point of `op`
         is recomputation that costs next to no FLOPs (the recomputed ops are
         memory-bound; products are where the time goes), and the coarser trade
         of memory for compute is `selective=N` below or `checkpoint`. What it
         saves is the elementwise outputs, which dominate a transformer block's
         activations (a GELU's input and output, the norms' outputs, the copy
         before the attention's output projection); a block that is one
         product and one activation (the mlp's Linear + GELU) keeps as much as
         without recomputation.
    op_alternate
         as `op`, but every second matrix product a block runs (its 2nd, 4th,
         ...; counted again from 1 in each block's forward and in its
         recomputation) is recomputed rather than saved: the policy
         torchtitan's `selective_ac_option = "op"` runs, with which its
         published Llama 3.1 runs were trained. About half the products'
         outputs leave the saved activations, for running those products
         again in backward (in a Llama block the key, output and up
         projections: about a third of its products' FLOPs).
    N    (a positive integer) blocks 0, N, 2N, ... of the model's repeated blocks
         (in forward order, counted over the whole model, a pipeline stage
         taking those it holds) are checkpointed whole; the others keep their
         activations. 1 is `checkpoint`. The first block is the one whose
         activations live longest, from the start of forward to the end of
         backward.

Numbers do not change: a recomputed op is the same op on the same inputs,
random ops draw the same numbers again (checkpoint replays the generators), and
a BatchNorm layer's running statistics move once (Note [batch norm]). Under
`op`, a product's output that the model then changes in place is refused by
torch in backward ("Tensor cached during selective activation checkpoint has
been mutated"): recomputing from it would read the changed values.

Torch's selective checkpoint matches every op of the recomputation with one
forward ran in the block, profiler ranges included; FSDP2 opens ranges in
backward (its pre-backward hook, in bf16 its input casts) that forward opened
outside the block, so under `op` profiler ranges run outside the checkpoint's
modes (`_RangesOutside`): they hold no tensor and change nothing recomputed.

Expert parallelism (ep > 1) takes `selective=N` and not `op` (nor `op_alternate`): the experts' own
data-parallel units sit inside each block, and their FSDP hooks do not repeat
in recomputation the ops they ran in forward (a profiler range, a gather),
which torch's selective checkpoint matches op by op ("... encountered during
backward but not found in storage"). `trainer.compile=true` takes `selective=N`
and not `op` or `op_alternate` (Note [regional compilation] in
parallel/strategies/compile.py).

The planner counts what this keeps and recomputes without a rule of its own: the
cached outputs are live storages of the step (Note [planner]), and the ops
recomputed in backward are dispatched there and counted as the step's work
(Note [step work]), as checkpoint's are, the products served from the cache not.

PyTorch's composable `checkpoint` is used (non-reentrant, hooks on the block
module; it calls torch.utils.checkpoint's own non-reentrant implementation with
the same `context_fn`) rather than `checkpoint_wrapper`, because it leaves
parameter names unchanged (Note [initialization by name]) and composes with
the tensor plan, DDP and FSDP2 units applied after it. Offload recomputes
through its own engine (parallel.strategies.offload.hooks) and takes
`checkpoint` only.

Which modules are blocks: the children of the model's ModuleLists and
Sequentials (a transformer's layers, an MLP's hidden layers); a model without
any checkpoints each of its top-level children instead.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from parallel.batchnorm import recompute_contexts
from parallel.blocks import candidates
from parallel.config import SPECS, Config, StrategyConfig, fail
from parallel.tensors import as_call

ACTIVATIONS = ("device", "checkpoint", "selective")  # strategy.activations outside offload
OP = "op"  # strategy.selective: the op-level policy
ALTERNATE = "op_alternate"  # the same, every second product recomputed

# Note [selective recomputation]: the ops whose outputs `op` saves (overload packets: every overload of each).
SAVED = {getattr(torch.ops.aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(torch.ops.aten, name)}  # a torch release without one of them (the grouped mm) runs none
PRODUCTS = {p for p in SAVED if "attention" not in p.__name__}  # what op_alternate counts


@dataclass(frozen=True)
class Recompute:
    """What backward recomputes (Note [selective recomputation])."""

    every: int = 1  # blocks 0, every, 2 x every, ... are checkpointed
    ops: bool = False  # inside them, the products' and attention's outputs are saved, the rest recomputed
    alternate: bool = False  # with `ops`: every second product recomputed too (op_alternate)

    def contexts(self, block: nn.Module):
        """`context_fn` of the checkpoint of `block`."""
        return products_saved(block, self.alternate) if self.ops else recompute_contexts(block)


def recomputation(s: StrategyConfig) -> Recompute | None:
    """What `s` recomputes in backward (checked: `check_recompute`); None: activations stay where they are."""
    if s.activations == "checkpoint":
        return Recompute()
    if s.activations == "selective":
        if s.selective in (OP, ALTERNATE):
            return Recompute(ops=True, alternate=s.selective == ALTERNATE)
        return Recompute(every=int(s.selective))
    return None


def recomputing(cfg: Config) -> Recompute | None:
    """What the run's blocks recompute (outside offload, which recomputes through its own engine)."""
    return recomputation(cfg.strategy)


def check_recompute(s: StrategyConfig, offloads: bool) -> None:
    """strategy.activations and strategy.selective, for a strategy that keeps its activations on the device
    (`offloads` false) or streams them to its own tiers (offload: its own check takes the tiers and checkpoint,
    and it takes no selective recomputation). Raises ConfigError naming the key."""
    if offloads and s.activations == "selective":
        fail("strategy.activations", s.activations, f"strategy={s.name} streams the activations it saves to "
             "its own tiers and recomputes whole blocks through its own engine; selective recomputation "
             "keeps the products' outputs on the device, outside those tiers",
             ["checkpoint", f"strategy.activations=selective under strategy="
              f"{', '.join(n for n, spec in SPECS.items() if not spec.offloads and 'selective' in spec.keys)}"])
    if not offloads and s.activations not in ACTIVATIONS:
        tiers = " or ".join(f"strategy={n}'s" for n, other in SPECS.items() if other.offloads)
        fail("strategy.activations", s.activations, f"strategy={s.name} keeps activations on the device or "
             f"recomputes them (per block, or selectively); the tiers below the device are {tiers}",
             list(ACTIVATIONS))
    value = str(s.selective)
    if value not in (OP, ALTERNATE) and not (value.isdigit() and int(value) >= 1):
        fail("strategy.selective", s.selective, f"{OP} (the products' and attention's outputs saved in every "
             f"block), {ALTERNATE} (the same with every second product recomputed) or a positive integer N (every "
             "N-th block recomputed whole)", f"{OP}, {ALTERNATE}, 1, 2, 3, ...")
    if value != OP and s.activations != "selective":
        why = f"strategy={s.name} recomputes whole blocks only" if offloads else \
            f"strategy.activations={s.activations}"
        fail("strategy.selective", s.selective, f"chooses what strategy.activations=selective recomputes, and {why}",
             ([] if offloads else ["strategy.activations=selective"]) + [f"strategy.selective={OP}"])


def check_recompute_degrees(s: StrategyConfig) -> None:
    """What selective=op does not take, once the degrees are resolved: expert parallelism (Note [selective
    recomputation]). Raises ConfigError naming the key."""
    how = recomputation(s)
    if how is not None and how.ops and (s.ep or 1) > 1:
        fail("strategy.selective", s.selective, f"strategy.ep={s.ep} gives the experts data-parallel units of their "
             "own inside each block, whose hooks do not repeat in recomputation the ops they ran in forward, "
             "and torch's selective checkpoint matches them one by one",
             ["strategy.selective=N (every N-th block recomputed whole)", "strategy.activations=checkpoint"])


def _policy(alternate: bool):
    """Note [selective recomputation]: a product's or attention's output saved, any other op's recomputed;
    `alternate`, every second product recomputed as well (a policy per forward of a block, which counts the
    products of that forward and of its recomputation apart)."""
    seen = {False: 0, True: 0}  # products run: in forward, in the recomputation

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        packet = getattr(op, "_overloadpacket", None)
        if packet not in SAVED:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if alternate and packet in PRODUCTS:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


class _RangesOutside(TorchDispatchMode):
    """Profiler ranges run past the modes below it: torch's selective checkpoint matches every op of the
    recomputation with one of forward, and FSDP2 opens ranges in backward that no forward opened there."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "profiler":
            with _disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def products_saved(block: nn.Module, alternate: bool = False):
    """`context_fn` of `block`'s checkpoint under selective=op (`alternate`: op_alternate): torch's
    selective-checkpoint contexts (a fresh cache and policy per forward), with the BatchNorm running statistics
    put back around the recomputation (Note [batch norm]) outside its cached mode, whose own ops (a copy of the
    statistics) no forward made, and profiler ranges outside both (`_RangesOutside`)."""
    keep = recompute_contexts(block)

    def contexts():
        caching, cached = create_selective_checkpoint_contexts(_policy(alternate))
        _, restore = keep()
        return _nested(caching, _RangesOutside()), _nested(restore, _nested(cached, _RangesOutside()))

    return contexts


@contextlib.contextmanager
def _nested(outer, inner):
    with outer, inner:
        yield


def block_names(names: list[str]) -> list[str]:
    """Of the candidate block names (parallel.blocks.candidates, in forward order), those
    of repeated blocks (inside a ModuleList or Sequential: dotted); all of them when there are none."""
    repeated = [n for n in names if "." in n]
    return repeated or list(names)


def recompute_blocks(root: nn.Module, names: list[str], how: Recompute, called: set[str] | None = None) -> None:
    """Checkpoint the blocks of `root` as `how` says (on meta, before FSDP or DDP wraps them), in place.

    Args:
        names: the candidate block names of the whole model, in forward order (every `how.every`-th is counted
            over them).
        called: of them, those `root` runs (a pipeline stage's); None: all of them.
    """
    chosen = set(block_names(names)[::how.every])
    held = [n for n in names if called is None or n in called]
    for name in block_names(held):
        if how.every > 1 and name not in chosen:
            continue
        block = root.get_submodule(name)
        # A BatchNorm layer's running statistics move once per step, not again when the block is recomputed
        # (Note [batch norm]); random ops draw the same numbers again (checkpoint replays the generators).
        checkpoint(block, context_fn=how.contexts(block))


def recompute_model(model: nn.Module, example, how: Recompute | None = None) -> None:
    """Checkpoint the blocks of a whole model (strategies that keep the whole model on each rank) as `how` says
    (default: every block recomputed whole, strategy.activations=checkpoint).

    Args:
        example: one batch's input as the data hands it out (parallel.data.example_input, on meta), to find
            the blocks the forward calls.
    """
    names, _ = candidates(model, *as_call(example))
    recompute_blocks(model, names, how or Recompute())
