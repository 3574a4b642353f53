"""Local tokenizers for text shards (text.py): a Hugging Face tokenizer.json through `tokenizers`, or a
tiktoken file through `tiktoken`, read from disk (nothing is downloaded), behind one small interface; the
end-of-text token that separates documents, and the dtype the token ids are stored in."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from parallel.config import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}
# Names tokenizers give their end-of-text token, tried in this order when tokenizer_config.json names none.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


@dataclass
class Tokenizer:
    """One interface over a Hugging Face tokenizer and a tiktoken encoding.

    Attributes:
        kind: "tokenizers" or "tiktoken".
        vocab_size: ids run 0 .. vocab_size - 1 (special tokens included).
        eos: the end-of-text token's text, when the tokenizer has one.
        encode: texts -> their token ids, one sequence per text (no special tokens added).
        token_id: a token's text -> its id, or None when it is not a single token.
    """

    kind: str
    vocab_size: int
    eos: str | None
    encode: Callable[[list[str]], list]
    token_id: Callable[[str], int | None]


def load_tokenizer(path: str, pattern: str | None = None) -> Tokenizer:
    """The tokenizer in `path`: a tokenizer.json (or a directory holding one), else a tiktoken file.

    Args:
        path: the file or directory.
        pattern: a tiktoken file's split pattern (a regex); default GPT-2's. Not for tokenizer.json,
            which holds its own.
    """
    p = Path(path)
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise ConfigError(f"tokenizer={path!r}: a directory without tokenizer.json")
        p = p / "tokenizer.json"
    try:
        with open(p, "rb") as f:
            head = f.read(64).lstrip()
    except OSError as e:
        raise ConfigError(f"tokenizer={path!r}: cannot be read ({e.strerror or e})") from None
    if head.startswith(b"{"):
        if pattern is not None:
            raise ConfigError(f"pattern={pattern!r}: only for a tiktoken file; {path!r} is a tokenizer.json, "
                              f"whose pre-tokenizer splits the text")
        return _hf_tokenizer(p, path)
    return _tiktoken_tokenizer(p, path, pattern)


def _need(package: str, what: str):
    """Import an optional dependency (the `text` extra), or say which package to install."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"reading {what} needs the {package!r} package (pip install 'parallel[text]')") from None


def _hf_tokenizer(p: Path, path: str) -> Tokenizer:
    HFTokenizer = _need("tokenizers", "a tokenizer.json").Tokenizer

    try:
        tok = HFTokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a malformed file
        raise ConfigError(f"tokenizer={path!r}: not a Hugging Face tokenizer.json ({e})") from None
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    eos = _configured_eos(p.parent / "tokenizer_config.json")
    if eos is None:
        eos = next((name for name in EOS_NAMES if name in specials), None)

    def encode(texts: list[str]) -> list:
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]

    return Tokenizer("tokenizers", tok.get_vocab_size(with_added_tokens=True), eos, encode, tok.token_to_id)


def _configured_eos(config: Path) -> str | None:
    """tokenizer_config.json's `eos_token` (a string, or a dict with its `content`), where there is one."""
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def _tiktoken_tokenizer(p: Path, path: str, pattern: str | None) -> Tokenizer:
    tiktoken = _need("tiktoken", "a tiktoken file")
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    ranks = _read_ranks(p, path)
    # The file holds only the merges: the end-of-text token gets the next free id, as GPT-2's does.
    specials = {ENDOFTEXT: max(ranks.values()) + 1}
    try:
        enc = tiktoken.Encoding(p.stem, pat_str=pattern or r50k_pat_str, mergeable_ranks=ranks,
                                special_tokens=specials)
    except ValueError as e:  # a pattern the regex engine refuses
        raise ConfigError(f"pattern={pattern!r}: not a usable split pattern ({e})") from None

    def token_id(text: str) -> int | None:
        try:
            return enc.encode_single_token(text)
        except KeyError:
            return None

    def encode(texts: list[str]) -> list:
        return enc.encode_ordinary_batch(texts)

    return Tokenizer("tiktoken", enc.n_vocab, ENDOFTEXT, encode, token_id)


def _read_ranks(p: Path, path: str) -> dict[bytes, int]:
    """A tiktoken file's merges: one `base64-token rank` per line. Read here rather than with
    tiktoken.load.load_tiktoken_bpe, which caches a local file by its path in a shared temporary
    directory and would serve a stale copy once the file changes."""
    ranks = {}
    with open(p, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise ConfigError(f"tokenizer={path!r}: neither a tokenizer.json nor a tiktoken file "
                                  f"(line {n} is not `base64-token rank`)") from None
    if not ranks:
        raise ConfigError(f"tokenizer={path!r}: an empty tiktoken file")
    return ranks


def token_dtype(name: str, vocab_size: int) -> np.dtype:
    """The id dtype `name` (auto: uint16 when the vocabulary fits, else uint32); ConfigError when
    `vocab_size` ids do not fit it."""
    if name == "auto":
        name = "uint16" if vocab_size <= 1 << 16 else "uint32"
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r}: unknown (one of {['auto', *DTYPES]})")
    dtype = np.dtype(DTYPES[name])
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise ConfigError(f"dtype={name!r}: holds ids up to {np.iinfo(dtype).max}, the tokenizer's vocabulary "
                          f"has {vocab_size} (dtype=auto picks one that fits)")
    return dtype


def eos_id(tok: Tokenizer, eos: str | None, path: str) -> int | None:
    """The separator's id: `eos` (a token's text; "none": no separator) or, by default, the tokenizer's
    end-of-text token. ConfigError when neither names a single token."""
    if eos == "none":
        return None
    name = tok.eos if eos is None else eos
    if name is None:
        raise ConfigError(f"tokenizer={path!r} names no end-of-text token: give one with eos=TOKEN (a token "
                          f"of its vocabulary), or eos=none to join documents without a separator")
    i = tok.token_id(name)
    if i is None:
        raise ConfigError(f"eos={name!r}: not a single token of tokenizer={path!r}")
    return i
