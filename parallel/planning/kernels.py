"""One op's time on a GPU profile from its shapes and bytes alone, nothing run: matrix products by shape, attention
by its kernel, every other op at the memory's bandwidth (Note [op times on a profile]).

# Note [op times on a profile]
A planned step's distinct op calls (the op and its arguments' shapes and
dtypes, Note [step work]) are priced on a GPU profile (Note [hardware
profiles] in parallel/hardware.py):

    products   a matrix product of M x K by K x N (over a batch of them),
               doing F FLOPs and moving B bytes (its operands and output):
                   max(F / (peak x tiles x waves), B / memory bandwidth)
               peak the profile's dense FLOP/s for the operands' dtype (bf16
               and fp16: bf16; fp32: tf32 or fp32 as torch lets fp32 products
               run; the fp8 dtypes: fp8). cuBLAS computes the output in tiles
               of 128 x 128, one tile an SM at a time (NVIDIA's Matrix
               Multiplication Background user's guide, "Typical tile
               dimensions in cuBLAS", "Dimension quantization effects"):
               tiles = M N / (M' N'), M' and N' rounded up to 128 (tile
               quantization), and waves = T / (SMs x ceil(T / SMs)) for T
               tiles (wave quantization: the last wave leaves SMs idle). The
               bytes bound is the roofline: a product whose K is small moves
               more than it computes. For large products the curve reaches
               the datasheet's peak; what keeps cuBLAS below it (clocks under
               the power limit, each kernel's prologue and epilogue) is left
               out, unless the profile has measured rates (`gemm`, written by
               launch/calibrate.py trainer.device=cuda): then bf16 products
               are priced by the curve scaled by the measured rate over the
               curve's own at the nearest measured shape (log distance).
               M, N and K come from the op's shapes (mm, addmm, bmm, baddbmm,
               the grouped product; a convolution as the product im2col makes
               of it, N its output channels); any other op with FLOPs as a
               square product of its FLOPs.
    attention  scaled_dot_product_attention's kernels (the CPU's flash
               kernels a CUDA plan records, CUDA's flash, efficient and cuDNN
               ones): torch's FLOPs, halved when causal (the flash kernel skips
               the masked blocks; torch counts them), over batch x heads
               products of the queries by the keys, its tiles 128 queries of
               one head; bytes: its tensors and outputs (the scores never
               leave the chip).
    memory     every other op: the bytes it reads and writes / the memory
               bandwidth. A view moves none, nor does an alias the schema does
               not mark as one (`_unsafe_view`) or an allocation (`_FREE`);
               a fill (`zeros_like`) only writes.

Calls whose arguments could not be keyed (Note [step work]) are priced by
their class: a square product of the class's size, bytes at the bandwidth.
Left out: kernel launches and the gaps between kernels (each op is priced as
if the next started when it ended), elementwise ops fused or not, caches
(L2 holds a small op's operands), and clocks below the datasheet's.
"""
from __future__ import annotations

import math

import torch

from parallel.config import HardwareConfig
from parallel.planning.work import byte_class, size_class

TILE = 128  # the output tile of cuBLAS's kernels, and the queries a flash kernel's block takes
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
# Ops that move no bytes on a GPU though they are no views (an alias the schema does not mark, an allocation),
# and ops that only write what Note [step work] counts as read and written.
_FREE = ("_unsafe_view", "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
         "new_empty_strided")
_WRITE_ONLY = ("zeros", "zeros_like", "ones_like", "full_like", "fill_", "zero_", "new_zeros", "new_ones")
_MM = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "_grouped_mm": (0, 1)}


def column(dtype: torch.dtype, fp32: str) -> str:
    """The peak of the profile a product in `dtype` is held to; `fp32`: "tf32" or "fp32", as the run's fp32
    products run."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if dtype in _FP8:
        return "fp8"
    return fp32


def quantization(m: float, n: float, batch: float, sms: int) -> float:
    """The share of a product's tile work that is its own (Note [op times on a profile]): tile x wave
    quantization of an M x N output (over `batch` of them) on `sms` SMs."""
    rows, cols = math.ceil(m / TILE), math.ceil(n / TILE)
    tiles = max(1, rows * cols * max(1, round(batch)))
    padded = m * n / (rows * cols * TILE * TILE)
    return padded * tiles / (sms * math.ceil(tiles / sms))


def curve_seconds(hw: HardwareConfig, flops: float, nbytes: float, m: float, n: float, batch: float,
                  col: str) -> float:
    """A product's seconds by the curve alone: max(F / (peak x quantization), B / bandwidth)."""
    peak = hw.peak_flops.get(col) or hw.peak_flops["bf16"]
    return max(flops / (peak * quantization(m, n, batch, hw.sms)), nbytes / hw.memory_bandwidth)


