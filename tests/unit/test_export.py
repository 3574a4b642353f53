"""parallel/export in one process: safetensors written a tensor at a time (every dtype, shards, an index) read
back by the library; an entry made from several tensors (the shape LoRA's merge takes); the checkpoint's names
checked against the model, a tied weight's second name left out for Hugging Face; final_model.pt read through a
mapping made again as it goes; the command line's options."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from parallel.config import ConfigError, ModelConfig
from parallel.export import parse_options
from parallel.export.files import write_weights
from parallel.export.names import Entry, exported_tensors
from parallel.export.source import Spec, TorchFile

TENSORS = {
    "f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).bfloat16(), "f16": torch.randn(7).half(),
    "i64": torch.arange(6).view(2, 3), "bool": torch.tensor([True, False, True]), "u8": torch.arange(5).byte(),
    "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "f64": torch.randn(2, 2, 2).double(),
}


def entries_of(tensors: dict) -> list[Entry]:
    return [Entry(k, (k,), Spec(tuple(v.shape), v.dtype)) for k, v in tensors.items()]


def test_one_file_holds_every_dtype_as_the_library_reads_it(tmp_path):
    assert write_weights(tmp_path, entries_of(TENSORS), TENSORS.__getitem__, None) == ["model.safetensors"]
    got = load_file(tmp_path / "model.safetensors")
    assert sorted(got) == sorted(TENSORS)
    for k, v in TENSORS.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_shards_and_their_index(tmp_path):
    names = write_weights(tmp_path, entries_of(TENSORS), TENSORS.__getitem__, 40)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert names == files + ["model.safetensors.index.json"] and len(files) > 2
    assert files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    assert index["metadata"] == {"total_size": sum(v.nbytes for v in TENSORS.values()),
                                 "total_parameters": sum(v.numel() for v in TENSORS.values())}
    for k, f in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / f)[k], TENSORS[k])


def test_an_entry_made_from_several_tensors(tmp_path):
    """The shape a merged LoRA weight takes: base + scale * B @ A, from three of the checkpoint's tensors."""
    saved = {"w.base": torch.randn(4, 3), "w.A": torch.randn(2, 3), "w.B": torch.randn(4, 2)}
    merged = Entry("w", ("w.base", "w.B", "w.A"), Spec((4, 3), torch.float32), make=lambda w, b, a: w + 0.5 * b @ a)
    write_weights(tmp_path, [merged], saved.__getitem__, None)
    want = saved["w.base"] + 0.5 * saved["w.B"] @ saved["w.A"]
    torch.testing.assert_close(load_file(tmp_path / "model.safetensors")["w"], want)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def specs(model: nn.Module) -> dict:
    return {k: Spec(tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def test_names_are_checked_against_the_model_and_a_tied_copy_is_read_from_its_twin():
    with torch.device("meta"):
        model = Tied()
    saved = specs(model)
    names = [e.name for e in exported_tensors(model, saved, ModelConfig(), "merged", False, "c")]
    assert names == ["embed.weight", "norm.weight", "norm.bias", "head.weight"]  # every name, as final_model.pt
    hf = exported_tensors(model, saved, ModelConfig(), "merged", True, "c")
    assert [e.name for e in hf] == ["embed.weight", "norm.weight", "norm.bias"]  # the second name left out
    del saved["head.weight"]  # only the first name saved: read from it
    entry = exported_tensors(model, saved, ModelConfig(), "merged", False, "c")[-1]
    assert (entry.name, entry.sources) == ("head.weight", ("embed.weight",))
    with pytest.raises(ConfigError, match=r"1 missing \(e.g. \['norm.bias'\]\); 1 not in the model .*'extra'"):
        exported_tensors(model, {**{k: v for k, v in saved.items() if k != "norm.bias"},
                                 "extra": Spec((1,), torch.float32)}, ModelConfig(), "merged", False, "c")
    with pytest.raises(ConfigError, match=r"shapes differ: norm.weight \(5,\) saved, \(4,\) in the model"):
        exported_tensors(model, {**saved, "norm.weight": Spec((5,), torch.float32)}, ModelConfig(), "merged",
                         False, "c")
    with pytest.raises(ConfigError, match="lora='adapter': the run trained no LoRA adapters"):
        exported_tensors(model, saved, ModelConfig(), "adapter", False, "c")


def test_final_model_is_read_through_a_mapping_made_again_as_it_goes(tmp_path):
    state = {f"w{i}": torch.randn(64, 64) for i in range(5)}
    torch.save(state, tmp_path / "final_model.pt")
    f = TorchFile(tmp_path / "final_model.pt")
    f.window = 64 * 64 * 4 * 2  # two tensors a mapping
    mappings = []
    for k in state:
        t = f.read(k)
        mappings.append(id(f._state))
        assert torch.equal(t, state[k])
    assert len(set(mappings)) == 3


@pytest.mark.parametrize("args,says", [
    (["checkpoint=a", "out=b", "shards=2"], "shards='2': unknown option (valid: ['checkpoint', 'out',"),
    (["checkpoint=a"], "out=None: required"),
    (["checkpoint=a", "out=b", "overwrite=yes"], "overwrite='yes': must be true or false"),
    (["checkpoint=a", "out=b", "lora=both"], "lora='both': how LoRA adapters are exported (valid: ['merged', "),
    (["checkpoint=a", "out=b", "max_shard_size=big"], "max_shard_size='big': must be a size > 0"),
    (["a"], "'a': not an option"),
])
def test_bad_options(args, says):
    with pytest.raises(ConfigError) as e:
        parse_options(args)
    assert str(e.value).startswith(says), str(e.value)


def test_options():
    o = parse_options(["checkpoint=a", "out=b", "overwrite=true", "lora=adapter", "max_shard_size=2GB"])
    assert (o.checkpoint, o.out, o.overwrite, o.lora, o.max_shard_size) == ("a", "b", True, "adapter", 2 * 10**9)
