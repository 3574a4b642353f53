"""Shard datasets: the writer, the order (Note [shard order]) and the reader, in one process."""
import json

import numpy as np
import pytest
import torch

from parallel.config import ConfigError, DataConfig
from parallel.data.shards import Manifest, ShardData, ShardError, ShardWriter, vocab_is_bound, write_shards
from parallel.validate import to_config, validate
from tests.cli import ROOT

N, F, T = 1000, 6, 2


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, F)).astype(np.float32)
    x[:, 0] = np.arange(N)  # each sample carries its index
    return x, rng.standard_normal((N, T)).astype(np.float32)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, arrays):
    out = tmp_path_factory.mktemp("ds") / "data"
    w = ShardWriter(out, shard_size=128)  # 7 full shards and one of 104
    w.add_arrays({"features": arrays[0], "targets": arrays[1]})
    w.close()
    return out


def data_cfg(path, **kw) -> DataConfig:
    return DataConfig(name="shards", path=str(path), features=F, targets=T, **{"shuffle_buffer": 300, **kw})


def test_manifest_indexes_fixed_size_shards_with_checksums(dataset):
    m = Manifest.load(dataset)
    assert m.count == N and [s["count"] for s in m.shards] == [128] * 7 + [104]
    assert [s["first"] for s in m.shards] == list(range(0, N, 128))
    assert m.record["hints"] == {"task": "regression", "features": F, "targets": T}
    m.check_files(checksums=True)  # as written: passes


def test_every_sample_once_per_epoch_and_epochs_differ(dataset):
    data = ShardData(data_cfg(dataset), seed=0, batch_size=100)
    epoch0 = np.concatenate([data.sample_ids(k) for k in range(1, 11)])
    epoch1 = np.concatenate([data.sample_ids(k) for k in range(11, 21)])
    assert sorted(epoch0) == list(range(N)) == sorted(epoch1)
    assert not np.array_equal(epoch0, epoch1) and not np.array_equal(epoch0, np.arange(N))
    # A sample moves at most about a window from its place in the shard-permuted stream: here the
    # first 100 come from at most the first window's 300 (spread over up to 4 shards).
    first = data.sample_ids(1)
    assert len({i // 128 for i in first}) <= 4
    data.close()


def test_same_global_batch_on_one_and_two_ranks_across_epochs(dataset):
    one = ShardData(data_cfg(dataset), seed=3, batch_size=96)  # 96 does not divide 1000: batches straddle epochs
    two = [ShardData(data_cfg(dataset), seed=3, batch_size=96, dp_rank=r, dp_size=2) for r in range(2)]
    for k in (1, 2, 10, 11, 12, 25):
        ids = one.sample_ids(k)
        np.testing.assert_array_equal(ids, np.concatenate([d.sample_ids(k) for d in two]))
        x, y = one.batch(k, torch.device("cpu"))
        parts = [d.batch(k, torch.device("cpu")) for d in two]
        torch.testing.assert_close(x, torch.cat([p[0] for p in parts]), rtol=0, atol=0)
        torch.testing.assert_close(y, torch.cat([p[1] for p in parts]), rtol=0, atol=0)
    for d in [one, *two]:
        d.close()


def test_batches_hold_the_written_samples(dataset, arrays):
    data = ShardData(data_cfg(dataset), seed=1, batch_size=64)
    for k in (1, 5, 17):
        x, y = data.batch(k, torch.device("cpu"))
        ids = data.sample_ids(k)
        torch.testing.assert_close(x, torch.from_numpy(arrays[0][ids]), rtol=0, atol=0)
        torch.testing.assert_close(y, torch.from_numpy(arrays[1][ids]), rtol=0, atol=0)
    data.close()


def test_resuming_at_step_k_on_another_world_size_reads_the_same_batches(dataset):
    """A reader that starts at step k (nothing read before) gives what one that read steps 1..k-1 gives."""
    steady = ShardData(data_cfg(dataset), seed=5, batch_size=64)
    for k in range(1, 15):
        steady.batch(k, torch.device("cpu"))
    want = [steady.batch(k, torch.device("cpu")) for k in (15, 16, 17)]
    resumed = [ShardData(data_cfg(dataset), seed=5, batch_size=64, dp_rank=r, dp_size=4) for r in range(4)]
    for k, (x, y) in zip((15, 16, 17), want):
        parts = [d.batch(k, torch.device("cpu")) for d in resumed]
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), x, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), y, rtol=0, atol=0)
    for d in [steady, *resumed]:
        d.close()


def test_no_shuffle_reads_in_written_order(dataset):
    data = ShardData(data_cfg(dataset, shuffle_buffer=0), seed=0, batch_size=50)
    np.testing.assert_array_equal(data.sample_ids(3), np.arange(100, 150))
    data.close()


