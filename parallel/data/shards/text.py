"""Text corpora as language-model shards: text files streamed a line at a time, tokenized in batches by a
local tokenizer (tokenizer.py: a Hugging Face tokenizer.json or a tiktoken file; nothing is downloaded), packed into
windows of seq_len + 1 tokens and written by ShardWriter (launch/make_shards.py text=...).

# Note [packing text]
The corpus becomes one stream of tokens: each document's tokens, then the
end-of-text token (`eos`; none with eos=none), then the next document's. The
stream is cut into windows of seq_len + 1 tokens that overlap by one: window i
holds tokens i*L .. i*L + L (L = seq_len), so its inputs are the first L and
its targets the last L, and every next-token pair of the stream is a target
exactly once (windows that did not overlap would never train the pair across
their boundary). Documents are packed back to back, a window may hold the end
of one and the start of the next; the end-of-text token between them tells
the model so (attention is not masked at the boundary). What is left after the
last full window (fewer than seq_len tokens) is dropped and counted.

Memory is bounded whatever the corpus: a file is read a line at a time, a
document is tokenized in pieces of about `CHUNK_CHARS` characters, a batch of
pieces (`BATCH_CHARS`) at a time, and only the tokens of one batch plus the
unfinished window are held before ShardWriter writes them out. Pieces are cut
where the split patterns of byte-level BPE (GPT-2's, tiktoken's cl100k and
o200k) and of whitespace pre-tokenizers cut the text anyway: between a line
that ends in a non-space character and one that starts with one, or before the
line break of a line that ends in a letter or digit (`_file_pieces`). There
the pieces give the tokens of the whole document (tested); a run of 4 pieces'
worth of text with no such place is cut at a line break all the same, and
tokenizers that add a prefix space at the start of a text (some
SentencePiece-style ones) add one per piece. A line is never split, so the
longest line bounds memory.
"""
from __future__ import annotations

import glob
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from parallel.config import ConfigError
from parallel.data.shards.manifest import DEFAULT_SHARD_BYTES, Manifest
from parallel.data.shards.tokenizer import Tokenizer
from parallel.data.shards.writer import ShardWriter

CHUNK_CHARS = 1 << 15  # characters of a document tokenized as one piece (at least; at most 4x)
BATCH_CHARS = 1 << 19  # characters tokenized in one call (the tokenizers parallelize over a batch's pieces)
SPLITS = ("file", "line", "paragraph")


def text_files(spec: str) -> list[Path]:
    """The files `spec` names: comma-separated files, directories (every file under them, hidden ones
    skipped) and glob patterns (`**` recursive), each expanded in sorted order."""
    files: list[Path] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if any(c in item for c in "*?["):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise ConfigError(f"text={spec!r}: {item!r} matches no file")
        else:
            matches = [item]
        for m in map(Path, matches):
            if m.is_dir():
                files += sorted(f for f in m.rglob("*") if f.is_file()
                                and not any(part.startswith(".") for part in f.relative_to(m).parts))
            elif m.is_file():
                files.append(m)
            else:
                raise ConfigError(f"text={spec!r}: {str(m)!r}: no such file or directory")
    if not files:
        raise ConfigError(f"text={spec!r}: names no file")
    return list(dict.fromkeys(files))


def documents(files: list[Path], split: str, read: Callable[[int], None] = lambda n: None,
              chunk_chars: int = CHUNK_CHARS) -> Iterator[tuple[str, bool]]:
    """The corpus as pieces of text, each with whether it ends a document (Note [packing text]).

    Args:
        files: the text files (UTF-8).
        split: what a document is: a whole `file`, each non-empty `line`, or each `paragraph` (lines
            up to a blank line).
        read: called with the bytes read since its last call, before each piece (progress).
        chunk_chars: a `file` document is cut into pieces of about this many characters.
    """
    pieces = {"file": _file_pieces, "line": _line_pieces, "paragraph": _paragraph_pieces}[split]
    for path in files:
        consumed = [0]  # bytes of `path` read so far
        reported = 0
        for piece in pieces(_lines(path, consumed), chunk_chars):
            read(consumed[0] - reported)
            reported = consumed[0]
            yield piece
        read(consumed[0] - reported)


def _lines(path: Path, consumed: list[int]) -> Iterator[str]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            consumed[0] += len(raw)
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _line_pieces(lines: Iterator[str], chunk_chars: int) -> Iterator[tuple[str, bool]]:
    for line in lines:
        if line.strip():
            yield line.rstrip("\r\n"), True


def _paragraph_pieces(lines: Iterator[str], chunk_chars: int) -> Iterator[tuple[str, bool]]:
    buf: list[str] = []
    for line in chain(lines, [""]):
        if line.strip():
            buf.append(line)
        elif buf:
            yield "".join(buf).rstrip("\r\n"), True
            buf = []


def _file_pieces(lines: Iterator[str], chunk_chars: int) -> Iterator[tuple[str, bool]]:
    """A whole file as one document, in pieces cut where the split patterns cut anyway (Note [packing
    text]) once a piece holds `chunk_chars`: (a) between a line ending in a non-space character and one
    starting with one; (b) before the line break of a line ending in a letter or digit; (c) at any line
    break once a piece holds 4 x chunk_chars without either (there the tokens may differ a little)."""
    buf: list[str] = []
    size = 0
    for line in lines:
        if size >= chunk_chars and buf:
            body = buf[-1].rstrip("\r\n")
            if (body and not body[-1].isspace() and line[:1] and not line[:1].isspace()) \
                    or size >= 4 * chunk_chars:
                yield "".join(buf), False
                buf, size = [], 0
        buf.append(line)
        size += len(line)
        body = line.rstrip("\r\n")
        if size >= chunk_chars and body[-1:].isalnum() and len(body) < len(line):
            buf[-1] = body
            yield "".join(buf), False
            buf, size = [line[len(body):]], len(line) - len(body)
    if buf:
        yield "".join(buf), True


