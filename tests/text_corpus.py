"""Text corpora and local tokenizers built by the tests (nothing downloaded): a corpus of documents from a
small grammar, a WordLevel and a byte-level BPE tokenizer.json trained on it, and a tiktoken file."""
from __future__ import annotations

import base64
import random
from pathlib import Path

WORDS = ("the a cat dog bird sat ran flew on under over mat house tree big small red blue quickly slowly and "
         "then saw heard it they").split()


def sentence(rng: random.Random) -> str:
    # A pattern the model can learn: a determiner, adjectives, a noun, a verb, a place.
    return " ".join([rng.choice(("the", "a")), rng.choice(("big", "small", "red", "blue")),
                     rng.choice(("cat", "dog", "bird")), rng.choice(("sat", "ran", "flew")),
                     rng.choice(("on", "under", "over")), "the", rng.choice(("mat", "house", "tree"))]) + "."


def document(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(1, 5)):
        line = " ".join(sentence(rng) for _ in range(rng.randint(1, 3)))
        lines.append(line[:-1] if rng.random() < 0.3 else line)  # some lines end in a letter
        if rng.random() < 0.2:
            lines.append("  " + sentence(rng))  # an indented line
    return "\n".join(lines) + "\n"


def write_corpus(root: Path, files: int, docs_per_file: int = 1, seed: int = 0) -> list[Path]:
    """`files` text files under `root`, each `docs_per_file` documents separated by a blank line."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        path = root / f"doc-{i:05d}.txt"
        path.write_text("\n".join(document(rng) for _ in range(docs_per_file)))
        paths.append(path)
    return paths


def wordlevel(path: Path, eos: str | None = "<|endoftext|>") -> Path:
    """A WordLevel tokenizer.json over WORDS and ".", split on whitespace and punctuation."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", ".", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos:
        tok.add_special_tokens([eos])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def bytelevel_bpe(path: Path, files: list[Path], vocab_size: int = 400) -> Path:
    """A GPT-2-style byte-level BPE tokenizer.json trained on `files`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in files], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(path))
    return path


# A split pattern in the manner of tiktoken's newer encodings: punctuation keeps the line breaks after it.
PUNCT_NEWLINE_PATTERN = r" ?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"


def tiktoken_file(path: Path, words=WORDS) -> Path:
    """A tiktoken file: the 256 bytes, runs of line breaks and of spaces (so that a piece cut in the wrong
    place tokenizes differently), then each word with its leading space merged a byte at a time
    (" t", " th", " the": every merge joins two tokens that exist before it)."""
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for run in (b"\n\n", b"\n\n\n", b"  ", b"   ", b"\n ", b"\n  ", b".\n", b".\n\n"):
        ranks[run] = len(ranks)
    for w in words:
        piece = b" " + w.encode()
        for end in range(2, len(piece) + 1):
            ranks.setdefault(piece[:end], len(ranks))
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path
