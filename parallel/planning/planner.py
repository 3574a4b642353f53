"""Memory before running: one training step of each rank role, under fake tensors and a fake process group.

# Note [planner]
`plan(cfg, world_size)` builds the configured model and strategy exactly as a
worker does (`parallel.trainer.build_run`), but under PyTorch's FakeTensorMode
(tensors with shapes, dtypes and storages, and no memory) and its "fake"
process-group backend (collectives that move nothing), and runs two training
steps (forward, backward, clipping, the optimizer step): the first makes the
optimizer state, the second holds it as every later step does. The peak is
the larger of the two, as the trainer's measured peak is over its steps. No GPU, no workers, no
real memory: a model far larger than this machine can be planned.

The step is counted by the same tracker that measures the trainer's
`mem_peak_bytes` on the CPU (`parallel.memory.tracker.LiveTensorBytes`: the
live tensor storages, each once), so prediction and measurement count the same
thing. At the peak the live storages are sorted into kinds:

    params       the model's parameters (FSDP's gathered ones included)
    grads        tensors that are some parameter's .grad
    optimizer    the optimizer's state
    activations  tensors autograd saved for backward
    temp         everything else (outputs, workspace, communication buffers)

and the phase (forward, backward, clip, optimizer) and the module running then
are recorded. What a checkpointed block keeps (its input, the outputs selective
recomputation caches, what its recomputation saves again) is held by torch's
checkpoint, not through autograd's saved-tensor hooks: it counts as temp.
Ranks that do the same work (every data- or tensor-parallel rank) are planned
once: the roles are one per pipeline stage.

`by_module` (plan.by_module=true) lists, for each module: its own parameters,
the bytes saved for backward while it ran (each storage once), and its
temporaries in forward (the most that was live while it ran, less what was
still live when it returned), largest first.

Where the fake world differs from the real one, the planner puts back what
the real one does. Through the run's `Runtime` (Note [runtime]), never by
patching the project: pipeline stages get their boundary shapes up front
(the shapes are exchanged between ranks at a real first step),
tensor-parallel stages the local ones, and every role computes the split
itself instead of receiving rank 0's; blocks are weighed by FLOPs, not timed;
DDP's reducer is replaced by a stand-in and its buckets added (to the
memory, and their all-reduce to the bytes sent: Note [comm bytes]); offload's
threads run inline and its tiers move nothing. Three places inside PyTorch
have no such seam and are patched while planning, in one module that says
why (parallel.torch_patches): a point-to-point send's work keeps its tensor
until the schedule drops the work, the schedule's warm-up exchange is
skipped, and meshes made while building are made outside the fake mode.
Waiting on a functional collective returns its output rather than the fake
kernel's copy. Gloo (a CPU run) reduce-scatters a copy of the whole input,
allocated inside the collective and split when it is waited on: while a
reduce-scatter runs, the plan holds one more storage of its input's size (on
a 125M Llama under data zero 3, the root's gradients: 197 MB, at the peak).
Each rank role is planned on its own thread (`parallel.tensors.in_own_thread`), so DTensor's
per-thread caches never hand one role the meshes of another.

Values from shapes (parallel.planning.shape_values): fake tensors hold no values, so
code that reads one must guess, and Hugging Face guesses on purpose. A fake
tensor counts as a trace, so its mask code does not read that the positions
are one unpacked sequence and builds the causal mask that a real run leaves to
SDPA's `is_causal`; with a mask, grouped keys and values are also repeated
before SDPA. Both are saved for backward (+6.6% on a small Llama, +1.4% on
GPT-2; the SDPA kernel, the CPU flash one, is the same in both runs). So `aten.arange` on the CPU, and the ops that take only its results,
run for real while planning (up to 2**20 elements an op): positions, and what
follows from them alone, are the same in every run, and the model reads them
as the real run does. Data, weights and random numbers stay fake.

A CUDA run (trainer.device=cuda, from any host) is planned on the CPU as
well, with what CUDA holds besides put back: Note [planning for CUDA] in
parallel/planning/cuda.py. Not covered: memory a strategy holds outside tensors.
"""
from __future__ import annotations

