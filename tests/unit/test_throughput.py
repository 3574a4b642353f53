"""Throughput figures (parallel.throughput) and device peaks (parallel.hardware), on plain numbers and meta models."""
import logging
import time

import pytest
import torch
from torch import nn

from parallel.config import Config
from parallel.hardware import cuda_precision, gpu_peak
from parallel.models.build import build_meta_model
from parallel.throughput import Throughput, device_peak, model_flops, postfix, text
from tests import gpus


def mlp_config(**args) -> Config:
    cfg = Config()  # the built-in mlp: 32 -> 64, 4 blocks of 64 -> 64, 64 -> 4; a batch of 32
    cfg.model.args = {"in_features": 32, "out_features": 4}
    for key, value in args.items():
        setattr(cfg.model, key, value)
    return cfg


def test_mlp_flops_are_its_matrix_products_forward_and_backward():
    b, layers = 32, [(32, 64)] + [(64, 64)] * 4 + [(64, 4)]
    forward = sum(2 * b * i * o for i, o in layers)
    weight_grads = forward
    input_grads = forward - 2 * b * 32 * 64  # the first layer's input (the data) needs none
    assert model_flops(mlp_config()) == forward + weight_grads + input_grads


def test_frozen_layers_take_no_gradient_flops():
    """With the first layer frozen, neither its weight gradient nor the next layer's input gradient is computed."""
    whole = model_flops(mlp_config())
    assert model_flops(mlp_config(freeze=["inp.*"])) == whole - 2 * 32 * 32 * 64 - 2 * 32 * 64 * 64


def test_gpt_flops_are_about_six_per_parameter_and_token():
    cfg = Config()
    cfg.model.name, cfg.data.task = "gpt", "lm"
    cfg.model.args = {"vocab_size": cfg.data.vocab_size, "seq_len": cfg.data.seq_len}
    flops = model_flops(cfg)
    params = sum(p.numel() for p in build_meta_model(cfg.model).parameters())
    tokens = cfg.trainer.batch_size * cfg.data.seq_len
    assert flops == pytest.approx(6 * params * tokens, rel=0.1)  # attention's products add a little


def test_hugging_face_model_is_counted_on_fake_tensors():
    """Llama's mask code reads its positions (an error on meta tensors): counted as fake tensors instead."""
    cfg = Config()
    cfg.model.name, cfg.model._target_, cfg.data.task, cfg.data.seq_len = "custom", "tests.hf_models.llama", "lm", 16
    cfg.data.vocab_size = 64
    assert model_flops(cfg) > 6 * 2 * (4 * 32 * 32) * 32 * 16  # at least the attention projections of 2 layers


class _ReadsItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 4)

    def forward(self, x):
        if x.sum() > 0:  # a value: neither meta nor fake tensors have one
            return self.lin(x)
        return -self.lin(x)


def reads_its_input() -> nn.Module:
    return _ReadsItsInput()


def test_a_model_that_reads_values_is_not_counted_with_a_warning(caplog):
    cfg = Config()
    cfg.model.name, cfg.model._target_ = "custom", "tests.unit.test_throughput.reads_its_input"
    parallel_log = logging.getLogger("parallel")
    parallel_log.addHandler(caplog.handler)
    try:
        assert model_flops(cfg) is None
    finally:
        parallel_log.removeHandler(caplog.handler)
    assert "could not be counted" in caplog.text
    assert Throughput(None, None, 1, 1e12).record(0.5) == {}  # and no flops, TFLOP/s or MFU are logged


@pytest.mark.parametrize("name,precision,peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 NVL", "tf32", 417.5e12),
    ("NVIDIA H200", "bf16", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100 80GB PCIe", "tf32", 156e12),
    ("NVIDIA A10G", "bf16", 125e12),  # not the A100's row
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40S", "bf16", 362.05e12),
    ("NVIDIA L40", "fp32", 90.5e12),
    ("Tesla V100-SXM2-16GB", "fp32", 15.7e12),
    ("Tesla V100-PCIE-32GB", "fp32", 14e12),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 units: no peak rather than a wrong one
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
    ("AMD Instinct MI300X", "bf16", 1307.4e12),
    ("NVIDIA GeForce GTX 1080", "bf16", None),
])
def test_gpu_peak_table(name, precision, peak):
    assert gpu_peak(name, precision) == peak


def test_fp32_runs_use_the_tf32_peak_when_torch_allows_tf32():
    before = torch.get_float32_matmul_precision()
    try:
        assert cuda_precision(bf16=True) == "bf16"
        torch.set_float32_matmul_precision("highest")
        assert cuda_precision(bf16=False) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert cuda_precision(bf16=False) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_cpu_peak_is_measured_quickly_and_trainer_peak_flops_overrides_it():
    cfg = mlp_config()
    t0 = time.process_time()  # this process's CPU time: what the measurement costs, not how busy the machine is
    rate, source = device_peak(cfg, torch.device("cpu"))
    assert time.process_time() - t0 < 0.5 and 1e8 < rate < 1e14 and "measured" in source
    cfg.trainer.peak_flops = 2.5e12
    assert device_peak(cfg, torch.device("cpu")) == (2.5e12, "trainer.peak_flops")


@pytest.mark.cuda
def test_cuda_peak_is_the_tables_or_none_with_a_warning():
    gpus.call(cuda_peak_is_the_tables)  # this process hides the GPUs (Note [tests on a GPU machine])


def cuda_peak_is_the_tables() -> None:
    cfg = mlp_config()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    parallel_log = logging.getLogger("parallel")
    parallel_log.addHandler(handler)
    try:
        peak, source = device_peak(cfg, torch.device("cuda", 0))
    finally:
        parallel_log.removeHandler(handler)
    name = torch.cuda.get_device_name(0)
    assert name in source and peak == gpu_peak(name, "bf16")
    assert (peak is None) == any("no bf16 peak known" in r.getMessage() for r in records)


def test_record_text_and_postfix():
    speed = Throughput(tokens_per_step=512, flops_per_step=4e12, world_size=4, peak=2e12)
    record = speed.record(0.5)
    assert record == {"tokens_per_s": 1024.0, "flops_per_step": 4e12, "tflops_per_rank": 2.0, "mfu": 1.0}
    assert text(record) == "  1024 tokens/s  2 TFLOP/s per rank  MFU 100%"
    assert postfix(record) == {"tokens_s": "1024", "mfu": "100%"}
    assert "mfu" not in Throughput(None, 4e12, 4, None).record(0.5)  # an unknown peak: no MFU
    assert Throughput().record(0.5) == {}  # off the logging rank


def test_counting_and_measuring_leave_the_runs_random_numbers_alone():
    """Throughput.start runs after the run's generators are seeded: dropout and data must not see it."""
    cfg = Config()
    cfg.model.name, cfg.model._target_, cfg.data.task = "custom", "tests.hf_models.gpt2", "lm"
    cfg.model.args, cfg.data.seq_len, cfg.data.vocab_size = {"dropout": 0.1}, 16, 64
    torch.manual_seed(3)
    state = torch.get_rng_state()
    speed = Throughput.start(cfg, torch.device("cpu"), is_logger=True)
    assert speed.flops_per_step > 0 and speed.peak > 0 and speed.tokens_per_step == 32 * 16
    assert torch.equal(torch.get_rng_state(), state)
