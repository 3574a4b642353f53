"""The engine contract: how the training loop runs one step of any strategy.

# Note [engine contract]
Every strategy returns an `Engine`; the trainer, the checkpoints, the memory
watch and the planner talk to this interface only, so strategy-specific work
stays in the strategy. What every engine does:

    model                what the optimizer and the memory watch see (this rank's pieces)
    holds_loss           this rank computes the loss (a pipeline's last stage; every rank otherwise)
    loss_group           the ranks that each hold a slice of the batch; the logged loss is their sum
    forward_backward     the whole step's forward and backward over this rank's batch; returns this rank's
                         part of the global loss (Note [global loss] in parallel/loss.py)
    evaluate             forward only over this rank's slice of an eval batch, no gradients, training mode
                         and random generators as they were; returns its [summed loss, count, correct]
    clip                 the global gradient norm (over every shard and stage), clipped when max_norm > 0
    metrics              the engine's own figures for a logged step (collective: every rank calls it)
    state_sharding       how the optimizer state is sharded (ZeRO 1: parallel.optim.StateSharding, set by
                         the strategy that shards it); None: every rank keeps its parameters' whole state
    kept_tensors         what it keeps between steps besides weights, gradients and optimizer state
                         (receive buffers, a buffer pool), counted by the memory watch
    state_modules        the modules whose state dicts hold this rank's tensors under the unpartitioned names
    checkpoint_state     (model, optimizer state, copies) for a checkpoint; load_checkpoint_state after a load
    full_state_dict      the unpartitioned weights, gathered on rank 0
    close                release threads, files and buffers (also when the run fails)

Before a step's first forward, forward_backward counts the step's targets (`Loss.start_step`) and hands the
step's auxiliary weight to the layers it runs that take one (`AuxWeights`, Note [auxiliary weight] in
parallel/aux_weight.py).

What only some engines have is a capability, a class of its own the trainer
asks for once, when it builds the run (`isinstance`):

    OwnOptimizer         steps its own weights (offload): make_optimizer, given the parameters'
                         unpartitioned names for the groups, and optimizer_tensors, the tensors of its
                         state the planner counts as optimizer memory
    LooksAhead           is handed the next step's input while this step trains (look_ahead), when
                         `looking_ahead` says it wants it (offload's frozen part run one batch ahead)
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from parallel.aux_weight import AuxWeights
from parallel.loss import Loss
from parallel.optim import clip_grad_norm, param_state
from parallel.tensors import call_model, rank_optimizer, split_rows


def autocast(bf16: bool, device: torch.device):
    """bf16 autocast on the run's device when `bf16` (`bf16_run`: trainer.precision=bf16, or auto on CUDA only,
    so that on the CPU every strategy is checked against `single` in fp32 to 1e-4); Note [mixed precision] in
    parallel/strategies/data.py."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


class Engine:
    """The base of every engine (Note [engine contract]); subclasses implement forward_backward and clip."""

    model: nn.Module
    holds_loss: bool = True
    loss_group = None
    state_sharding = None

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's part of the step's global loss (summed over the loss group: the loss); gradients are
        left ready for the step."""
        raise NotImplementedError

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """[summed loss, counted targets, correct predictions] (float64) of this rank's slice of an eval
        batch (zeros where the loss is not computed), forward only."""
        raise NotImplementedError

    def clip(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm; gradients are scaled to `max_norm` when it is > 0 and exceeded."""
        raise NotImplementedError

    def metrics(self) -> dict:
        return {}

    def kept_tensors(self) -> list[torch.Tensor]:
        return []

    def state_modules(self) -> list[nn.Module]:
        return [self.model]

    def checkpoint_state(self, optimizer: torch.optim.Optimizer, canonical: dict[str, str]):
        """This rank's tensors under their unpartitioned names (Note [checkpoint layout]).

        Args:
            optimizer: the run's optimizer (its own parameters' state is saved, any optimizer's layout).
            canonical: every parameter name -> the name its state is saved under (tied weights: the first).
        Returns (model state, optimizer state, copies): live tensors, so a load fills them in
        place; `copies` pairs a second copy of a tied weight's state on this rank with the first.
        """
        optimizer = rank_optimizer(optimizer)  # ZeRO 1: this rank's share
        states = param_state(optimizer, [p for group in optimizer.param_groups for p in group["params"]])
        model, optim, copies = {}, {}, []
        for module in self.state_modules():
            model.update(module.state_dict())
            for fqn, p in module.named_parameters():
                if p not in states:
                    continue
                state, name = states[p], canonical[fqn]
                if name in optim:
                    copies.append((state, optim[name]))
                else:
                    optim[name] = state
        return model, optim, copies

    def load_checkpoint_state(self, model: dict, optim: dict) -> None:
        """After a checkpoint was loaded into `checkpoint_state`'s tensors (in place, by default)."""

    def full_state_dict(self) -> dict:
        """The unpartitioned state dict, gathered on rank 0 (CPU tensors; {} elsewhere)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def close(self) -> None:
        pass


class OwnOptimizer:
    """A capability (Note [engine contract]): the engine steps its own weights."""

    def make_optimizer(self, names: dict[int, str]) -> torch.optim.Optimizer:
        """The optimizer the trainer and the LR schedule see, its groups made from the parameters' `names`."""
        raise NotImplementedError

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """The tensors of its optimizer's state, counted as optimizer memory by the planner."""
        raise NotImplementedError


