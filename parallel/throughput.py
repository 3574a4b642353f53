"""Throughput against the limit, per logged step: tokens/s, the model's FLOPs, achieved TFLOP/s per rank, MFU.

# Note [throughput]
Counted once, before the first step, on the rank that logs:

    flops_per_step   model FLOPs of one training step over the global batch:
                     the forward and backward of the whole, unpartitioned model
                     (gradients only of the parameters that train), by torch's
                     per-op formulas (torch.utils.flop_counter, summed by
                     parallel.flops.Flops as the planner and strategy=auto sum
                     them) on meta tensors: no memory, no data. Model FLOPs, as
                     MFU is defined (PaLM, appendix B): blocks recomputed in
                     backward (strategy.activations=checkpoint or selective),
                     the loss, the optimizer step and communication are not
                     counted, and the count is the same whatever the strategy.
    peak             one device's FLOP/s at most (Note [peak FLOP/s] in
                     parallel/hardware.py): trainer.peak_flops, the table of known
                     GPUs, or on the CPU the matrix-product rate measured here.

and then, from each logged step's `step_time_s` (the mean over the steps since
the last log):

    tokens_per_s     (LM tasks) tokens of the global batch (batch x sequence
                     length, padding included) / step_time_s
    tflops_per_rank  flops_per_step / world size / step_time_s / 1e12: the mean
                     over the ranks (a pipeline's stages may do unequal shares)
    mfu              tflops_per_rank x 1e12 / peak
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.config import Config
from parallel.data import example_input
from parallel.flops import Flops
from parallel.hardware import cpu_peak, cuda_precision, gpu_peak
from parallel.loss import logits_of
from parallel.metrics import log
from parallel.models.build import build_meta_model
from parallel.tensors import call_model, faking, main_field

# How long the CPU's peak is measured for (the fastest of the products run in that time: parallel.hardware.cpu_peak).
CPU_BENCHMARK_S = 0.02


class Throughput:
    """The constants of a run's throughput figures (Note [throughput]), and each logged step's figures.

    Only the rank that logs counts anything; elsewhere `record` is empty.
    """

    def __init__(self, tokens_per_step: int | None = None, flops_per_step: int | None = None,
                 world_size: int = 1, peak: float | None = None, predicted: float | None = None):
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.world_size, self.peak, self.predicted = world_size, peak, predicted

    @classmethod
    def start(cls, cfg: Config, device: torch.device, is_logger: bool, run_dir: Path | None = None,
              data=None) -> Throughput:
        """Count the model's FLOPs and find the device's peak (logged once), and read the step time strategy=auto
        predicted for the run it started in `run_dir` (`auto_prediction`); an empty one off the logging rank.
        `data`: what was read from the data (parallel.data.spec.DataSpec), which the batch is shaped by."""
        if not is_logger:
            return cls()
        world = dist.get_world_size() if dist.is_initialized() else 1
        # An LM batch is token ids, (batch, sequence): its elements are the tokens.
        x = example_input(cfg.data, cfg.trainer.batch_size, spec=data)
        tokens = main_field(x).numel() if cfg.data.task == "lm" else None
        flops = model_flops(cfg, data)
        peak, source = device_peak(cfg, device)
        log.info("throughput: %s; device peak %s", "model FLOPs not counted" if flops is None else
                 f"{flops:.4g} model FLOPs per step (forward + backward of the global batch)",
                 f"{peak / 1e12:.4g} TFLOP/s ({source})" if peak else f"unknown ({source})")
        return cls(tokens, flops, world, peak, auto_prediction(run_dir) if run_dir is not None else None)

    def record(self, step_time: float) -> dict:
        """The figures of a logged step whose mean step time is `step_time` seconds."""
        out = {}
        if self.tokens_per_step is not None:
            out["tokens_per_s"] = self.tokens_per_step / step_time
        if self.flops_per_step is not None:
            achieved = self.flops_per_step / self.world_size / step_time  # FLOP/s of one rank
            out.update(flops_per_step=self.flops_per_step, tflops_per_rank=achieved / 1e12)
            if self.peak:
                out["mfu"] = achieved / self.peak
        if self.predicted is not None:
            out["predicted_step_time_s"] = self.predicted
        return out


def auto_prediction(run_dir: Path) -> float | None:
    """The step time strategy=auto predicted for the candidate it started (Note [cost model] in
    parallel/planning/cost.py), as launch/train.py wrote it into the run's auto.json; None for a run auto did not
    choose."""
    path = Path(run_dir) / "auto.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("predicted_step_time_s")


def text(record: dict) -> str:
    """The throughput figures of `record` for the log line ('' when it has none)."""
    parts = []
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:.0f} tokens/s")
    if "tflops_per_rank" in record:
        parts.append(f"{record['tflops_per_rank']:.3g} TFLOP/s per rank")
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.3g}%")
    return "".join(f"  {p}" for p in parts)


def postfix(record: dict) -> dict:
    """The throughput figures of `record` for the progress bar."""
    out = {}
    if "tokens_per_s" in record:
        out["tokens_s"] = f"{record['tokens_per_s']:.0f}"
    if "mfu" in record:
        out["mfu"] = f"{100 * record['mfu']:.3g}%"
    return out


def model_flops(cfg: Config, data=None) -> int | None:
    """Model FLOPs of a forward and backward over one global batch (Note [throughput]; `data`: the DataSpec it
    is shaped by); None, with a warning, for a model that cannot run on meta or fake tensors (one that reads
    its input's values)."""
    model = build_meta_model(cfg.model).train()
    x = example_input(cfg.data, cfg.trainer.batch_size, spec=data)
    try:
        return _counted(model, x)
    except Exception:  # noqa: BLE001 - meta tensors hold no values: retried as fake ones below
        pass
    # A library that tests its inputs' values (Hugging Face's masks) takes its tracing path on fake tensors.
    try:
        with faking():
            return _counted(model, x)
    except Exception as e:  # noqa: BLE001 - the figures are a report: the run goes on without them
        log.warning("throughput: the model's FLOPs could not be counted on fake tensors (%s: %s); no "
                    "flops_per_step, tflops_per_rank or mfu", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def _counted(model: torch.nn.Module, x) -> int:
    counter = Flops()
    with counter:
        out = logits_of(call_model(model, x))
        trained = [p for p in model.parameters() if p.requires_grad]
        # The input gradient of the first layer is not needed (token ids have none), as in training.
        torch.autograd.grad(out.float().sum(), trained, allow_unused=True)
    return counter.total


def device_peak(cfg: Config, device: torch.device) -> tuple[float | None, str]:
    """One device's peak FLOP/s and where it comes from (Note [peak FLOP/s] in parallel/hardware.py)."""
    if cfg.trainer.peak_flops is not None:
        return float(cfg.trainer.peak_flops), "trainer.peak_flops"
    if device.type == "cuda":
        return _cuda_peak(cfg, device)
    threads, peak = torch.get_num_threads(), cpu_peak(CPU_BENCHMARK_S)
    return peak, f"measured: fp32 matrix products, {peak / threads / 1e9:.1f} GFLOP/s per thread x {threads}"


def _cuda_peak(cfg: Config, device: torch.device) -> tuple[float | None, str]:
    # bf16 as parallel.engine.autocast decides it: CUDA with trainer.precision auto or bf16.
    column = cuda_precision(cfg.trainer.precision in ("auto", "bf16"))
    name = torch.cuda.get_device_name(device)
    peak = gpu_peak(name, column)
    if peak is None:
        log.warning("throughput: no %s peak known for %r; no mfu logged (give the device's peak FLOP/s as "
                    "trainer.peak_flops)", column, name)
    return peak, f"{name}, {column}"