def test_python_api_takes_dicts_of_tensors_and_infers_the_task(tmp_path):
    samples = ({"features": torch.full((4,), float(i)), "targets": torch.tensor(i % 3)} for i in range(10))
    m = write_shards(samples, tmp_path / "cls", shard_size=4)
    assert m.count == 10 and len(m.shards) == 3
    assert m.record["hints"] == {"task": "classification", "features": 4, "classes": 3}
    lm = write_shards(({"features": np.arange(i, i + 8), "targets": np.arange(i + 1, i + 9)} for i in range(5)),
                      tmp_path / "lm")
    assert lm.record["hints"] == {"task": "lm", "seq_len": 8, "vocab_size": 13}


def test_writer_refuses_inconsistent_samples_an_empty_dataset_and_a_used_directory(tmp_path, dataset):
    w = ShardWriter(tmp_path / "a")
    w.add({"features": np.zeros(3), "targets": np.zeros(1)})
    with pytest.raises(ConfigError, match="field 'features' has shape \\(4,\\)"):
        w.add({"features": np.zeros(4), "targets": np.zeros(1)})
    with pytest.raises(ConfigError, match="empty"):
        write_shards([], tmp_path / "b")
    with pytest.raises(ConfigError, match="holds a dataset already"):
        ShardWriter(dataset)


def test_truncated_and_corrupt_shards_name_the_file(tmp_path, arrays):
    out = tmp_path / "d"
    with ShardWriter(out, shard_size=300) as w:
        w.add_arrays({"features": arrays[0], "targets": arrays[1]})
    victim = out / "shard-00001.bin"
    raw = bytearray(victim.read_bytes())
    raw[10] ^= 0xFF
    victim.write_bytes(bytes(raw))
    Manifest.load(out).check_files(checksums=False)  # same size: only the checksum sees it
    with pytest.raises(ShardError, match="shard-00001.bin: corrupt"):
        Manifest.load(out).check_files(checksums=True)
    victim.write_bytes(bytes(raw[:-7]))
    with pytest.raises(ShardError, match="shard-00001.bin: .* bytes where the manifest says .* \\(truncated\\)"):
        Manifest.load(out).check_files(checksums=False)
    data = ShardData(data_cfg(out, shuffle_buffer=0), seed=0, batch_size=100)
    with pytest.raises(ShardError, match="shard-00001.bin: truncated"):  # found while reading, too
        data.batch(6, torch.device("cpu"))
    data.close()