import contextlib
import tempfile
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import _disable_current_modes

from parallel.blocks import cut
from parallel.config import Config, cuda_run
from parallel.data import planned_data
from parallel.dims import ParallelDims, batch_mesh
from parallel.engine import own_optimizer
from parallel.flops import Flops
from parallel.init import Blank
from parallel.memory.tracker import LiveTensorBytes, state_tensors
from parallel.models.build import build_meta_model
from parallel.planning.allocator import reserved_of
from parallel.planning.comm import CommBytes
from parallel.planning.cuda import BLOCK, CudaAccount, allocated, cublas_workspace, foreach_as_on_cuda
from parallel.planning.depth import DEPTHS, block_list, extend, traced_whole
from parallel.planning.shape_values import ShapeValues
from parallel.planning.standins import CountingIO, DDPStandIn, InlineExecutor
from parallel.planning.work import Work, comm_bytes_of, step_work_of
from parallel.runtime import Runtime
from parallel.tensors import in_own_thread, local_bytes, plain_tensors, rank_optimizer
from parallel.torch_compat import settle_autograd_threads
from parallel.torch_patches import meshes_outside_fake, sends_held_by_their_works, static_pipeline_warmup
from parallel.trainer import build_run

KINDS = ("params", "grads", "optimizer", "activations", "temp")


@dataclass
class ModuleMemory:
    name: str
    type: str
    params: int = 0
    saved: int = 0
    temp: int = 0

    @property
    def total(self) -> int:
        return self.params + self.saved + self.temp


@dataclass
class RankPlan:
    rank: int
    same_as: list[int]  # the ranks with this rank's role
    params: int
    grads: int
    optimizer: int
    activations: int
    temp: int
    total: int
    peak_phase: str
    peak_module: str | None
    by_module: list[dict] = field(default_factory=list)
    # The work of the step, for strategy=auto's cost model (parallel.planning.auto):
    flops: int = 0  # forward + backward + optimizer, by torch's per-op formulas (Flops)
    ops: int = 0  # operators dispatched in the step (each costs a fixed overhead besides its FLOPs)
    comm_bytes: int = 0  # sent by collectives and point-to-point sends, as what leaves the rank (Note [comm bytes])
    all_to_all_bytes: int = 0  # of which all-to-alls send to other ranks (expert parallelism: Note [auto])
    io_bytes: int = 0  # moved to and from offload's tiers
    work: dict = field(default_factory=dict)  # the step's work as the cost model prices it (Note [step work])
    calls: dict = field(default_factory=dict, repr=False)  # the step's distinct op calls (Work.calls; not JSON)
    # the counts as tallied, of the two steps planned (Work.raw, comm bytes, DDP's buckets; not JSON): what a
    # plan extended by depth rebuilds `work` and `comm_bytes` from (Note [planning by depth])
    tally: dict = field(default_factory=dict, repr=False)
    # phase -> the most live in it (each kind, total, workspaces, rounding, module), of the two steps: the peak is
    # the largest; a plan extended by depth extends each and takes the largest (Note [planning by depth])
    phases: dict = field(default_factory=dict)
    # Planned for CUDA (Note [planning for CUDA] in parallel/planning/cuda.py), else 0 and empty:
    workspaces: int = 0  # cuBLAS workspaces live at the peak (in temp)
    rounding: int = 0  # what the caching allocator's 512-byte rounding adds at the peak (in the kinds)
    host_pinned: int = 0  # pinned host memory offload's cpu tier holds at most: the host's, not in total
    fp32_on_cuda: dict = field(default_factory=dict)  # op -> calls a step, run in fp32 as CUDA's autocast does
    reserved: int = 0  # max_memory_reserved: the caching allocator's segments (Note [caching allocator])
    reserved_expandable: int = 0  # the same with expandable_segments:True


