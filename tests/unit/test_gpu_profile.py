"""launch/calibrate.py trainer.device=cuda's hardware profile (parallel/planning/gpu_profile.py): the file written
from what a GPU measured (here mocked: this machine has no GPU), read back as a profile and priced with."""
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from parallel.config import Config, HardwareConfig
from parallel.hardware import check_hardware
from parallel.planning.gpu_profile import GEMM_SHAPES, known_profile, measure_gpu, profile_text, slug, write_profile
from parallel.planning.kernels import product_seconds

CONF = Path(__file__).resolve().parents[2] / "conf"
MEASURED = {"gpu": "NVIDIA H100 80GB HBM3", "sms": 132, "memory_bytes": 85017493504, "memory_bandwidth": 3.0e12,
            "host_bandwidth": 53.2e9, "devices_per_node": 1, "gemm": {"4096x4096x4096": 700e12, "512x1024x1024": 90e12},
            "measured": "launch/calibrate.py on gpu-host, 2026-12-03, torch 2.13.0+cu130"}


def _read(path: Path) -> HardwareConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(path)))


def test_a_written_profile_reads_back_with_what_was_measured_and_what_the_name_gives(tmp_path):
    assert slug(MEASURED["gpu"]) == "nvidia_h100_80gb_hbm3"
    known = known_profile(MEASURED["gpu"], CONF)
    assert known is not None and known[0] == "h100"
    path = write_profile(tmp_path / "hardware" / "nvidia_h100_80gb_hbm3.yaml", profile_text(MEASURED, known))
    text = path.read_text()
    assert "measured by launch/calibrate.py on gpu-host, 2026-12-03" in text and "conf/hardware/h100.yaml" in text
    hw = _read(path)
    assert (hw.name, hw.device, hw.gpu, hw.sms) == ("nvidia_h100_80gb_hbm3", "cuda", MEASURED["gpu"], 132)
    assert hw.peak_flops == {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12, "fp8": 1978.9e12}
    assert hw.memory_bandwidth == 3.0e12 and hw.host_link.bandwidth == 53.2e9  # measured
    assert hw.node_link.bandwidth == 450e9 and hw.devices_per_node == 8  # the built-in profile's
    assert hw.gemm["4096x4096x4096"] == 700e12
    n = 4096  # a measured shape is priced at its measured rate
    assert product_seconds(hw, 2 * n ** 3, 3 * n * n * 2, n, n, n, 1, "bf16") == pytest.approx(2 * n ** 3 / 700e12)
    cfg = Config()
    cfg.hardware = hw
    check_hardware(cfg, 16)  # complete for a run over two nodes


def test_a_gpu_without_a_built_in_profile_leaves_its_links_to_the_user(tmp_path):
    measured = dict(MEASURED, gpu="NVIDIA L40S", devices_per_node=4)
    hw = _read(write_profile(tmp_path / "l40s.yaml", profile_text(measured, known_profile("NVIDIA L40S", CONF))))
    assert hw.peak_flops == {"bf16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}  # GPU_PEAKS by the name
    assert hw.devices_per_node == 4 and hw.node_link.bandwidth is None and hw.host_link.bandwidth == 53.2e9
    cfg = Config()
    cfg.hardware = hw
    check_hardware(cfg, 1)
    with pytest.raises(Exception, match="hardware.node_link.bandwidth=None: nproc=2"):
        check_hardware(cfg, 2)


@pytest.mark.cuda
def test_the_gpu_here_measures_as_a_profile_holds_it(tmp_path):
    measured = measure_gpu(torch.device("cuda", 0), seconds=0.005)
    assert set(measured["gemm"]) == {f"{m}x{n}x{k}" for m, n, k in GEMM_SHAPES}
    assert all(rate > 0 for rate in measured["gemm"].values()) and measured["memory_bandwidth"] > 0
    hw = _read(write_profile(tmp_path / "gpu.yaml", profile_text(measured, known_profile(measured["gpu"], CONF))))
    assert hw.memory_bytes == torch.cuda.get_device_properties(0).total_memory