def _measured(hw: HardwareConfig, m: float, n: float, k: float) -> tuple[tuple[int, int, int], float] | None:
    """The nearest measured bf16 product shape (log distance) and its FLOP/s; None without measurements."""
    if not hw.gemm:
        return None
    shapes = {tuple(int(v) for v in key.split("x")): rate for key, rate in hw.gemm.items()}
    near = min(shapes, key=lambda s: sum(math.log(max(x, 1) / max(y, 1)) ** 2 for x, y in zip(s, (m, n, k))))
    return near, shapes[near]


def product_seconds(hw: HardwareConfig, flops: float, nbytes: float, m: float, n: float, k: float, batch: float,
                    col: str) -> float:
    """A product's seconds on `hw` (Note [op times on a profile]), scaled to the measured rates where the profile
    has them (bf16 only: what launch/calibrate.py measures)."""
    t = curve_seconds(hw, flops, nbytes, m, n, batch, col)
    near = _measured(hw, m, n, k) if col == "bf16" else None
    if near is None:
        return t
    (mm, nn, kk), rate = near
    own = curve_seconds(hw, 2.0 * mm * nn * kk, 2.0 * (mm * kk + kk * nn + mm * nn), mm, nn, 1, "bf16")
    return t * (2.0 * mm * nn * kk / rate) / own


def _tensors(spec) -> list[tuple]:
    """The ("tensor", shape, stride, offset, dtype) specs inside an argument spec (parallel.planning.work.spec)."""
    if isinstance(spec, tuple) and spec and spec[0] == "tensor":
        return [spec]
    if isinstance(spec, tuple) and spec and spec[0] in ("tuple", "list"):
        return [t for s in spec[1:] for t in _tensors(s)]
    if isinstance(spec, tuple) and spec and spec[0] == "dict":
        return [t for _, s in spec[1:] for t in _tensors(s)]
    return []


def _nbytes(t: tuple) -> int:
    return math.prod(t[1]) * t[4].itemsize


def _bound(func, args: tuple, kwargs: tuple) -> dict:
    """An op call's argument specs by the names of its schema."""
    names = [a.name for a in func._schema.arguments]
    out = dict(zip(names, args[1:]))
    out.update({k: v for k, v in kwargs[1:]})
    return out


def _value(spec):
    return spec[1] if isinstance(spec, tuple) and spec and spec[0] == "value" else None


def is_attention(func) -> bool:
    return "scaled_dot_product" in func._schema.name


def attention_seconds(hw: HardwareConfig, func, args: tuple, kwargs: tuple, flops: float, fp32: str) -> float:
    """A scaled_dot_product_attention kernel's seconds (Note [op times on a profile])."""
    bound = _bound(func, args, kwargs)
    q = bound["query"]
    b, h, s_q = q[1][0], q[1][1], q[1][2]
    if _value(bound.get("is_causal")):
        flops /= 2
    inputs = sum(_nbytes(t) for t in _tensors(args) + _tensors(kwargs))
    backward = func._schema.name.endswith("_backward")
    outputs = sum(_nbytes(bound[n]) for n in ("query", "key", "value")) if backward else _nbytes(q)
    return _attention(hw, flops, inputs + outputs, s_q, b * h, column(q[4], fp32))


def _attention(hw: HardwareConfig, flops: float, nbytes: float, s_q: int, heads: int, col: str) -> float:
    """The flash kernel's blocks: 128 queries of one head each, over the SMs in waves."""
    blocks = math.ceil(s_q / TILE) * heads
    share = s_q / (math.ceil(s_q / TILE) * TILE) * blocks / (hw.sms * math.ceil(blocks / hw.sms))
    peak = hw.peak_flops.get(col) or hw.peak_flops["bf16"]
    return max(flops / (peak * share), nbytes / hw.memory_bandwidth)