class _PeakTracker(LiveTensorBytes):
    """Live tensor bytes, sorted into kinds at the peak, with the phase and module of the peak."""

    def __init__(self, device_type: str, model: nn.Module, optimizer, engine, cuda: CudaAccount | None = None):
        super().__init__(device_type, block=BLOCK if cuda is not None else 1)  # the caching allocator's rounding
        self.model, self.optimizer, self.engine = model, optimizer, engine
        self.cuda = cuda  # planned for CUDA: its workspaces and ops (Note [planning for CUDA])
        self.gloo = cuda is None  # the real run's process group is gloo (a CPU run)
        self.raw, self.workspaces = 0, 0  # at the peak: the storages' bytes unrounded, the cuBLAS workspaces'
        self.phase = "setup"
        self.modules: list[str] = []  # names of the modules running, innermost last
        self.saved: dict[int, weakref.ref] = {}  # storages autograd saved
        self.kinds = dict.fromkeys(KINDS, 0)
        self.peak_phase, self.peak_module = "setup", None
        self.watch: list[list[int]] = []  # [the most live since it began] per running module (forward)
        # phase -> the most live in it: {"peak", "kinds", "raw", "workspaces", "module"} (Note [planning by depth])
        self.phases: dict[str, dict] = {}
        self._holders = list(model.modules())  # whose parameter tables `_sort` reads

    def _update(self) -> None:
        current = self.current
        for frame in self.watch:
            frame[0] = max(frame[0], current)
        in_backward = self.phase == "forward" and torch._C._current_graph_task_id() != -1
        phase = "backward" if in_backward else self.phase
        best = self.phases.get(phase)
        if current <= self.peak and best is not None and current <= best["peak"]:
            return
        kinds, raw, workspaces = self._sort()
        module = self.modules[-1] if self.modules else None
        if best is None or current > best["peak"]:
            self.phases[phase] = {"peak": current, "kinds": kinds, "raw": raw, "workspaces": workspaces,
                                  "module": module}
        if current > self.peak:
            self.peak, self.peak_phase, self.peak_module = current, phase, module
            self.kinds, self.raw, self.workspaces = kinds, raw, workspaces

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.wait_tensor.default:
            # A real group's wait returns the collective's output; the fake one a copy (counted twice).
            return args[0]
        if self.cuda is not None:  # storages resized in place since the last op (FSDP's): Note [caching allocator]
            self.cuda.segments.sync()
        if func is torch.ops.c10d._reduce_scatter_base_.default and self.gloo:
            self._held_while_running(args[1])
        out = super().__torch_dispatch__(func, types, args, kwargs)
        made = self.cuda.see(func) if self.cuda is not None else None
        if made is not None:  # the thread's first cuBLAS call allocates its workspace
            self._add(made)
            self._update()
        return out

    def _add(self, t: torch.Tensor) -> None:
        super()._add(t)
        if self.cuda is not None and t.device.type == self.device_type:
            self.cuda.segments.add(t)  # a request of the caching allocator's, in the step's order

    def _held_while_running(self, t: torch.Tensor) -> None:
        """Gloo reduce-scatters a copy of the whole input: one more storage of its size while it runs."""
        with _disable_current_modes(), getattr(t, "fake_mode", None) or contextlib.nullcontext():
            copy = torch.empty_like(t)  # outside the counters: no op of the step
        self._add(copy)
        self._update()

    def _storages(self, tensors) -> set[int]:
        out = set()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for p in plain_tensors(t):
                    try:
                        out.add(id(p.untyped_storage()))
                    except (RuntimeError, NotImplementedError):
                        pass
        return out

    def _sort(self) -> tuple[dict[str, int], int, int]:
        """The live storages' bytes by kind, their bytes unrounded, the cuBLAS workspaces' bytes."""
        weights = [p for m in self._holders for p in m._parameters.values() if p is not None]  # FSDP2 swaps them
        params = self._storages(weights)
        grads = self._storages(p.grad for p in weights if p.grad is not None)
        opt = self._storages(t for s in rank_optimizer(self.optimizer).state.values() for t in s.values())
        own = own_optimizer(self.engine)
        opt |= self._storages(own.optimizer_tensors() if own is not None else [])
        workspaces = self._storages(self.cuda.workspaces.values()) if self.cuda is not None else set()
        kinds, raw, held, sizes, whole = dict.fromkeys(KINDS, 0), 0, 0, self._sizes, self.block == 1
        for key, ref in list(self._refs.items()):  # a storage dying meanwhile (a weakref's callback) is fine
            st = ref()
            if st is None:
                continue
            n = sizes[key]  # as `current` read it just now
            raw += n if whole else st.nbytes()
            held += n if key in workspaces else 0
            if key in params:
                kinds["params"] += n
            elif key in grads:
                kinds["grads"] += n
            elif key in opt:
                kinds["optimizer"] += n
            elif key in self.saved and self.saved[key]() is st:
                kinds["activations"] += n
            else:
                kinds["temp"] += n
        return kinds, raw, held

    def pack(self, t: torch.Tensor):
        for p in plain_tensors(t):
            try:
                st = p.untyped_storage()
                self.saved[id(st)] = weakref.ref(st)
            except (RuntimeError, NotImplementedError):
                pass
        return t


