"""Text corpora into LM shards (parallel/data/shards/text.py, Note [packing text]), in one process: packing,
documents, tokenizers (a tokenizer.json and a tiktoken file built here), the written windows, bad input."""
import json

import numpy as np
import pytest
import torch

from parallel.config import ConfigError, DataConfig
from parallel.data.shards import Manifest, ShardData, load_tokenizer, text_files, write_text_shards
from parallel.data.shards.text import Packer, batches, documents
from parallel.data.shards.tokenizer import eos_id, token_dtype
from tests import text_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return root, text_corpus.write_corpus(root / "corpus", files=6, docs_per_file=3)


def stream_of(windows: np.ndarray) -> np.ndarray:
    """The token stream back from windows that overlap by one."""
    return np.concatenate([windows[0], *(w[1:] for w in windows[1:])]) if len(windows) else np.empty(0)


@pytest.mark.parametrize("seq_len", [1, 4, 7])
def test_windows_overlap_by_one_whatever_the_chunks(seq_len):
    rng = np.random.default_rng(seq_len)
    stream = rng.integers(0, 1000, 103)
    packer = Packer(seq_len, np.dtype(np.uint16))
    cuts = np.sort(rng.integers(0, len(stream), 9))
    windows = np.concatenate([packer.add(part) for part in np.split(stream, cuts)])
    assert windows.shape == ((len(stream) - 1) // seq_len, seq_len + 1)
    assert (windows[1:, 0] == windows[:-1, -1]).all()  # every next-token pair a target exactly once
    kept = len(windows) * seq_len + 1
    assert (stream_of(windows) == stream[:kept]).all() and packer.dropped == len(stream) - kept


def test_documents_by_file_line_and_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("one two\nthree\n\nfour\n")
    (tmp_path / "b.txt").write_text("five\n")
    files = text_files(f"{tmp_path}/*.txt")
    assert list(documents(files, "file")) == [("one two\nthree\n\nfour\n", True), ("five\n", True)]
    assert list(documents(files, "line")) == [("one two", True), ("three", True), ("four", True), ("five", True)]
    assert list(documents(files, "paragraph")) == [("one two\nthree", True), ("four", True), ("five", True)]
    seen = []
    list(documents(files, "file", read=seen.append))
    assert sum(seen) == sum(f.stat().st_size for f in files)  # progress counts every byte
    (tmp_path / "c.txt").write_text("  indented, ending in punctuation.\n" * 100)  # no place the patterns cut
    pieces = [text for text, _ in documents([tmp_path / "c.txt"], "file", chunk_chars=20)]
    assert len(pieces) == 100 // 3 + 1 and {len(p) for p in pieces[:-1]} == {35 * 3}  # cut at 4 x 20 characters


@pytest.mark.parametrize("kind", ["bpe", "tiktoken", "tiktoken-pattern"])
def test_a_long_document_in_pieces_gives_the_tokens_of_the_whole(corpus, kind):
    root, files = corpus
    if kind == "bpe":
        tok = load_tokenizer(str(text_corpus.bytelevel_bpe(root / "bpe.json", files)))
    else:
        pattern = text_corpus.PUNCT_NEWLINE_PATTERN if kind == "tiktoken-pattern" else None
        tok = load_tokenizer(str(text_corpus.tiktoken_file(root / "words.tiktoken")), pattern)
    whole = np.concatenate([tok.encode([f.read_text()])[0] for f in files])
    pieces = list(documents(files, "file", chunk_chars=100))
    assert len(pieces) > 3 * len(files)  # really cut, in both places
    assert any(text[:1] == "\n" for text, _ in pieces) and any(text[-1:] == "\n" for text, _ in pieces)
    assert "".join(text for text, _ in pieces) == "".join(f.read_text() for f in files)
    ids = np.concatenate(list(batches(iter(pieces), tok, eos=None, batch_chars=300)))
    assert (ids == whole).all()


def test_tiktoken_file_is_read_locally_with_an_end_of_text_token(tmp_path):
    path = text_corpus.tiktoken_file(tmp_path / "words.tiktoken")
    tok = load_tokenizer(str(path))
    n_ranks = len(path.read_text().splitlines())
    assert tok.kind == "tiktoken" and tok.vocab_size == n_ranks + 1 and tok.eos == "<|endoftext|>"
    assert eos_id(tok, None, str(path)) == n_ranks
    ids = tok.encode(["the cat sat on the mat."])[0]
    # " the" and the other words merged whole; "the" at the start has no merges (bytes), "." neither
    assert ids == [*b"the", *(tok.token_id(w) for w in (" cat", " sat", " on", " the", " mat")), ord(".")]
    assert tok.encode(["a\n\n"])[0] == [ord("a"), tok.token_id("\n\n")]
    assert eos_id(tok, " dog", str(path)) == tok.token_id(" dog")


def test_eos_from_the_tokenizer_its_config_or_the_command_line(tmp_path):
    path = text_corpus.wordlevel(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert tok.kind == "tokenizers" and tok.eos == "<|endoftext|>"
    assert eos_id(tok, None, str(path)) == tok.token_id("<|endoftext|>") and eos_id(tok, "none", "") is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "."}}))
    assert load_tokenizer(str(path)).eos == "."
    bare = load_tokenizer(str(text_corpus.wordlevel(tmp_path / "bare" / "tokenizer.json", eos=None)))
    with pytest.raises(ConfigError, match="names no end-of-text token: give one with eos=TOKEN"):
        eos_id(bare, None, "t.json")
    with pytest.raises(ConfigError, match="eos='<s>': not a single token"):
        eos_id(bare, "<s>", "t.json")