@pytest.mark.parametrize("case,message", [
    ("missing", "no such directory"),
    ("no_manifest", "holds no manifest.json"),
    ("empty", "the dataset is empty"),
])
def test_bad_dataset_directories_are_config_errors(tmp_path, dataset, case, message):
    path = tmp_path / "x"
    if case != "missing":
        path.mkdir()
    if case == "empty":
        record = json.loads((dataset / "manifest.json").read_text()) | {"count": 0, "shards": []}
        (path / "manifest.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=message):
        Manifest.load(path)


@pytest.mark.parametrize("array", [
    np.arange(37 * 15, dtype=">f4").reshape(37, 3, 5),  # another byte order
    np.asfortranarray(np.arange(41 * 8).reshape(41, 4, 2)),  # columns stored contiguously
    np.arange(29.0),
], ids=["big_endian", "fortran", "1d"])
def test_npy_rows_reads_chunks_into_one_buffer(tmp_path, array):
    from parallel.data.shards.arrays import NpyRows

    np.save(tmp_path / "a.npy", array)
    rows = NpyRows(tmp_path / "a.npy")
    assert len(rows) == len(array) and rows.ndim == array.ndim
    seen = []
    for lo in range(0, len(array), 10):
        got = rows.rows(lo, min(len(array), lo + 10))
        assert got.dtype == array.dtype
        np.testing.assert_array_equal(got, array[lo:lo + 10])
        seen.append(got.base if got.base is not None else got)
    assert all(np.shares_memory(s, seen[0]) for s in seen)  # one buffer, used again
    rows.close()
    (tmp_path / "a.npy").write_bytes((tmp_path / "a.npy").read_bytes()[:-9])
    with pytest.raises(ConfigError, match="a.npy.*truncated"):
        NpyRows(tmp_path / "a.npy").rows(0, len(array))


# The vocabulary bound (Note [vocabulary bound] in parallel/data/shards/manifest.py): token ids 1000..2999, as the
# issue's fine-tuning set, 16 per sample.
L, LOW, TOP = 16, 1000, 2999


def train_config(path, *overrides):
    """The validated config of `python launch/train.py data=shards data.path=path *overrides`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=["data=shards", f"data.path={path}", *overrides]))
    validate(cfg, 1)
    return cfg


@pytest.fixture(scope="module")
def token_shards(tmp_path_factory):
    """Shards as launch/make_shards.py writes them from token arrays (features: N x L ids, targets: the next ids),
    the ids spanning LOW..TOP only."""
    stream = np.random.default_rng(0).integers(LOW, TOP + 1, 64 * L + 1)
    stream[3], stream[7] = LOW, TOP
    out = tmp_path_factory.mktemp("tokens") / "data"
    with ShardWriter(out) as w:
        w.add_arrays({"features": stream[:-1].reshape(64, L), "targets": stream[1:].reshape(64, L)})
    return out


def test_token_ids_spanning_part_of_a_pretrained_vocabulary_fit_its_model(token_shards, tmp_path):
    """The issue's case: a pretrained BERT of 30,522 tokens (model=hf) on ids 1000..2999, whose largest id + 1
    (3000) the manifest records as a bound; a built-in sized by the data (model=gpt: data.vocab_size) fits too."""
    from transformers import BertConfig, BertForMaskedLM

    m = Manifest.load(token_shards)
    assert m.record["hints"] == {"task": "lm", "seq_len": L, "vocab_size": TOP + 1} and m.record["stated"] == []
    assert vocab_is_bound(token_shards)
    BertForMaskedLM(BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=L)).save_pretrained(tmp_path / "bert")
    cfg = train_config(token_shards, "model=hf", f"model.path={tmp_path / 'bert'}", "trainer.batch_size=8")
    assert (cfg.data.task, cfg.data.vocab_size) == ("lm", TOP + 1)
    train_config(token_shards, "model=gpt")
    train_config(token_shards, "model=gpt", "model.args.vocab_size=3000")  # the bound itself: ids up to 2999


@pytest.mark.parametrize("vocab", [TOP, LOW])
def test_a_token_id_at_or_above_the_models_output_size_is_refused_in_one_line(token_shards, vocab):
    with pytest.raises(ConfigError) as info:
        train_config(token_shards, "model=gpt", f"model.args.vocab_size={vocab}")
    assert str(info.value) == (
        f"data.path={str(token_shards)!r}: the model gives outputs of shape (2, {L}, {vocab}) for 2 samples; the "
        f"shards' lm targets hold token ids up to {TOP}, at or above its output size {vocab} (valid: outputs of "
        f"shape (2, {L}, V) with V >= {TOP + 1})")


def test_a_manifest_without_stated_sizes_reads_its_vocabulary_as_a_bound(token_shards, tmp_path):
    """Manifests written before `stated` was recorded: their vocab_size is read as a bound."""
    import shutil

    shutil.copytree(token_shards, tmp_path / "old")
    record = json.loads((tmp_path / "old" / "manifest.json").read_text())
    del record["stated"]
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(record))
    assert vocab_is_bound(tmp_path / "old")
    train_config(tmp_path / "old", "model=gpt", "model.args.vocab_size=4096")


def test_a_vocabulary_a_tokenizer_recorded_is_checked_exactly(tmp_path):
    """make_shards text=: the manifest states the tokenizer's vocabulary; a model of another size (a larger one
    too: trained with another tokenizer) is refused in one line naming both."""
    from parallel.data.shards import load_tokenizer, text_files, write_text_shards
    from tests import text_corpus

    text_corpus.write_corpus(tmp_path / "corpus", files=4, docs_per_file=3)
    tok = load_tokenizer(str(text_corpus.wordlevel(tmp_path / "tokenizer.json")))
    write_text_shards(text_files(str(tmp_path / "corpus")), tok, str(tmp_path / "data"), seq_len=8,
                      eos=tok.token_id("<|endoftext|>"), progress=False)
    assert Manifest.load(tmp_path / "data").record["stated"] == ["vocab_size"]
    assert not vocab_is_bound(tmp_path / "data")
    train_config(tmp_path / "data", "model=gpt", "trainer.batch_size=4")  # sized by data.vocab_size: the tokenizer's
    for vocab in (tok.vocab_size - 1, tok.vocab_size + 1, 4 * tok.vocab_size):
        with pytest.raises(ConfigError) as info:
            train_config(tmp_path / "data", "model=gpt", f"model.args.vocab_size={vocab}", "trainer.batch_size=4")
        assert str(info.value) == (
            f"data.path={str(tmp_path / 'data')!r}: the model gives outputs of shape (2, 8, {vocab}) for 2 samples; "
            f"the shards' lm targets need (2, 8, {tok.vocab_size}) (the vocabulary their tokenizer recorded)")