class _ModuleWatch:
    """Per module: own parameters, bytes saved for backward while it ran, forward temporaries."""

    def __init__(self, model: nn.Module, tracker: _PeakTracker):
        self.tracker = tracker
        self.names = {id(m): n or "(root)" for n, m in model.named_modules()}
        self.rows = {id(m): ModuleMemory(self.names[id(m)], type(m).__name__,
                                         params=sum(local_bytes(p) for p in m.parameters(recurse=False)))
                     for m in model.modules()}
        self.by_name = {r.name: r for r in self.rows.values()}
        self.params = tracker._storages(model.parameters())
        self.seen: dict[str, set[int]] = {}
        self.handles = []

    def __enter__(self):
        self.handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _pre(self, module, args):
        if id(module) not in self.names:
            return
        self.tracker.modules.append(self.names[id(module)])
        self.tracker.watch.append([self.tracker.current])

    def _post(self, module, args, output):
        if id(module) not in self.names or not self.tracker.watch:
            return
        (peak,) = self.tracker.watch.pop()
        self.tracker.modules.pop()
        row = self.rows[id(module)]
        row.temp = max(row.temp, peak - self.tracker.current)

    def record_saved(self, t: torch.Tensor) -> None:
        if not self.tracker.modules:
            return
        name = self.tracker.modules[-1]
        seen = self.seen.setdefault(name, set())
        for p in plain_tensors(t):
            try:
                st = p.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if id(st) not in seen and id(st) not in self.params:  # a saved weight is counted as a parameter
                seen.add(id(st))
                self.by_name[name].saved += st.nbytes()

    def table(self) -> list[ModuleMemory]:
        rows = [r for r in self.rows.values() if r.total > 0]
        return sorted(rows, key=lambda r: -r.total)


def roles(dims: ParallelDims) -> list[tuple[int, list[int]]]:
    """(the rank planned, the ranks sharing its role): one per pipeline stage; dp, ep, cp and tp ranks are
    alike (mesh order dp, ep, pp, cp, tp: Note [mesh dimensions] in parallel/dims.py)."""
    grid = torch.arange(dims.world_size).reshape(dims.shape).movedim(dims.names.index("pp"), 0)
    return [(int(ranks.flatten()[0]), ranks.flatten().tolist()) for ranks in grid]