class Packer:
    """Token stream -> windows of seq_len + 1 overlapping by one token (Note [packing text])."""

    def __init__(self, seq_len: int, dtype: np.dtype):
        self.seq_len = seq_len
        self.carry = np.empty(0, dtype)  # tokens not yet in a window (the last window's last one included)

    def add(self, tokens: np.ndarray) -> np.ndarray:
        """The full windows the stream holds once `tokens` are appended: (n, seq_len + 1), a view."""
        t = np.concatenate([self.carry, tokens.astype(self.carry.dtype, copy=False)])
        n = max(0, (len(t) - 1) // self.seq_len)
        width = self.seq_len + 1
        rows = sliding_window_view(t, width)[::self.seq_len][:n] if n else t[:0].reshape(0, width)
        self.carry = t[n * self.seq_len:].copy()
        return rows

    @property
    def dropped(self) -> int:
        """Tokens after the last window that no window holds."""
        return max(0, len(self.carry) - 1)


def batches(pieces: Iterator[tuple[str, bool]], tok: Tokenizer, eos: int | None,
            batch_chars: int = BATCH_CHARS) -> Iterator[np.ndarray]:
    """Token ids of about `batch_chars` characters of text at a time, `eos` after each document's."""
    texts: list[str] = []
    ends: list[bool] = []
    size = 0
    for text, end in chain(pieces, [(None, None)]):
        if text is not None:
            texts.append(text)
            ends.append(end)
            size += len(text)
        if texts and (size >= batch_chars or text is None):
            parts: list = []
            for ids, last in zip(tok.encode(texts), ends):
                parts.append(ids)
                if last and eos is not None:
                    parts.append((eos,))
            yield np.fromiter(chain.from_iterable(parts), np.int64, sum(map(len, parts)))
            texts, ends, size = [], [], 0
            _release_freed_memory()


def _trim_function() -> Callable[[], None]:
    """glibc's malloc_trim(0), or nothing where there is no glibc.

    A tokenizer's worker threads allocate and free a batch's encodings in their own malloc arenas, and
    glibc keeps what they freed: with `tokenizers` the peak RSS grew by ~100 MB over 50 MB of varied text
    (not over the same text repeated), though nothing is held. Trimming after each batch hands it back; it
    costs well under a millisecond per batch of 1 MB of text.
    """
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0) and None


_release_freed_memory = _trim_function()


@dataclass
class TextStats:
    """What write_text_shards read and wrote."""

    files: int = 0
    bytes: int = 0
    documents: int = 0
    tokens: int = 0
    samples: int = 0
    dropped: int = 0
    seconds: float = 0.0
    manifest: Manifest | None = field(default=None, repr=False)


def write_text_shards(files: list[Path], tok: Tokenizer, out: str, seq_len: int, *, split: str = "file",
                      eos: int | None = None, dtype: np.dtype = np.dtype(np.uint16),
                      shard_size: int | str = DEFAULT_SHARD_BYTES, progress: bool = True) -> TextStats:
    """Tokenize `files` and write them under `out` as windows of seq_len + 1 tokens (Note [packing text]).

    Args:
        files: UTF-8 text files (text_files).
        tok: the tokenizer (load_tokenizer).
        out: the dataset directory.
        seq_len: tokens a sample feeds the model (its window holds one more, the last target).
        split: what a document is (`documents`).
        eos: the id appended after each document (eos_id), or None.
        dtype: the stored id type (token_dtype).
        shard_size: samples per shard, or a size with a unit.
        progress: a progress bar on stderr.
    """
    from tqdm import tqdm

    if seq_len < 1:
        raise ConfigError(f"seq_len={seq_len}: must be a positive number of tokens")
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}: unknown (one of {list(SPLITS)})")
    stats = TextStats(files=len(files), bytes=sum(f.stat().st_size for f in files))
    t0 = time.perf_counter()
    # 4 MB gathered per write (not the default 16): a few batches' windows; memory is the tokenizer's.
    writer = ShardWriter(out, shard_size, chunk_bytes=4 << 20, hints={"vocab_size": tok.vocab_size})
    packer = Packer(seq_len, dtype)
    bar = tqdm(total=stats.bytes, unit="B", unit_scale=True, desc="tokenize", disable=not progress,
               mininterval=0.5, dynamic_ncols=True)

    def pieces() -> Iterator[tuple[str, bool]]:
        for text, end in documents(files, split, bar.update):
            stats.documents += end
            yield text, end

    with bar:
        for tokens in batches(pieces(), tok, eos):
            stats.tokens += len(tokens)
            rows = packer.add(tokens)
            if len(rows):
                writer.add_arrays({"tokens": rows})
                stats.samples += len(rows)
            bar.set_postfix_str(f"{stats.tokens:,} tokens", refresh=False)
    if stats.samples == 0:
        raise ConfigError(f"the text holds {stats.tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                          f"not one sample")
    stats.manifest = writer.close()
    stats.dropped, stats.seconds = packer.dropped, time.perf_counter() - t0
    return stats