def _mnk(func, args: tuple, flops: float) -> tuple[float, float, float, float] | None:
    """(M, N, K, batch) of a product call from its operands' shapes; None for an op it does not know."""
    name = func._schema.name.split("::")[-1]
    tensors = [a if isinstance(a, tuple) and a and a[0] == "tensor" else None for a in args[1:]]
    if name in _MM and len(tensors) > max(_MM[name]) and None not in (tensors[i] for i in _MM[name]):
        a, b = (tensors[i] for i in _MM[name])
        m, n = a[1][-2], b[1][-1]
        batch = math.prod(a[1][:-2]) if name in ("bmm", "baddbmm") else 1
    elif name == "convolution" and len(tensors) > 1 and tensors[1] is not None:
        n = tensors[1][1][0]  # the weight's output channels
        k = math.prod(tensors[1][1][1:])
        return flops / (2 * n * k), n, k, 1
    else:
        return None
    return (m, n, flops / (2 * m * n * batch), batch) if m * n * batch else None


def call_seconds(hw: HardwareConfig, key: tuple, flops: float, moved: float, fp32: str) -> tuple[str, float]:
    """(its part: "products", "attention" or "memory"; its seconds) of one op call keyed as Note [step work]
    keys it."""
    func, args, kwargs = key
    if not flops:
        name = func._schema.name.split("::")[-1]
        if name in _FREE:
            return "memory", 0.0
        return "memory", moved / (2 if name in _WRITE_ONLY else 1) / hw.memory_bandwidth
    if is_attention(func):
        return "attention", attention_seconds(hw, func, args, kwargs, flops, fp32)
    tensors = _tensors(args)
    dtype = tensors[0][4] if tensors else torch.bfloat16
    shape = _mnk(func, args, flops) if tensors else None
    if shape is None:
        side = (flops / 2) ** (1 / 3)
        shape = (side, side, side, 1)
    m, n, k, batch = shape
    nbytes = sum(_nbytes(t) for t in tensors) + m * n * batch * dtype.itemsize
    return "products", product_seconds(hw, flops, nbytes, m, n, k, batch, column(dtype, fp32))


def compute_parts(hw: HardwareConfig, calls: dict, work: dict, fp32: str, bf16: bool) -> dict[str, float]:
    """Seconds of a rank role's ops on `hw` by part (products, attention, memory), from its distinct calls
    (RankPlan.calls) and, for what they leave out, its work by class (Note [op times on a profile])."""
    parts = {"products": 0.0, "attention": 0.0, "memory": 0.0}
    covered: dict[tuple[str, int], float] = {}
    for key, (n, flops, moved) in calls.items():
        part, seconds = call_seconds(hw, key, flops, moved, fp32)
        parts[part] += n * seconds
        cls = ("products", size_class(flops)) if flops else ("memory", byte_class(moved))
        covered[cls] = covered.get(cls, 0.0) + n * (flops or moved)
    parts["products"] += class_seconds(hw, work, "products", fp32, bf16, covered)
    parts["memory"] += class_seconds(hw, work, "memory", fp32, bf16, covered)
    return parts


def class_seconds(hw: HardwareConfig, work: dict, part: str, fp32: str, bf16: bool,
                  covered: dict | None = None) -> float:
    """Seconds of a work's products or memory-bound bytes by class (a square product of the class's size; bytes
    at the bandwidth), less what `covered` ((part, class) -> FLOPs or bytes) already priced."""
    covered = covered or {}
    total = 0.0
    col = "bf16" if bf16 else fp32
    for size, (_, amount) in work.get(part, {}).items():
        rest = amount - covered.get((part, int(size)), 0.0)
        if rest <= 0:
            continue
        if part == "memory":
            total += rest / hw.memory_bandwidth
        else:
            s = int(size)
            whole = curve_seconds(hw, 2.0 * s ** 3, 3 * s * s * (2 if bf16 else 4), s, s, 1, col)
            total += rest / (2.0 * s ** 3) * whole
    return total
