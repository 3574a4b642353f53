"""What a device can do at most: known GPUs' peak FLOP/s, and the CPU's matrix-product rate measured here.

# Note [peak FLOP/s]
MFU (parallel.throughput) divides the FLOP/s a rank achieves by its device's
peak. For a GPU the peak comes from the table below: the vendor's dense
(no 2:4 sparsity) tensor-core figure for the run's precision, found by the
name `torch.cuda.get_device_name` gives. A run in bf16 (CUDA's default,
`trainer.precision=auto`) is held against the bf16 column; an fp32 run
against the TF32 column when PyTorch lets fp32 matrix products use TF32
(`torch.set_float32_matmul_precision("high")`), else plain fp32. A GPU not in
the table, or a precision it has no figure for, has no peak: the run warns
and logs no MFU rather than a wrong one; `trainer.peak_flops` gives it (and
overrides the table). On the CPU, which has no published figure, the peak is
measured in the worker at start (`cpu_peak`): the rate of the fastest of a
few float32 matrix products on one thread (the CPU trains in fp32), times
the worker's thread count.

# Note [hardware profiles]
`hardware=NAME` (conf/hardware/NAME.yaml, schema parallel.config.HardwareConfig)
says what a plan's step time is priced on. `cpu`, the default, is this host,
measured as launch/plan.py always has (plan.calibration, or this process at
start: Note [cost model] in parallel/planning/cost.py). A GPU profile (h100,
h100_96gb, h200, a100, b200, or one launch/calibrate.py trainer.device=cuda
wrote) holds a device's figures: dense peak FLOP/s by precision, SMs, memory
and its bandwidth, power, devices per node, the link inside a node (NVLink),
across nodes (per device) and to the host (PCIe), each with its bandwidth per
direction and the latency of a collective's step; and, written by
calibrate.py, measured product rates by shape. Each value's source is beside
it in its file: the vendor's datasheets, NCCL's tuner constants for
latencies, and this project's own measurements (benchmarks/results/gpu*.json:
the memory torch sees, the host link's copy rate) where it has them; none is
fitted to a training run. The step is then priced from its work without
running anything (Note [step time on a profile] in
parallel/planning/on_profile.py). A GPU profile prices a CUDA run:
trainer.device=auto means cuda under it, trainer.device=cpu is refused, and
memory.budget defaults to the profile's memory and may not exceed it
(`check_hardware`).
"""
from __future__ import annotations

import os
import re
import time

import torch

from parallel.config import Config, HardwareConfig, fail
from parallel.units import human_bytes, parse_bytes

# (pattern searched in the device name, bf16, tf32, fp32 peak FLOP/s), dense; the first match wins, so a
# variant comes before the name it extends. Sources: the vendors' datasheets.
GPU_PEAKS: list[tuple[str, float | None, float | None, float | None]] = [
    (r"H100.*NVL", 835e12, 417.5e12, 60e12),
    (r"H100.*PCIe", 756e12, 378e12, 51.2e12),
    (r"H100", 989.4e12, 494.7e12, 66.9e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"H200.*NVL", 835e12, 417.5e12, 60e12),
    (r"H200", 989.4e12, 494.7e12, 66.9e12),  # SXM, and GH200's GPU
    (r"B200", 2250e12, 1100e12, None),
    (r"A100", 312e12, 156e12, 19.5e12),  # SXM and PCIe alike
    (r"\bA10G?\b", 125e12, 62.5e12, 31.2e12),  # A10G: AWS's A10, rated as the A10
    (r"\bL40S\b", 362.05e12, 183e12, 91.6e12),
    (r"\bL40\b", 181.05e12, 90.5e12, 90.5e12),
    (r"\bL4\b", 121e12, 60e12, 30.3e12),
    (r"V100S", None, None, 16.4e12),  # Volta has no bf16 or tf32 units
    (r"V100.*PCIE", None, None, 14e12),
    (r"V100", None, None, 15.7e12),
    (r"RTX 4090", 165.2e12, 82.6e12, 82.6e12),  # tensor cores with fp32 accumulation
    (r"RTX 3090", 71e12, 35.6e12, 35.6e12),
    (r"MI300X", 1307.4e12, 653.7e12, 163.4e12),
    (r"MI250X", 191.5e12, None, 47.9e12),  # one GCD: what torch sees as one device
]
COLUMNS = ("bf16", "tf32", "fp32")
PROFILE_DEVICES = ("cpu", "cuda")


def gpu_profile(cfg: Config) -> HardwareConfig | None:
    """The run's GPU profile (Note [hardware profiles]); None for hardware=cpu, this host measured."""
    return cfg.hardware if cfg.hardware.device == "cuda" else None


def profile_precision(cfg: Config) -> str:
    """The peak a run's products are held to: bf16 under autocast, else tf32 or fp32 as torch lets fp32
    products run (Note [peak FLOP/s])."""
    t = cfg.trainer
    return cuda_precision(t.precision in ("auto", "bf16"))


