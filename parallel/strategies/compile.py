"""trainer.compile=true: each repeated block compiled with torch.compile, under every strategy that allows it.

# Note [regional compilation]
The unit compiled is a block (parallel.blocks.repeated_blocks: the items of the
model's ModuleLists / Sequentials, of the model's own classes: torch 2.13 does
not compile a torch.nn module entered on its own, so those stay eager and the
log says so; a model with only such blocks is a config error), not the whole
model, as TorchTitan and Accelerate do it: `block.compile()` compiles the
module's own call, so the blocks keep their names (no `_orig_mod.` prefix; Note [initialization by name]),
and identical blocks share one compiled graph: torch 2.13 passes a module's
parameters to the graph as inputs (inline_inbuilt_nn_modules), so the second
block of a class meets the first one's guards and reuses its code. Compilation
is lazy: it happens in the first step (`CompileClock` times it).

`dynamic=False`: a block sees one microbatch shape for the whole run, so it is
compiled for that shape; another shape would compile once more for itself
instead of turning every shape symbolic. The metrics' `compiles` counts every
compilation: evaluation (no gradients) compiles its own forward once; a count
that grows from step to step in training would mean recompiling.

Where each strategy compiles, always after its own wrappers, on meta, before
materialization (compilation records no tensors until the first call):
  single, data, model, context, expert, hybrid without pp: the whole model's
      blocks, after the tensor plan, the context-parallel attention, the experts'
      placement, recomputation (composable checkpoint) and DDP / FSDP2. FSDP2's
      hooks are dynamo-disabled in torch 2.13 (fsdp/_fully_shard/_fsdp_state.py),
      so they all-gather and free eagerly around the compiled block;
      recomputation's hooks likewise run around it, and backward recomputes the
      compiled forward. A block with data-dependent steps (a mixture-of-experts
      layer's routing) compiles in several graphs, once each.
  pipeline, hybrid with pp: each stage's blocks, after the model's own block
      modules are swapped in for the traced copies (parallel.strategies.pipeline.
      stages.eager_blocks): traced copies each carry their own generated code,
      so they could not share a graph.
  recomputation: checkpoint and selective=N (whole blocks) compile as above;
      selective=op is a config error: torch's selective cache sits in the
      eager dispatch around the block and would keep the compiled code's
      product outputs, which that code writes into buffers it reuses (torch
      2.13: "Tensor cached during selective activation checkpoint has been
      mutated" in backward).
  offload: not compiled (a config error, not a quiet eager run). Its hooks move
      each block's weights between tiers and run its recomputation themselves,
      per block and per microbatch; compiling the blocks under them is untried,
      and a parity test would have to show it first.
The planner (parallel.planning.planner) plans the eager run: `Runtime.compile` is False
there, since fake tensors have no values to compile against, and compiled code
changes time, not the weights, gradients and optimizer state it counts.
"""
from __future__ import annotations

import time

from torch import nn
from torch._dynamo.callback import CallbackArgs, callback_handler

from parallel.blocks import repeated_blocks
from parallel.config import SPECS, Config, fail, strategy_spec
from parallel.metrics import log
from parallel.runtime import Runtime
from parallel.strategies.recompute import recomputation


def compiling(cfg: Config, runtime: Runtime) -> bool:
    """Whether this build compiles its blocks: trainer.compile, and not under the planner."""
    return cfg.trainer.compile and runtime.compile


def torch_own(module: nn.Module) -> bool:
    """A module of one of torch's own classes (nn.Linear, nn.Sequential, ...): torch.compile, entered at such a
    module's call, runs it eagerly without compiling (torch 2.13), so it is no block to compile on its own.
    FSDP2 gives a block a class of torch's making, derived from the block's own: the whole lineage is read."""
    return all(c.__module__.split(".")[0] in ("torch", "builtins") for c in type(module).__mro__)


def compile_blocks(root: nn.Module, names: list[str]) -> None:
    """Compile the blocks `names` of `root` in place (each lazily, at its first call); a block of torch's own
    class stays eager, and the log says so."""
    mine = [n for n in names if not torch_own(root.get_submodule(n))]
    for name in mine:
        root.get_submodule(name).compile(dynamic=False)
    if mine:
        log.info("trainer.compile: %d blocks to compile at the first step (%s)", len(mine), ", ".join(mine))
    left = [f"{n} ({type(root.get_submodule(n)).__name__})" for n in names if n not in mine]
    if left:
        log.info("trainer.compile: eager, as torch's own layers: %s", ", ".join(left))


def compile_model(model: nn.Module) -> None:
    """Compile the repeated blocks of a whole model (strategies that keep the whole model on each rank; the
    builder asks `compiling` first)."""
    compile_blocks(model, repeated_blocks(model))


def check_compile(cfg: Config, model: nn.Module) -> None:
    """trainer.compile applies: the strategy allows it and the model has repeated blocks to compile."""
    if not cfg.trainer.compile:
        return
    s = cfg.strategy.name
    if not strategy_spec(s).compiles:  # offload (Note [strategy table])
        fail("trainer.compile", True, f"strategy={s} moves each block's weights and activations through its own "
             "hooks, which compiled blocks do not follow (Note [regional compilation])",
             [f"strategy={name}" for name, spec in SPECS.items() if spec.compiles] + ["trainer.compile=false"])
    how = recomputation(cfg.strategy)
    if how is not None and how.ops:
        fail("trainer.compile", True, f"strategy.selective={cfg.strategy.selective} keeps the products' outputs "
             "from the eager dispatch around each block, and a compiled block writes its products into buffers it "
             "reuses, which torch refuses in backward (Note [selective recomputation])",
             ["trainer.compile=false", "strategy.selective=N (every N-th block recomputed whole)",
              "strategy.activations=checkpoint"])
    blocks = repeated_blocks(model)
    if not blocks:
        fail("trainer.compile", True, f"compiles the model's repeated blocks (the items of its ModuleLists or "
             f"Sequentials), and model={cfg.model.name} (strategy={s}) has none",
             ["trainer.compile=false", "a model that keeps its blocks in an nn.ModuleList"])
    if all(torch_own(model.get_submodule(n)) for n in blocks):
        classes = sorted({type(model.get_submodule(n)).__name__ for n in blocks})
        fail("trainer.compile", True, f"model={cfg.model.name}'s repeated blocks are torch's own modules "
             f"({', '.join(classes)}), which torch.compile runs eagerly when entered one by one",
             ["trainer.compile=false", "blocks of a class of the model's own"])


class CompileClock:
    """Seconds spent compiling (dynamo's frames and the backward graphs compiled at the first backward), and
    how many compilations, since it was made; `close` stops counting.

    torch's compile callbacks fire once per outermost compilation (nested ones are folded in), so the time
    is not counted twice.
    """

    def __init__(self):
        self.seconds, self.count, self._t0 = 0.0, 0, None
        self._start = callback_handler.register_start_callback(self._started)
        self._end = callback_handler.register_end_callback(self._ended)

    def _started(self, args: CallbackArgs) -> None:
        self._t0 = time.perf_counter()

    def _ended(self, args: CallbackArgs) -> None:
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1
            self._t0 = None

    def record(self) -> dict:
        """The figures a metrics record carries: the compile time so far and the number of compilations (a
        number that grows after the first step means recompiling)."""
        return {"compile_time_s": self.seconds, "compiles": self.count}

    def close(self) -> None:
        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)