@pytest.mark.parametrize("split", ["file", "paragraph"])
def test_written_windows_are_the_documents_tokens_each_followed_by_eos(corpus, tmp_path, split):
    root, files = corpus
    tok = load_tokenizer(str(text_corpus.wordlevel(root / "wl.json")))
    eos = eos_id(tok, None, "wl.json")
    stats = write_text_shards(files, tok, str(tmp_path / "out"), seq_len=8, split=split, eos=eos,
                              shard_size=16, progress=False)
    docs = [text for text, _ in documents(files, split)]
    expected = np.concatenate([[*ids, eos] for ids in tok.encode(docs)])
    m = Manifest.load(tmp_path / "out")
    assert m.record["hints"] == {"task": "lm", "seq_len": 8, "vocab_size": tok.vocab_size}
    assert m.fields == [{"name": "tokens", "dtype": "<u2", "shape": [9]}] and len(m.shards) > 1
    windows = np.concatenate([np.fromfile(m.root / s["file"], m.dtype)["tokens"] for s in m.shards])
    assert stats.documents == len(docs) == (6 if split == "file" else 18)
    assert stats.tokens == len(expected) and stats.samples == m.count == (len(expected) - 1) // 8
    assert (stream_of(windows) == expected[:len(stream_of(windows))]).all()
    assert stats.dropped == len(expected) - 1 - 8 * m.count

    cfg = DataConfig(name="shards", path=str(tmp_path / "out"), task="lm", seq_len=8, shuffle_buffer=0)
    data = ShardData(cfg, seed=0, batch_size=4)
    x, y = data.batch(1, torch.device("cpu"))
    data.close()
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (4, 8)
    assert (x == torch.from_numpy(windows[:4, :-1].astype(np.int64))).all() and (y[:, :-1] == x[:, 1:]).all()


def test_bad_text_input_is_a_config_error(corpus, tmp_path):
    root, files = corpus
    tok = load_tokenizer(str(text_corpus.wordlevel(root / "wl.json")))
    cases = [
        (lambda: text_files(str(tmp_path / "nope.txt")), "nope.txt': no such file or directory"),
        (lambda: text_files(str(tmp_path / "*.md")), "matches no file"),
        (lambda: load_tokenizer(str(tmp_path / "missing.json")), "missing.json': cannot be read"),
        (lambda: load_tokenizer(str(tmp_path)), "a directory without tokenizer.json"),
        (lambda: token_dtype("uint16", 70_000), "dtype='uint16': holds ids up to 65535, the tokenizer's "
                                                "vocabulary has 70000"),
        (lambda: token_dtype("float", 10), "dtype='float': unknown"),
        (lambda: write_text_shards(files, tok, str(tmp_path / "o1"), seq_len=0), "seq_len=0: must be a positive number"),
        (lambda: write_text_shards(files[:1], tok, str(tmp_path / "o2"), seq_len=10_000, progress=False),
         "fewer than seq_len + 1 = 10001: not one sample"),
    ]
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "garbage.tiktoken").write_text("this is not base64\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    cases += [
        (lambda: load_tokenizer(str(tmp_path / "garbage.json")), "not a Hugging Face tokenizer.json"),
        (lambda: load_tokenizer(str(tmp_path / "garbage.tiktoken")), "line 1 is not `base64-token rank`"),
        (lambda: load_tokenizer(str(root / "wl.json"), pattern=r"\w+"), "only for a tiktoken file"),
        (lambda: list(documents([tmp_path / "latin1.txt"], "line")), "latin1.txt:1: not UTF-8 text"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert message in str(e.value), (message, str(e.value))


def test_directories_expand_to_their_files_without_hidden_ones(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / ".hidden").mkdir()
    for name in ("d/b.txt", "d/sub/a.txt", "d/.hidden/x.txt", "d/.swp", "c.txt"):
        (tmp_path / name).write_text("x\n")
    got = text_files(f"{tmp_path / 'd'},{tmp_path / 'c.txt'}")
    assert [p.relative_to(tmp_path).as_posix() for p in got] == ["d/b.txt", "d/sub/a.txt", "c.txt"]


def test_shards_without_the_fields_training_reads_are_config_errors(tmp_path):
    from parallel.data.shards import read_hints, write_shards

    write_shards([{"tokens": np.zeros(1, np.uint16)}] * 3, tmp_path / "short")
    write_shards([{"a": np.zeros(2), "b": np.zeros(2)}] * 3, tmp_path / "other")
    for name, message in (("short", "tokens of shape (1,): a window needs shape (seq_len + 1,)"),
                          ("other", "samples have no field 'targets' (they have ['a', 'b']); training reads "
                                    "'features' and 'targets', or 'tokens'")):
        with pytest.raises(ConfigError) as e:
            read_hints(tmp_path / name)
        assert message in str(e.value), str(e.value)
