"""The pipeline's engine (Note [engine contract] in parallel/engine.py): one step through PyTorch's schedule.

`build_pipeline` is the strategy: split (split.py) -> this rank's stages
(stages.py) -> the engine. The engine runs the schedule over a batch, sums the
gradients of weights tied across stages, takes the gradient norm over every
stage, gathers the unpartitioned weights, and reports the pipeline's metrics
from the compute time its stages record (stages.TimedStage).
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from parallel.aux_weight import AuxWeights
from parallel.config import Config, bf16_run
from parallel.dims import batch_mesh, data_mesh
from parallel.engine import Engine, evaluating, grad_average
from parallel.init import InitPlan
from parallel.loss import Loss, build_loss
from parallel.metrics import gather_floats, log
from parallel.optim import clip_grads
from parallel.runtime import Runtime
from parallel.strategies.compile import compiling
from parallel.strategies.expert import clip_with_experts
from parallel.strategies.pipeline import schedules
from parallel.strategies.pipeline.split import Split, example_microbatch, format_split, microbatches, plan_split
from parallel.strategies.pipeline.stages import ComputeTime, TiedCopy, TimedStage, build_stages, own_blocks
from parallel.strategies.pipeline.timeline import Timeline
from parallel.strategies.recompute import recomputing
from parallel.tensors import local
from parallel.torch_patches import forward_only_actions


def build_pipeline(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime, plan: InitPlan,
                   transform=None, shape_transform=None, sequence=None) -> "PipelineEngine":
    """Split `model` (on meta) into stages over the mesh's pp dimension; return this rank's engine.

    Args:
        transform: `(stage, blocks) -> None`, applied to each of this rank's
            stages (on meta, the model's own block modules swapped in, or the
            traced ones for nested blocks: Note [own or traced blocks] in stages.py) before
            it is materialized: how strategy=hybrid adds tensor and data
            parallelism. None keeps the traced stages as they are.
        shape_transform: `stage -> None`, the part of `transform` that changes
            the shapes crossing stages (tensor parallelism: a stage may end in
            a sharded layer). Used only when the shapes are given up front
            (`runtime.static_shapes`), where every stage is shaped on a copy.
        sequence: context parallelism's layout (strategy=hybrid; `transform` points the stages' attention at
            the cp ranks): the engine hands the first stage this rank's chunks of every sequence and their
            positions, and the last stage the matching targets.
    """
    s, dp = cfg.strategy, batch_mesh(mesh).size()
    split = plan_split(model, cfg, dp, runtime)
    log.info("pipeline partition (%s, %d microbatches):\n%s", s.schedule, s.microbatches, format_split(split))
    compute_time = ComputeTime()
    compiles = compiling(cfg, runtime)
    swap = (transform or compiles) and own_blocks(model, split.blocks)  # Note [own or traced blocks]
    stages, modules, tied = build_stages(
        split, mesh, runtime, plan, compute_time, schedules.stage_ranks(s.schedule, s.pp, s.stages_per_rank),
        example_microbatch(cfg, dp, runtime.data), bf16=bf16_run(cfg), recompute=recomputing(cfg), compiles=compiles,
        model=model if swap else None, transform=transform, shape_transform=shape_transform)
    groups: dict[str, list[str]] = {}
    for name, entry in plan.items():
        groups.setdefault(entry.canonical, []).append(name)
    tied_names = [names for names in groups.values() if len(names) > 1]
    loss = build_loss(cfg.loss, cfg.data.task)
    return PipelineEngine(s.schedule, microbatches(cfg), s.stages_per_rank, mesh, split, stages, modules, tied, loss,
                          tied_names, compute_time, sequence)


class PipelineEngine(Engine):
    """One training step through a pipeline schedule, and the pipeline's own metrics.

    Args:
        schedule: the schedule's name (strategy.schedule).
        microbatches: the microbatches of a step (strategy.microbatches, resolved).
        stages_per_rank: the stages each pp rank holds (strategy.stages_per_rank).
        mesh: the run's mesh (pp: the stages' ranks; the data-parallel ranks share the loss).
        stages: this rank's stages, each timing its compute into `compute_time`.
        modules: their modules (what the optimizer sees).
        tied: this rank's copies of weights tied across stages.
        loss: the run's loss (Note [global loss] in parallel/loss.py).
        tied_names: every group of parameter names that share one weight.
        sequence: context parallelism's layout (parallel.strategies.context.SequenceShard); None: whole
            sequences.
    """

    def __init__(self, schedule: str, microbatches: int, stages_per_rank: int, mesh: DeviceMesh, split: Split,
                 stages: list[TimedStage], modules, tied: list[TiedCopy], loss: Loss, tied_names: list[list[str]],
                 compute_time: ComputeTime, sequence=None):
        self.sequence = sequence
        self.tied_names = tied_names
        self.schedule_name, self.stages_per_rank = schedule, stages_per_rank
        self.mesh, self.split, self.stages, self.tied = mesh, split, stages, tied
        self.model = nn.ModuleList(modules)  # what the optimizer and the memory watch see
        self.aux = AuxWeights(modules)  # Note [auxiliary weight] in parallel/aux_weight.py
        self.m = microbatches
        cls = schedules.schedule_class(schedule)
        multi = schedules.is_multi_stage(schedule)
        # scale_grads=False: the loss is already each microbatch's share of the global loss (Note [global
        # loss]); the schedule's default divides the gradients by the microbatch count, for a per-microbatch mean.
        self.loss = loss
        self.scores: torch.Tensor | None = None  # while evaluating: what the last stage has scored so far
        self.schedule = cls(stages if multi else stages[0], n_microbatches=self.m, loss_fn=self._loss,
                            scale_grads=False)
        self.has_first = any(st.is_first for st in stages)
        self.has_last = any(st.is_last for st in stages)
        self.holds_loss = self.has_last
        self.loss_group = data_mesh(mesh).get_group()  # Note [mesh dimensions] in parallel/dims.py
        self.pp_group = mesh["pp"].get_group()
        self.compute_time = compute_time
        self.step_time = 0.0
        self.window: list[tuple[float, float, dict]] = []  # (compute, schedule time, compute per stage) per step
        self.timeline = Timeline(f"{schedule}, {self.m} microbatches")  # Note [pipeline timeline]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Run the schedule over the batch; returns this rank's part of the global loss (0 off the last
        stage)."""
        losses: list[torch.Tensor] = []
        args, y = self._local(x, y)
        # Every stage reads the batch, so each counts the targets itself; only the last one uses the count.
        scale = grad_average(self.loss_group)
        self.loss.start_step(y, self.loss_group, scale)
        self.aux.set(self.loss.aux_weight)
        self.compute_time.reset()
        t0 = time.perf_counter()
        self.schedule.step(*args, target=y if self.has_last else None, losses=losses, return_outputs=False)
        t1 = time.perf_counter()
        self.step_time = t1 - t0
        self.window.append((self.compute_time.total, self.step_time, dict(self.compute_time.per_stage)))
        self.timeline.record(t0, t1, self.compute_time.chunks)
        self._sum_tied_grads()
        if not losses:
            return torch.zeros((), device=x.device)
        return torch.stack([l.detach().float() for l in losses]).sum() / scale

    def _local(self, x: torch.Tensor, y: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """The first stage's inputs (none on other stages) and the targets, cut to this rank's chunks of every
        sequence under context parallelism, with the chunks' positions, one row per sample so the schedule
        splits them into microbatches with the tokens (Note [context parallelism under the pipeline])."""
        if self.sequence is None:
            # Contiguous: torch 2.11 checks the first stage's input strides against its example's, and a batch
            # may be a view (tokens cut from longer rows).
            return ((x.contiguous(),) if self.has_first else ()), y
        x, y = self.sequence.shard(x), self.sequence.shard(y)
        positions = self.sequence.position_ids(x).expand(x.shape[0], -1).contiguous()
        return ((x, positions) if self.has_first else ()), y

    def _loss(self, out, target) -> torch.Tensor:
        """The schedule's loss function: a microbatch's share of the loss, or its scores while evaluating."""
        if self.scores is None:
            return self.loss(out, target)
        self.scores += self.loss.score(out, target)
        return torch.zeros((), device=self.scores.device)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only through the schedule's own evaluation path (`eval`: its microbatches without
        backward; the stages set up their send and receive buffers again for it, and again at the next
        training step); the last stage scores each microbatch."""
        self.scores = torch.zeros(3, dtype=torch.float64, device=x.device)
        args, y = self._local(x, y)
        v_shaped = self.schedule_name in schedules.V_SHAPED
        try:
            with evaluating(list(self.model)), forward_only_actions(self.schedule) if v_shaped else nullcontext():
                self.schedule.eval(*args, target=y if self.has_last else None)
            return self.scores
        finally:
            self.scores = None

    def _sum_tied_grads(self) -> None:
        for t in self.tied:
            # Every copy is placed alike (same tensor and data parallel layout at
            # the same mesh position), so summing the local pieces sums the whole.
            grads = [local(p.grad) for p in t.params if p.grad is not None]
            if not grads:
                continue
            total = torch.stack(grads).sum(0)
            if t.group is not None:
                dist.all_reduce(total, group=t.group)
            for g in grads:
                g.copy_(total)

    def kept_tensors(self) -> list[torch.Tensor]:
        """The stages' receive buffers (activations and their gradients, one per microbatch): made at the
        first step and kept, so the memory watch counts them from the start of each later step."""
        out = []
        for st in self.stages:
            for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
                out += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
        return out

    @torch.no_grad()
    def clip(self, max_norm: float) -> torch.Tensor:
        """Global grad norm over all stages (a tied weight counted once), clipped when max_norm > 0."""
        skip = {id(p) for t in self.tied for i, p in enumerate(t.params) if not (t.owner and i == 0)}
        if self.mesh["ep"].size() > 1:  # experts differ across the ep ranks (Note [expert parallelism])
            return clip_with_experts(list(self.model), max_norm, self.mesh["ep"].get_group(), self.pp_group, skip)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        counted = [p.grad for p in self.model.parameters() if p.grad is not None and id(p) not in skip]
        return clip_grads(grads, max_norm, counted=counted, sum_group=self.pp_group)

    def state_modules(self) -> list[nn.Module]:
        """This rank's stages: their state dicts hold the original names (parallel.checkpoint)."""
        return list(self.model)

    def full_state_dict(self) -> dict:
        """Every stage's tensors under their original names, gathered on global rank 0.

        A weight tied across stages appears under each of its names, as in the
        unpartitioned model's state dict.
        """
        # A DTensor (tensor or data parallel piece) is gathered whole over its own mesh first.
        mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                for m in self.model for k, v in m.state_dict().items()}
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return {}
        state = {}
        for part in parts:
            state.update(part)
        for names in self.tied_names:
            present = [n for n in names if n in state]
            for n in names:
                if present and n not in state:
                    state[n] = state[present[0]]
        return state

    def metrics(self) -> dict:
        """Bubble (measured and analytic), stage imbalance, the timeline picture; collective over all ranks."""
        pp, per_rank = self.mesh["pp"].size(), self.stages_per_rank
        # The median step since the last log: the trainer's memory watch slows
        # the steps it watches (a dispatch per op), and the median ignores them.
        window = sorted(self.window, key=lambda w: w[1])
        compute, self.step_time, per_stage_compute = window[len(window) // 2]
        self.window = []
        busy = gather_floats([compute, self.step_time])
        bubbles = [max(0.0, 1 - b / t) if t > 0 else 0.0 for b, t in zip(busy[0::2], busy[1::2])]
        per_stage = [0.0] * (pp * per_rank)
        for idx, t in per_stage_compute.items():
            per_stage[idx] = t
        stage_times = gather_floats(per_stage)
        totals = [sum(stage_times[i::len(per_stage)]) for i in range(len(per_stage))]
        mean = sum(totals) / len(totals)
        return {"bubble_measured": sum(bubbles) / len(bubbles), "bubble_measured_per_rank": bubbles,
                "bubble_analytic": schedules.analytic_bubble(self.schedule_name, pp, per_rank, self.m),
                "stage_imbalance": max(totals) / mean if mean > 0 else 1.0,
                "schedule_time_s": self.step_time,
                "stage_time_s_per_stage": totals,
                "pipeline_timeline": self.timeline.gather()}