def check_hardware(cfg: Config, world: int) -> None:
    """The hardware group against the run (Note [hardware profiles]): a GPU profile complete for the run's
    precision and world size, a CUDA run (trainer.device=auto becomes cuda), memory.budget within its memory.

    Raises:
        ConfigError: naming the key, the value and the options.
    """
    hw = cfg.hardware
    if hw.device not in PROFILE_DEVICES:
        fail("hardware.device", hw.device, "the kind of device the profile describes", list(PROFILE_DEVICES))
    if hw.device == "cpu":
        return
    if cfg.trainer.device == "cpu":
        fail("hardware", hw.name, "a GPU profile prices a CUDA run, and trainer.device=cpu runs on the CPU",
             ["trainer.device=cuda", "hardware=cpu (this host)"])
    cfg.trainer.device = "cuda"
    for key in ("memory_bytes", "memory_bandwidth", "sms"):
        if not getattr(hw, key):
            fail(f"hardware.{key}", getattr(hw, key), f"hardware={hw.name} needs it to price a step", ["> 0"])
    if hw.devices_per_node < 1:
        fail("hardware.devices_per_node", hw.devices_per_node, "must be an integer >= 1")
    column = profile_precision(cfg)
    if not hw.peak_flops.get(column):
        fail(f"hardware.peak_flops.{column}", hw.peak_flops.get(column), f"hardware={hw.name} has no {column} "
             f"peak for this run's products (trainer.precision={cfg.trainer.precision})",
             sorted(k for k, v in hw.peak_flops.items() if v))
    if world > 1 and not hw.node_link.bandwidth:
        fail("hardware.node_link.bandwidth", hw.node_link.bandwidth, f"nproc={world}: collectives need it", ["> 0"])
    if world > hw.devices_per_node and not hw.network.bandwidth:
        fail("hardware.network.bandwidth", hw.network.bandwidth, f"nproc={world} spans nodes of "
             f"{hw.devices_per_node}: collectives across them need it", ["> 0"])
    if cfg.memory.budget is not None and parse_bytes(cfg.memory.budget) > hw.memory_bytes:
        fail("memory.budget", cfg.memory.budget, f"above hardware={hw.name}'s memory, {human_bytes(hw.memory_bytes)}"
             f" ({hw.memory_bytes} bytes)", [f"<= {hw.memory_bytes}", "unset: the profile's memory"])


def gpu_peak(name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of the GPU called `name` in `precision` (bf16, tf32 or fp32); None when the
    table does not know it (Note [peak FLOP/s])."""
    for pattern, *peaks in GPU_PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return peaks[COLUMNS.index(precision)]
    return None


def cuda_precision(bf16: bool) -> str:
    """The table column of a CUDA run: bf16 under autocast, else tf32 when fp32 products may use it."""
    if bf16:
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def cpu_peak(seconds: float = 0.02, size: int = 512) -> float:
    """The CPU's peak float32 matrix-product FLOP/s for this process: one thread's fastest product, timed by
    that thread's CPU time, times the process's thread count (Note [peak FLOP/s]).

    Timed on one thread by its CPU time, a product is not slowed by other processes taking the core for
    a moment (on a machine shared by a run's workers, the wall time of any product may be); the thread
    count scales it to what the process's threads could do at most.
    """
    threads = torch.get_num_threads()
    # A generator of its own: the run's random numbers (dropout, data) stay those of a run without this.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    torch.set_num_threads(1)  # the product runs on this thread alone, so this thread's CPU time is its time
    try:
        out = a @ b
        n, best, t0 = 0, float("inf"), time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < seconds:
            t = time.thread_time()
            torch.mm(a, b, out=out)
            best = min(best, time.thread_time() - t)
            n += 1
    finally:
        torch.set_num_threads(threads)
    return threads * 2 * size ** 3 / best


def worker_threads(local_workers: int) -> int | None:
    """The torch threads of each of `local_workers` (> 1) CPU workers on this machine: torch's own count shared
    out (at least one each), as torchrun's OMP_NUM_THREADS=1 does for several workers, so that workers do not
    run more threads than there are cores (small matrix products slow down many times over when threads wait
    on a core); None for one worker (torch's count stands), or when OMP_NUM_THREADS is set (the user's)."""
    if os.environ.get("OMP_NUM_THREADS") or local_workers <= 1:
        return None
    return max(1, torch.get_num_threads() // local_workers)


def last_level_cache(default: int = 32 << 20) -> int:
    """Bytes of the CPU's largest cache (Linux's sysfs: the highest cache index of cpu0), else `default`."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        sizes = []
        for entry in os.listdir(base):
            if entry.startswith("index"):
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
                sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]]
                             if text[-1] in "KMG" else int(text))
        return max(sizes) if sizes else default
    except (OSError, ValueError):
        return default