def plan_rank(cfg: Config, dims: ParallelDims, rank: int, by_module: bool = False,
              run_dir: str | None = None, depth: tuple[str, int] | None = None, data=None) -> RankPlan:
    """One training step of `rank`, under fake tensors and a fake process group (Note [planner]); for a CUDA
    run, with what CUDA holds besides (Note [planning for CUDA] in parallel/planning/cuda.py). `depth`: the
    model's list of blocks and the blocks of it kept (Note [planning by depth])."""
    # The fake backend registers itself on import; it lives in torch's testing package (heavy: only here).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device, cuda = torch.device("cpu"), cuda_run(cfg.trainer.device)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        # Outside the fake mode: the mesh (its setup reads values) and the meta model (moving a model
        # built under the fake mode off meta fails), and the data (it reads values too).
        mesh = dims.build_mesh(device.type)
        model = build_meta_model(cfg.model)
        if depth is not None:
            cut(model, *depth)
        batch = batch_mesh(mesh)
        # Synthetic batches of the configured shapes, also for data=shards (whose manifest set them) and
        # data=custom (zeros shaped as its first sample): the plan reads no dataset.
        source = planned_data(cfg.data, cfg.trainer.seed, cfg.trainer.batch_size, batch.get_local_rank(),
                              batch.size(), spec=data)
        ddp, io = DDPStandIn(), CountingIO()
        runtime = Runtime(device=device, agree=lambda value: value, static_shapes=True, time_blocks=False,
                          executor=lambda workers, name: InlineExecutor(watched=cuda), replicate=ddp.replicate,
                          check_disk=False, offload_io=io,  # the plan may be for another machine's disk
                          values=Blank(),  # fake tensors hold no values
                          compile=False,  # planned as the eager run: Note [regional compilation]
                          target=torch.device("cuda") if cuda else None,
                          run_dir=None if run_dir is None else Path(run_dir),  # offload makes its directory there
                          data=data)
        settle_autograd_threads()  # before the step's backward on fake tensors: Note [autograd threads and fork]
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        account = CudaAccount(fake, cublas_workspace()[0]) if cuda else None
        with fake, ShapeValues(fake), static_pipeline_warmup(), sends_held_by_their_works(), meshes_outside_fake():
            run = build_run(cfg, dims, runtime, mesh=mesh, model=model, data=source)
            if cuda:
                foreach_as_on_cuda(run.optimizer, rank_optimizer(run.optimizer))
            # Two steps, each counted as the trainer counts a watched step: what exists at its start
            # (weights, optimizer state, the engine's buffers), plus what it makes. The first step makes
            # the optimizer state; the second holds it, as every later step does.
            flops, comm, work = Flops(), CommBytes(), Work()
            counted = [_count_step(run, step, (flops, comm, work), by_module, account) for step in (1, 2)]
            tracker, modules = max(counted, key=lambda tm: tm[0].peak)
            phases: dict[str, dict] = {}  # each phase's peak over the two steps
            for t, _ in counted:
                for name, row in t.phases.items():
                    if name not in phases or row["peak"] > phases[name]["peak"]:
                        phases[name] = row
            run.engine.close()
    finally:
        dist.destroy_process_group()
    return _rank_plan(rank, tracker, modules, flops, comm, work, ddp, io, account, phases)


