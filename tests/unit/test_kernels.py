"""An op's time on a GPU profile (Note [op times on a profile] in parallel/planning/kernels.py), worked by hand."""
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from parallel.config import HardwareConfig
from parallel.planning.kernels import call_seconds, compute_parts, product_seconds, quantization
from parallel.planning.work import Work, spec

CONF = Path(__file__).resolve().parents[2] / "conf"


def profile(name: str, **changes) -> HardwareConfig:
    """conf/hardware/NAME.yaml as the schema reads it."""
    node = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(CONF / "hardware" / f"{name}.yaml"))
    return OmegaConf.to_object(OmegaConf.merge(node, changes))


def test_tile_and_wave_quantization():
    # 4096 x 4096: 32 x 32 = 1024 tiles of 128 x 128 in 8 waves of 132 SMs, the last one 100 short
    assert quantization(4096, 4096, 1, 132) == pytest.approx(1024 / (8 * 132))
    # 100 rows fill 100/128 of their tile row: one tile, one wave of 132 SMs
    assert quantization(100, 128, 1, 132) == pytest.approx(100 / 128 / 132)
    assert quantization(128 * 132, 128, 1, 132) == pytest.approx(1.0)  # one full wave


def test_a_large_product_runs_at_the_peak_by_its_tiles_and_a_thin_one_at_the_memory():
    h100 = profile("h100")
    n = 4096
    flops, nbytes = 2 * n ** 3, 3 * n * n * 2  # bf16: two operands and the output
    assert product_seconds(h100, flops, nbytes, n, n, n, 1, "bf16") == pytest.approx(
        flops / (989.4e12 * 1024 / (8 * 132)))
    # K = 64: 8.6 GFLOP in 8.9 us at the peak, but 136 MB to move at 3.35 TB/s: 40.7 us
    m, k = 8192, 64
    flops, nbytes = 2 * m * m * k, 2 * (2 * m * k + m * m)
    assert product_seconds(h100, flops, nbytes, m, m, k, 1, "bf16") == pytest.approx(nbytes / 3.35e12)


def test_measured_products_scale_the_curve():
    n = 4096
    flops, nbytes = 2 * n ** 3, 3 * n * n * 2
    measured = profile("h100", gemm={f"{n}x{n}x{n}": 700e12})
    assert product_seconds(measured, flops, nbytes, n, n, n, 1, "bf16") == pytest.approx(flops / 700e12)
    # another shape: the curve's time x (the curve's rate / the measured one) at the nearest measured shape
    curve = product_seconds(profile("h100"), 2 * 8192 * 4096 * 4096, 0, 8192, 4096, 4096, 1, "bf16")
    own = flops / (989.4e12 * 1024 / (8 * 132))
    assert product_seconds(measured, 2 * 8192 * 4096 * 4096, 0, 8192, 4096, 4096, 1, "bf16") == pytest.approx(
        curve * (flops / 700e12) / own)
    assert product_seconds(measured, flops, nbytes, n, n, n, 1, "fp32") == product_seconds(
        profile("h100"), flops, nbytes, n, n, n, 1, "fp32")  # measured in bf16 only


def _calls(fn) -> dict:
    with Work() as w:
        fn()
    return w


def test_a_planned_product_is_priced_by_its_shape_and_dtype():
    a, b = torch.empty(2048, 512, dtype=torch.bfloat16), torch.empty(512, 1024, dtype=torch.bfloat16)
    w = _calls(lambda: torch.mm(a, b))
    ((key, (n, flops, moved)),) = w.calls.items()
    h100 = profile("h100")
    part, seconds = call_seconds(h100, key, flops, moved, "fp32")
    # 16 x 8 = 128 tiles: one wave of 132 SMs; 2 x 2048 x 1024 x 512 FLOPs in 2.24 us (7.3 MB moved in 2.19)
    assert part == "products" and flops == 2 * 2048 * 1024 * 512
    assert seconds == pytest.approx(flops / (989.4e12 * 128 / 132))
    # the same product in fp32 is held to the fp32 column
    a32, b32 = a.float(), b.float()
    ((key32, (_, f32, m32)),) = _calls(lambda: torch.mm(a32, b32)).calls.items()
    assert call_seconds(h100, key32, f32, m32, "fp32")[1] == pytest.approx(flops / (66.9e12 * 128 / 132))


def test_attention_is_the_flash_kernel_halved_when_causal():
    q = torch.empty(2, 8, 4096, 64, dtype=torch.bfloat16)
    plain = _calls(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    causal = _calls(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    h100 = profile("h100")
    (key, (_, flops, moved)), = [(k, v) for k, v in plain.calls.items() if v[1]]
    (ckey, (_, cflops, cmoved)), = [(k, v) for k, v in causal.calls.items() if v[1]]
    assert flops == cflops == 2 * 2 * 8 * 4096 * 4096 * 128  # torch counts the masked half too
    part, t = call_seconds(h100, key, flops, moved, "fp32")
    blocks = 32 * 16  # 4096 / 128 query blocks x 16 heads, in 4 waves of 132 SMs
    assert part == "attention" and t == pytest.approx(flops / (989.4e12 * blocks / (132 * math.ceil(blocks / 132))))
    assert call_seconds(h100, ckey, cflops, cmoved, "fp32")[1] == pytest.approx(t / 2)


def test_other_ops_move_their_bytes_at_the_memory_bandwidth_and_views_nothing():
    x = torch.empty(1 << 20)
    w = _calls(lambda: (x + x, x.view(-1), torch.zeros_like(x)))
    h100 = profile("h100")
    parts = compute_parts(h100, w.calls, w.as_dict(), "fp32", bf16=False)
    # the add reads 8 MB and writes 4; zeros_like only writes its 4 MB
    assert parts == {"products": 0.0, "attention": 0.0, "memory": pytest.approx((12 + 4) * 2 ** 20 / 3.35e12)}


def test_calls_that_could_not_be_keyed_are_priced_by_their_class():
    work = {"products": {"1024": [1, 2 * 1024 ** 3]}, "memory": {"1048576": [3, 3 << 20]}}
    h100 = profile("h100")
    parts = compute_parts(h100, {}, work, "fp32", bf16=True)
    assert parts["memory"] == pytest.approx((3 << 20) / 3.35e12)
    assert parts["products"] == pytest.approx(2 * 1024 ** 3 / (989.4e12 * 64 / 132))  # 64 tiles, one wave
    assert spec(torch.empty(2, dtype=torch.bfloat16))[4] == torch.bfloat16