class LooksAhead:
    """A capability (Note [engine contract]): the engine starts on the next step's input during this one."""

    @property
    def looking_ahead(self) -> bool:
        """Whether this run wants the next step's input."""
        raise NotImplementedError

    def look_ahead(self, x_next: torch.Tensor) -> None:
        """Start on the next step's input."""
        raise NotImplementedError


def own_optimizer(engine: Engine) -> OwnOptimizer | None:
    return engine if isinstance(engine, OwnOptimizer) else None


def looks_ahead(engine: Engine) -> LooksAhead | None:
    return engine if isinstance(engine, LooksAhead) and engine.looking_ahead else None


def grad_average(group) -> int:
    """The number of ranks DDP / FSDP average gradients over: each rank's loss is scaled by it (Note [global
    loss])."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


@contextlib.contextmanager
def evaluating(modules: list[nn.Module]):
    """The modules in eval mode without gradients; each submodule's own mode back afterwards (a frozen part
    may have been in eval mode on purpose)."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    for module in modules:
        module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


class LocalEngine(Engine):
    """The whole model (or its tensor-parallel / sharded pieces) on every rank: single, data, model, hybrid
    without pipeline. Forward and backward with gradient accumulation.

    Args:
        model: the parallelized, materialized model.
        loss: the run's loss (Note [global loss] in parallel/loss.py).
        loss_group: the group whose ranks each hold a slice of the batch (data parallel).
        device: this rank's device.
        accum: the micro-steps of a step (trainer.grad_accum).
        bf16: whether the forward runs under bf16 autocast (`autocast`).
        sequence: context parallelism's layout (parallel.strategies.context.SequenceShard): each batch is cut to
            this rank's chunks of every sequence, inputs and targets alike, and the model is told their
            positions (`position_ids`); None: whole sequences.
        state_sharding: ZeRO 1's layout of the optimizer state (parallel.optim.StateSharding), or None.
    """

    def __init__(self, model: nn.Module, loss: Loss, loss_group, device: torch.device, accum: int, bf16: bool,
                 sequence=None, state_sharding=None):
        self.model, self.loss, self.loss_group, self.device = model, loss, loss_group, device
        self.accum, self.bf16 = accum, bf16
        self.sequence, self.state_sharding = sequence, state_sharding
        self.aux = AuxWeights([model])  # Note [auxiliary weight] in parallel/aux_weight.py

    def _local(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x, y) if self.sequence is None else (self.sequence.shard(x), self.sequence.shard(y))

    def _forward(self, xs):
        if self.sequence is None:
            return call_model(self.model, xs)  # one tensor, or fields by name (Note [inputs by name])
        return self.model(xs, position_ids=self.sequence.position_ids(xs))

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        accum = self.accum
        scale = grad_average(self.loss_group)
        x, y = self._local(x, y)
        self.loss.start_step(y, self.loss_group, scale)
        self.aux.set(self.loss.aux_weight)
        total = torch.zeros((), device=y.device)
        for i, (xs, ys) in enumerate(zip(split_rows(x, accum), y.chunk(accum))):
            # Gradients are reduced across data-parallel ranks only on the last micro-step.
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 / replicate modules have it
                self.model.set_requires_gradient_sync(i == accum - 1)
            with self.loss.over_pieces():  # logits split by the vocabulary: forward, loss and backward inside
                with autocast(self.bf16, self.device):
                    loss = self.loss(self._forward(xs), ys)  # already a share of the global loss: no / accum
                loss.backward()
            total += loss.detach().float()
        return total / scale

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # In the training microbatches' size: the memory a step has room for.
        accum = self.accum
        x, y = self._local(x, y)
        scores = torch.zeros(3, dtype=torch.float64, device=y.device)
        with evaluating([self.model]):
            for xs, ys in zip(split_rows(x, accum), y.chunk(accum)):
                with autocast(self.bf16, self.device), self.loss.over_pieces():
                    scores += self.loss.score(self._forward(xs), ys)
        return scores

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model, max_norm)
