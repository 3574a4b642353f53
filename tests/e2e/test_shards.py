"""data=shards from the command line: make_shards.py, training on one and two ranks, memory, bad input."""
import subprocess
import sys

import numpy as np
import pytest

from tests import cli

MAKE = str(cli.ROOT / "launch" / "make_shards.py")
F, T = 32, 4


# Runs a command and prints the peak RSS (KiB) of it alone: the children of this process are that one only.
PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def make(tmp_path, n: int, name: str = "data", extra: list[str] = (), peak: bool = True) -> tuple[str, int | None]:
    """A learnable regression dataset of `n` samples written by make_shards.py (inputs built chunk-wise), and
    make_shards.py's peak RSS in KiB (`peak`: in a new interpreter of its own; else None, the zygote's child)."""
    x_path, y_path = tmp_path / f"{name}-x.npy", tmp_path / f"{name}-y.npy"
    x = np.lib.format.open_memmap(x_path, mode="w+", dtype=np.float32, shape=(n, F))
    y = np.lib.format.open_memmap(y_path, mode="w+", dtype=np.float32, shape=(n, T))
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((F, T)).astype(np.float32) / F ** 0.5
    for lo in range(0, n, 1 << 16):
        hi = min(n, lo + (1 << 16))
        x[lo:hi] = rng.standard_normal((hi - lo, F), dtype=np.float32)
        y[lo:hi] = x[lo:hi] @ teacher
    x.flush(), y.flush()
    del x, y
    out = tmp_path / name
    args = [f"features={x_path}", f"targets={y_path}", f"out={out}", *extra]
    if peak:
        proc = subprocess.run([sys.executable, "-c", PEAK, sys.executable, MAKE, *args],
                              env=cli.env(), capture_output=True, text=True, timeout=300)
    else:
        proc = cli.run_script(MAKE, args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    x_path.unlink(), y_path.unlink()
    return str(out), int(proc.stdout.split()[-1]) if peak else None


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make(tmp_path_factory.mktemp("shards"), 3000, extra=["shard_size=64KB"], peak=False)[0]


@pytest.mark.timeout(200)
def test_one_and_two_ranks_train_alike_from_shards(dataset, tmp_path):
    common = cli.FAST + ["data=shards", f"data.path={dataset}", "data.shuffle_buffer=500",
                         "trainer.batch_size=256", "trainer.steps=14"]  # 14 x 256 > 3000: into epoch 2
    one, two = tmp_path / "one", tmp_path / "two"
    cli.run(common + [f"run_dir={one}"], cwd=tmp_path)
    cli.run(common + ["nproc=2", "strategy=data", f"run_dir={two}"], cwd=tmp_path)
    cli.assert_same_training(two, one)
    record = cli.metrics(one)[-1]
    assert record["data_time_s"] >= 0 and record["loss"] < cli.metrics(one)[0]["loss"]  # it learns


@pytest.mark.timeout(300)
def test_ten_times_the_data_does_not_raise_peak_rss(tmp_path):
    """Peak RSS of make_shards.py over 12 MB of arrays and over 120 MB: it holds a chunk of them, not the
    pages it has read. And of a run over those shards: the reader holds a window of sample numbers and the
    batches read ahead, not the dataset."""
    (small, made_small), (big, made_big) = make(tmp_path, 80_000, "small"), make(tmp_path, 800_000, "big")
    assert made_big <= 1.10 * made_small, (made_small, made_big)
    peaks = {}
    for name, path in (("small", small), ("big", big)):
        run_dir = tmp_path / f"run-{name}"
        cli.run(["data=shards", f"data.path={path}", "data.verify=size", "trainer.batch_size=512",
                 "trainer.steps=40", "trainer.log_every=40", "trainer.progress=false", f"run_dir={run_dir}"],
                cwd=tmp_path, fresh=True)  # a process of its own: the zygote's pages would count in its peak
        peaks[name] = cli.metrics(run_dir)[-1]["rss_peak_bytes"]
    assert peaks["big"] <= 1.10 * peaks["small"], peaks


@pytest.mark.parametrize("case,message", [
    ("missing", "data.path='{tmp}/nowhere': no such directory"),
    ("no_manifest", "holds no manifest.json"),
    ("no_path", "data.path=None: data=shards needs the dataset directory"),
    ("model_input", "the model does not take the shards' samples"),
    ("corrupt", "shard-00001.bin: corrupt"),
    ("truncated", "shard-00001.bin: 25 bytes where the manifest says"),
    ("bad_verify", "data.verify='maybe'"),
])
def test_bad_shard_input_is_a_config_error_naming_the_key(dataset, tmp_path, case, message):
    import shutil

    path = str(tmp_path / "nowhere")
    extra = []
    if case == "no_manifest":
        (tmp_path / "empty").mkdir()
        path = str(tmp_path / "empty")
    elif case in ("corrupt", "truncated", "model_input", "bad_verify"):
        path = str(tmp_path / "copy")
        shutil.copytree(dataset, path)
        shard = tmp_path / "copy" / "shard-00001.bin"
        raw = bytearray(shard.read_bytes())
        if case == "corrupt":
            raw[100] ^= 1
            shard.write_bytes(bytes(raw))
        elif case == "truncated":
            shard.write_bytes(bytes(raw[:25]))
        elif case == "model_input":
            extra = ["model.args.in_features=10"]
        else:
            extra = ["data.verify=maybe"]
    args = ["data=shards"] + ([] if case == "no_path" else [f"data.path={path}"])
    proc = cli.run(args + extra + [f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message.format(tmp=tmp_path) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_make_shards_bad_input(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((5, 3), np.float32))
    np.save(tmp_path / "y.npy", np.zeros((4, 1), np.float32))
    for args, message in ((["features=x.npy"], "targets: missing"),
                          (["features=x.npy", "targets=y.npy", "out=d"], "targets: 4 samples, where features has 5"),
                          (["features=nope.npy", "targets=y.npy", "out=d"], "features='nope.npy': cannot be read"),
                          (["size=3"], "'size=3': expected key=value")):
        proc = cli.run_script(MAKE, args, cwd=tmp_path, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


@pytest.mark.timeout(240)
def test_token_arrays_spanning_part_of_a_pretrained_vocabulary_train(tmp_path):
    """The issue's case from the command line: make_shards.py of token arrays with ids 1000..2999 and a pretrained
    BERT of 30,522 tokens (model=hf) train (Note [vocabulary bound] in parallel/data/shards/manifest.py); a model
    whose outputs stop at the largest id is one line and exit status 2."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    stream = np.random.default_rng(0).integers(1000, 3000, 256 * 16 + 1)
    stream[0] = 2999
    np.save(tmp_path / "x.npy", stream[:-1].reshape(256, 16))
    np.save(tmp_path / "y.npy", stream[1:].reshape(256, 16))
    proc = cli.run_script(MAKE, ["features=x.npy", "targets=y.npy", "out=data"], cwd=tmp_path)
    assert proc.returncode == 0 and "'vocab_size': 3000" in proc.stdout, proc.stderr[-2000:]
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=16)).save_pretrained(tmp_path / "bert")
    data = ["data=shards", f"data.path={tmp_path / 'data'}", "trainer.batch_size=16"]
    cli.run(cli.FAST + data + ["model=hf", f"model.path={tmp_path / 'bert'}", f"run_dir={tmp_path / 'run'}"],
            cwd=tmp_path, timeout=200)
    losses = cli.losses(tmp_path / "run")
    assert len(losses) == 6 and torch.isfinite(losses).all() and losses[-1] < losses[0], losses
    proc = cli.run(data + ["model=gpt", "model.args.vocab_size=2999", f"run_dir={tmp_path / 'refused'}"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("config error:"))
    assert line == (f"config error: data.path='{tmp_path / 'data'}': the model gives outputs of shape (2, 16, 2999) "
                    f"for 2 samples; the shards' lm targets hold token ids up to 2999, at or above its output size "
                    f"2999 (valid: outputs of shape (2, 16, V) with V >= 3000)"), proc.stderr
