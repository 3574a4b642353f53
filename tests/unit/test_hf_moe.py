"""Hugging Face mixture-of-experts models (tests/hf_models.py: Mixtral, Qwen3-MoE): their checkpoints read as
transformers' loading converts them (Note [checkpoint conversion] in parallel/models/hf_conversion.py), and
their grouped expert products on fake tensors as a real run computes them (Note [grouped matmul on fake
tensors] in parallel/torch_patches.py)."""
import pytest
import torch

from parallel.config import ConfigError, ModelConfig
from parallel.flops import Flops
from parallel.init import init_plan, materialize_and_init
from parallel.models.build import build_meta_model, meta_model
from parallel.models.hf_conversion import ConvertedFiles
from parallel.models.recipe import model_recipe
from parallel.models.weights import initial_values, weight_files
from parallel.tensors import faking, meta_forward
from parallel.torch_patches import register_grouped_mm_fake
from parallel.validate import validate
from tests import hf_models
from tests.unit.test_weights import hf_cfg


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_a_per_expert_checkpoint_lands_where_from_pretrained_puts_it(tmp_path, name):
    """save_pretrained writes one tensor per expert (Mixtral's `block_sparse_moe.experts.N.w1`, Qwen3-MoE's
    `mlp.experts.N.gate_proj`; GPT-OSS's are fused already): every tensor each rank starts from is
    from_pretrained's, whole and as a piece of the fused experts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    getattr(hf_models, name)().save_pretrained(tmp_path / "dir")
    m = ModelConfig(name="hf", path=str(tmp_path / "dir"))
    validate(hf_cfg(m.path, strict=True), 1)  # nothing missing nor unread once converted
    recipe = model_recipe(m)
    model = meta_model(recipe)
    plan = init_plan(model)
    materialize_and_init(model, torch.device("cpu"), plan, initial_values(recipe, 0, tmp_path, model, plan))
    want = AutoModelForCausalLM.from_pretrained(m.path).state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    files = weight_files(m.path, build_meta_model(m))
    assert isinstance(files, ConvertedFiles) == (name != "gpt_oss")
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    piece = (slice(2, 4), slice(0, None), slice(8, 24))  # ep rank 1's experts, a column range of them
    torch.testing.assert_close(files.read(fused, piece), want[fused][piece], rtol=0, atol=0)


def test_grouped_products_on_fake_tensors_are_what_the_cpu_kernel_gives():
    """fp32 (the CPU's and a CUDA fp32 run's kernels take it; torch's own fake kernel refuses all but bf16):
    the forward layout (tokens grouped by expert x one weight per expert) and the weight gradient's."""
    register_grouped_mm_fake()
    groups = torch.tensor([3, 3, 12], dtype=torch.int32)  # the middle expert given no token
    cases = [(torch.randn(12, 8), torch.randn(3, 8, 4)), (torch.randn(8, 12), torch.randn(12, 4))]
    for a, b in cases:
        real = torch._grouped_mm(a, b, offs=groups)
        fake = meta_forward(torch._grouped_mm, a.to("meta"), b.to("meta"), offs=groups.to("meta"))
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def test_the_checks_forward_takes_the_real_runs_path_and_counts_its_products(tmp_path):
    """model=hf of a Mixtral directory passes the data check (its fake forward computes the grouped products
    the CPU run computes; torch's own fake kernel made it a data error), and a fake forward counts the FLOPs a
    real one counts."""
    hf_models.mixtral().save_pretrained(tmp_path)
    cfg = hf_cfg(str(tmp_path), pretrained=False)
    validate(cfg, 1)
    x = torch.randint(0, 64, (2, 16))
    torch.manual_seed(0)
    real = hf_models.mixtral()
    with Flops() as counted_real:
        real(x)
    meta = build_meta_model(cfg.model)
    with torch.no_grad(), faking(), Flops() as counted_fake:
        meta(x.to("meta"))
    assert counted_fake.total == counted_real.total > 0


@pytest.mark.parametrize("strategy,world,error", [
    ({"name": "expert", "zero": 1}, 2, r"^strategy.zero=1: model.layers.0.mlp.experts holds Hugging Face fused"),
    ({"name": "hybrid", "dp": 1, "ep": 2, "pp": 2}, 4, r"^strategy.pp=2: model.layers.0.mlp.experts holds Hugging"),
    ({"name": "hybrid", "dp": 1, "ep": 8}, 8, r"^strategy.ep=8: must divide the number of experts: "
                                              r"model.layers.0.mlp.experts has 4"),
])
def test_what_ep_does_not_take_of_hugging_face_experts_is_a_config_error(strategy, world, error):
    cfg = hf_cfg("unused")
    cfg.model = ModelConfig(name="custom", _target_="tests.hf_models.mixtral")
    cfg.trainer.batch_size = 8
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    with pytest.raises(ConfigError, match=error):
        validate(cfg, world)
