"""make_shards.py text=... from the command line: a corpus trains a language model, memory stays flat for 10x
the text, bad input is one line and exit status 2."""
import subprocess
import sys

import pytest

from tests import cli, text_corpus

MAKE = str(cli.ROOT / "launch" / "make_shards.py")


def make_shards(args: list[str], cwd, check: bool = True) -> subprocess.CompletedProcess:
    proc = cli.run_script(MAKE, list(map(str, args)), cwd=cwd)
    assert not check or proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(200)
def test_a_text_corpus_trains_a_language_model(tmp_path):
    text_corpus.write_corpus(tmp_path / "corpus" / "part1", files=20, docs_per_file=4)
    text_corpus.write_corpus(tmp_path / "corpus" / "part2", files=20, docs_per_file=4, seed=1)
    tok = text_corpus.wordlevel(tmp_path / "tok" / "tokenizer.json")
    proc = make_shards([f"text={tmp_path}/corpus/part1,{tmp_path}/corpus/part2/*.txt", f"tokenizer={tok.parent}",
                        "seq_len=32", "split=paragraph", f"out={tmp_path / 'data'}"], tmp_path)
    vocab = len(text_corpus.WORDS) + 3  # the words, "[UNK]", "." and the end-of-text token
    assert "160 documents" in proc.stdout and f"'task': 'lm', 'seq_len': 32, 'vocab_size': {vocab}" in proc.stdout
    assert "tokenize" in proc.stderr  # the progress bar
    run_dir = tmp_path / "run"
    cli.run(cli.FAST + ["data=shards", f"data.path={tmp_path / 'data'}", "model=gpt", "trainer.steps=30",
                        "trainer.batch_size=16", f"run_dir={run_dir}"], cwd=tmp_path)
    losses = cli.losses(run_dir)
    assert len(losses) == 30 and losses[-5:].mean() < 0.6 * losses[:5].mean(), losses  # it learns the grammar


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["tiktoken", "tokenizer.json"])
def test_ten_times_the_text_does_not_raise_peak_rss(tmp_path, kind):
    """Peak RSS of make_shards (a child process of its own) over 2 MB of text and over 20 MB: it holds a batch
    of text and its tokens, not the corpus."""
    small = text_corpus.write_corpus(tmp_path / "small", files=200, docs_per_file=50)
    (tmp_path / "big").mkdir()
    for k in range(10):
        for f in small:
            (tmp_path / "big" / f"{k}-{f.name}").write_bytes(f.read_bytes())
    tok = (text_corpus.tiktoken_file(tmp_path / "words.tiktoken") if kind == "tiktoken"
           else text_corpus.bytelevel_bpe(tmp_path / "tokenizer.json", small[:20]))
    peak = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    peaks = {}
    for name in ("small", "big"):
        proc = subprocess.run([sys.executable, "-c", peak, sys.executable, MAKE, f"text={tmp_path / name}",
                               f"tokenizer={tok}", "seq_len=64", "shard_size=1MB", f"out={tmp_path / ('out-' + name)}"],
                              env=cli.env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        peaks[name] = int(proc.stdout.split()[-1])
        assert f"{len(small) * (1 if name == 'small' else 10)} files" in proc.stdout
    assert peaks["big"] <= 1.10 * peaks["small"], peaks


def test_bad_text_input_is_one_line_and_exit_status_2(tmp_path):
    tok = text_corpus.wordlevel(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text("the cat sat.\n")
    for args, message in (
        ([f"text={tmp_path}/a.txt", f"tokenizer={tmp_path}/nope.json", "seq_len=8", "out=d"],
         "tokenizer='{tmp}/nope.json': cannot be read"),
        ([f"text={tmp_path}/a.txt", f"tokenizer={tok}", "seq_len=0", "out=d"], "seq_len=0: must be a positive"),
        ([f"text={tmp_path}/a.txt", f"tokenizer={tok}", "features=x.npy", "seq_len=8", "out=d"],
         "features: not an option with text="),
    ):
        proc = make_shards(args, tmp_path, check=False)
        assert proc.returncode == 2 and message.format(tmp=tmp_path) in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
