"""launch/calibrate.py trainer.device=cuda: a hardware profile of the GPU it runs on, as conf/hardware/*.yaml holds
them (Note [hardware profiles] in parallel/hardware.py), for launch/plan.py --config-dir DIR hardware=NAME.

Measured on the GPU (`measure_gpu`): bf16 products of the shapes a transformer's layers make (GEMM_SHAPES:
tokens x out x in), the memory's bandwidth (a copy of 1 GiB, read and written), the host link's (pinned copies
of 256 MiB each way, one at a time: the slower), the memory torch sees and the SM count. From the device's name:
its dense peaks (parallel.hardware.GPU_PEAKS, the table the logged MFU uses); its links, devices per node and
fp8 peak from the built-in profile of the same GPU when there is one (conf/hardware/*.yaml, by its `gpu`), else
left unset: a plan over several devices then asks for them (parallel.hardware.check_hardware). Each value's
source is written beside it. The measuring needs a GPU; writing the file (`profile_text`) does not.
"""
from __future__ import annotations

import datetime
import json
import platform
import re
from pathlib import Path

import torch
from omegaconf import OmegaConf

from parallel.hardware import COLUMNS, gpu_peak
from parallel.planning.calibration import _timed

GEMM_SHAPES = tuple((m, n, k) for m in (512, 2048, 8192, 16384) for n in (1024, 4096, 8192) for k in (1024, 4096, 8192))
LINKS = ("node_link", "network", "host_link")


def slug(name: str) -> str:
    """A profile's name from a device's: `NVIDIA H100 80GB HBM3` -> `nvidia_h100_80gb_hbm3`."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def measure_gpu(device: torch.device, seconds: float = 0.05) -> dict:
    """What launch/calibrate.py measures of the GPU `device` (see the module's docstring)."""
    props = torch.cuda.get_device_properties(device)
    gemm = {f"{m}x{n}x{k}": _product_rate(device, m, n, k, seconds) for m, n, k in GEMM_SHAPES}
    memory = _copy_rate(torch.empty(1 << 29, device=device, dtype=torch.int16), device, seconds)  # 1 GiB
    host = torch.empty(1 << 27, dtype=torch.int16, pin_memory=True)  # 256 MiB
    on_device = torch.empty(1 << 27, dtype=torch.int16, device=device)
    h2d = host.nbytes / _timed(lambda: on_device.copy_(host, non_blocking=True), device, seconds)
    d2h = host.nbytes / _timed(lambda: host.copy_(on_device, non_blocking=True), device, seconds)
    return {"gpu": torch.cuda.get_device_name(device), "sms": props.multi_processor_count,
            "memory_bytes": props.total_memory, "memory_bandwidth": memory, "host_bandwidth": min(h2d, d2h),
            "devices_per_node": torch.cuda.device_count(), "gemm": gemm,
            "measured": f"launch/calibrate.py on {platform.node()}, {datetime.date.today().isoformat()}, torch "
                        f"{torch.__version__}"}


def _product_rate(device: torch.device, m: int, n: int, k: int, seconds: float) -> float:
    """FLOP/s of a bf16 product of M x K by K x N on `device`."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    return 2 * m * n * k / _timed(lambda: torch.mm(a, b, out=out), device, seconds)


def _copy_rate(src: torch.Tensor, device: torch.device, seconds: float) -> float:
    """Bytes/s read and written by a device copy of `src`."""
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _timed(lambda: dst.copy_(src), device, seconds)


def known_profile(gpu: str, conf: Path) -> tuple[str, dict] | None:
    """(its name, its values) of the built-in profile (conf/hardware/*.yaml) of the GPU named `gpu`; None."""
    for path in sorted((conf / "hardware").glob("*.yaml")):
        values = OmegaConf.to_container(OmegaConf.load(path))
        if values.get("gpu") == gpu:
            return path.stem, values
    return None


def profile_text(measured: dict, known: tuple[str, dict] | None = None) -> str:
    """A profile's YAML (the conf/hardware shape) from what `measure_gpu` measured and the built-in profile of the
    same GPU, each value with its source."""
    gpu = measured["gpu"]
    here = "measured"
    base, values = known if known is not None else (None, {})
    lines = [f"# {gpu}, measured by {measured['measured']} (\"measured\" below); the rest from its name and",
             f"# {f'conf/hardware/{base}.yaml' if base else 'no built-in profile'}. Use it with launch/plan.py "
             f"--config-dir DIR hardware={slug(gpu)}, DIR",
             f"# the folder that holds hardware/{slug(gpu)}.yaml (Note [hardware profiles] in parallel/hardware.py).",
             f"name: {slug(gpu)}", "device: cuda", f"gpu: {json.dumps(gpu)}", "peak_flops:"]
    for column in COLUMNS:
        peak = gpu_peak(gpu, column)
        if peak:
            lines.append(f"  {column}: {peak:.6g}  # from the name: parallel/hardware.py GPU_PEAKS (datasheets)")
    fp8 = values.get("peak_flops", {}).get("fp8")
    if fp8:
        lines.append(f"  fp8: {fp8:.6g}  # conf/hardware/{base}.yaml")
    lines += [f"sms: {measured['sms']}  # {here}: torch's multi_processor_count",
              f"memory_bytes: {measured['memory_bytes']}  # {here}: torch.cuda total_memory",
              f"memory_bandwidth: {measured['memory_bandwidth']:.6g}  # {here}: a 1 GiB device copy, read and written"]
    if values.get("power_w"):
        lines.append(f"power_w: {values['power_w']}  # conf/hardware/{base}.yaml")
    per_node = values.get("devices_per_node", measured["devices_per_node"])
    lines.append(f"devices_per_node: {per_node}  # "
                 + (f"conf/hardware/{base}.yaml" if base else f"{here}: the GPUs this node shows"))
    for link in LINKS:
        given = dict(values.get(link) or {})
        if link == "host_link":
            given["bandwidth"] = measured["host_bandwidth"]
        if not given:
            lines.append(f"{link}: {{}}  # unknown: set hardware.{link}.bandwidth and .latency for runs over several "
                         f"devices")
            continue
        lines.append(f"{link}:")
        for key in ("kind", "generation", "bandwidth", "latency"):
            if given.get(key) is not None:
                value = given[key]
                source = (f"{here}: pinned copies of 256 MiB, one direction at a time, the slower"
                          if link == "host_link" and key == "bandwidth" else f"conf/hardware/{base}.yaml")
                text = f"{value:.6g}" if isinstance(value, float) else json.dumps(value)
                lines.append(f"  {key}: {text}  # {source}")
    lines.append(f"gemm:  # {here}: bf16 products M x N x K (tokens x out x in) -> FLOP/s")
    lines += [f"  {shape}: {rate:.6g}" for shape, rate in measured["gemm"].items()]
    lines.append(f"measured: {json.dumps(measured['measured'])}")
    return "\n".join(lines) + "\n"


def write_profile(path: Path, text: str) -> Path:
    """`text` written to `path` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