def _rank_plan(rank: int, tracker, modules, flops, comm, work: Work, ddp: DDPStandIn, io: CountingIO,
               cuda: CudaAccount | None, phases: dict[str, dict]) -> RankPlan:
    """The RankPlan of a planned role: its peak step's breakdown, DDP's buckets added, and the work of a step
    (the mean of the two planned)."""
    k = dict(tracker.kinds)
    buckets = ddp.bucket_bytes()
    held = allocated(buckets) if cuda is not None else buckets
    k["grads"] += held

    def peak_row(row: dict) -> dict:  # a phase's peak as the plan's fields say it
        return {**row["kinds"], "grads": row["kinds"]["grads"] + held, "total": row["peak"] + held,
                "workspaces": row["workspaces"], "module": row["module"],
                "rounding": row["peak"] - row["raw"] + held - buckets if cuda is not None else 0}

    rows = [asdict(r) | {"total": r.total} for r in modules.table()] if modules is not None else []
    work.phase = "forward"  # DDP's copies run in the backward of each of the two steps counted
    for _ in range(2):
        ddp.copy_gradients(work)
    tally = {"work": work.raw(), "buckets": [list(b) for b in ddp.buckets()], "flops": flops.total,
             "ops": flops.ops, "comm": comm.bytes, "all_to_all": comm.all_to_all, "io": io.moved[0]}
    step_work = step_work_of(work, ddp.buckets())
    return RankPlan(rank=rank, same_as=[], params=k["params"], grads=k["grads"], optimizer=k["optimizer"],
                    activations=k["activations"], temp=k["temp"], total=tracker.peak + held,
                    peak_phase=tracker.peak_phase, peak_module=tracker.peak_module, by_module=rows,
                    flops=flops.total // 2, ops=flops.ops // 2,
                    comm_bytes=comm_bytes_of(comm.bytes // 2, ddp.buckets()), tally=tally,
                    all_to_all_bytes=comm.all_to_all // 2, io_bytes=io.moved[0] // 2, work=step_work,
                    calls={key: [n / 2, f, moved] for key, (n, f, moved) in work.calls.items()},
                    workspaces=tracker.workspaces, host_pinned=io.pinned[1],
                    phases={name: peak_row(row) for name, row in phases.items()},
                    rounding=tracker.peak - tracker.raw + held - buckets if cuda is not None else 0,
                    **reserved_of(cuda, ddp.bucket_sizes()),
                    fp32_on_cuda={k: n // 2 for k, n in cuda.fp32_on_cuda.items()} if cuda is not None else {})


def _count_step(run, step: int, counters, by_module: bool, cuda: CudaAccount | None = None):
    """One training step under a fresh tracker (and the module watch with `by_module`), counted by `counters`
    (dispatch modes: FLOPs, bytes sent, the step's work): (tracker, watch).
    `cuda`: planned for CUDA, the account of its workspaces (kept from the step that made them)."""
    tracker = _PeakTracker(run.device.type, run.engine.model, run.optimizer, run.engine, cuda=cuda)
    tracker.track(state_tensors(run.engine.model, run.optimizer))
    tracker.track(run.engine.kept_tensors())
    if cuda is not None:
        tracker.track(cuda.workspaces.values())
    modules = _ModuleWatch(run.engine.model, tracker) if by_module else None

    def pack(t):
        tracker.pack(t)
        if modules is not None:
            modules.record_saved(t)
        return t

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(_ModuleWatch(run.engine.model, tracker) if modules is None else modules)
        for counter in counters:
            stack.enter_context(counter)
        stack.enter_context(tracker)
        if cuda is not None:
            stack.enter_context(cuda.autocast_as_on_cuda())
        _phased_step(run, [tracker, *(c for c in counters if isinstance(c, Work))], step)
    return tracker, modules


def _phased_step(run, told: list, step: int) -> None:
    """parallel.trainer.train_step, with each of `told` (the tracker, the step's Work: objects with a `phase`)
    told which phase runs."""
    def phase(name: str) -> None:
        for t in told:
            t.phase = name

    phase("data")
    x, y = run.data.batch(step, run.device)  # inside the count, as in the trainer's measured step
    phase("forward")  # backward is told apart while it runs (autograd's graph task)
    run.engine.forward_backward(x, y)
    phase("clip")
    run.engine.clip(run.cfg.trainer.clip_grad_norm)
    phase("optimizer")
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def plan(cfg: Config, world_size: int, by_module: bool = False, data=None) -> list[RankPlan]:
    """A RankPlan per rank role (see `roles`); `cfg` must be validated for `world_size` (which resolves it);
    `data`: what was read from the data (parallel.data.spec.DataSpec; None: nothing read). A model of many
    blocks alike is traced at a few depths and its plan extended to its own (Note [planning by depth]) unless
    `plan.every_block`."""
    dims = ParallelDims.of(cfg.strategy, world_size)
    with contextlib.ExitStack() as stack:
        # Offload makes its (here empty) directory in the run's.
        run_dir = cfg.run_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="plan-"))
        found = None if traced_whole(cfg, dims, by_module) else block_list(build_meta_model(cfg.model))
        if found is not None:
            parent, blocks = found
            at = {d: _plan_roles(cfg, dims, run_dir, False, (parent, d), data) for d in DEPTHS}
            if (out := extend(at, len(blocks), parent)) is not None:
                return out
        return _plan_roles(cfg, dims, run_dir, by_module, None, data)


def _plan_roles(cfg: Config, dims: ParallelDims, run_dir: str, by_module: bool,
                depth: tuple[str, int] | None, data=None) -> list[RankPlan]:
    out = []
    for i, (rank, same) in enumerate(roles(dims)):
        p = in_own_thread("plan-rank", plan_rank, cfg, dims, rank, by_module=by_module and i == 0,
                          run_dir=run_dir, depth=depth, data=data)
        p.same_as = same
        out.append(p)
    return out
