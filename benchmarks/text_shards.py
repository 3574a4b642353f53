"""make_shards.py text=... on a real corpus: its tokens/s against the tokenizer's own, and its peak RSS over
1x and 10x the text.

    python benchmarks/text_shards.py [--mb 50] [--vocab 32000] [--corpus DIR]

In one invocation:
  1. a corpus of about --mb MB of UTF-8 text: the Python sources of this
     interpreter's standard library and site-packages (code, comments and
     docstrings people wrote), in files of about 1 MB; or the files of --corpus;
     "1x" is its first tenth, "10x" all of it;
  2. two local tokenizers: a byte-level BPE tokenizer.json (`tokenizers`)
     trained on the 1x part with --vocab tokens, and the same vocabulary as a
     tiktoken file (GPT-2's split pattern, as the tokenizer.json's), so both
     give the same tokens;
  3. per tokenizer: its own batch encoding of the 10x text held in memory
     (encode_batch_fast / encode_ordinary_batch, 1 MB of text a call, as
     make_shards calls it), then make_shards.py in fresh processes on 1x and
     on 10x, each reporting its tokens/s (tokenizing, packing and writing) and
     its peak RSS (ru_maxrss of the child).

Prints a table and writes benchmarks/results/text_shards.json. Targets: make_shards
keeps >= 0.9 x the tokenizer's own tokens/s; peak RSS grows <= 10% from 1x to 10x.
"""
from __future__ import annotations

import argparse
import base64
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MAKE = str(ROOT / "launch" / "make_shards.py")
PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stderr=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def build_corpus(out: Path, megabytes: float, source: Path | None) -> list[Path]:
    """Files of about 1 MB under out/1x (the first tenth) and out/more (the rest)."""
    roots = [source] if source else [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    want, done, files, buf = int(megabytes * 1e6), 0, [], []
    for path in (p for r in roots for p in sorted(r.rglob("*" if source else "*.py"))):
        try:
            buf.append(path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if sum(map(len, buf)) >= 1_000_000 or done + sum(map(len, buf)) >= want:
            part = "1x" if done < want // 10 else "more"
            f = out / part / f"part-{len(files):04d}.txt"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("".join(buf))
            done += f.stat().st_size
            files.append(f)
            buf = []
        if done >= want:
            break
    return files


def byte_to_char() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes as themselves, the others shifted past 255 (the mapping
    GPT-2's tokenizer and `tokenizers`' ByteLevel use), needed to turn its vocabulary back into bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(shifted)) for b in range(256)}


def tokenizers_for(out: Path, train: list[Path], vocab: int) -> dict[str, Path]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in train], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    to_byte = {c: b for b, c in byte_to_char().items()}
    ranks = {bytes(to_byte[c] for c in token): i for token, i in tok.get_vocab().items() if token != "<|endoftext|>"}
    (out / "bpe.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                              for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
    return {"tokenizer.json": out / "tokenizer.json", "tiktoken": out / "bpe.tiktoken"}


def own_speed(path: Path, files: list[Path]) -> tuple[float, int]:
    """The tokenizer's own tokens/s over the text in memory, in the pieces and batches make_shards gives it
    (cut before the clock starts); and the token count."""
    from parallel.data.shards import load_tokenizer
    from parallel.data.shards.text import BATCH_CHARS, documents

    tok = load_tokenizer(str(path))
    calls, batch = [], []
    for text, _ in documents(files, "file"):
        batch.append(text)
        if sum(map(len, batch)) >= BATCH_CHARS:
            calls.append(batch)
            batch = []
    calls.append(batch)
    t0, n = time.perf_counter(), 0
    for batch in calls:
        n += sum(map(len, tok.encode(batch)))
    return n / (time.perf_counter() - t0), n


def make_shards(text: str, tokenizer: Path, out: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK, sys.executable, MAKE, f"text={text}", f"tokenizer={tokenizer}",
                           "seq_len=1024", f"out={out}"], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    line = proc.stdout.strip().splitlines()[0]
    tokens = int(re.search(r"-> ([\d,]+) tokens", line).group(1).replace(",", ""))
    rate = float(re.search(r"\(([\d,]+) tokens/s", line).group(1).replace(",", ""))
    return {"tokens": tokens, "tokens_per_s": rate, "wall_s": wall,
            "rss_peak_mb": int(proc.stdout.split()[-1]) / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=50)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--corpus", type=Path)
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = build_corpus(tmp / "corpus", a.mb, a.corpus)
        one = [f for f in files if f.parent.name == "1x"]
        total = sum(f.stat().st_size for f in files)
        t0 = time.perf_counter()
        toks = tokenizers_for(tmp, one, a.vocab)
        print(f"corpus {total / 1e6:.1f} MB in {len(files)} files (1x: {sum(f.stat().st_size for f in one) / 1e6:.1f} "
              f"MB); tokenizers trained in {time.perf_counter() - t0:.0f} s", flush=True)
        for name, path in toks.items():
            own, n = own_speed(path, files)
            small = make_shards(str(tmp / "corpus" / "1x"), path, tmp / f"out-{name}-1x")
            big = make_shards(f"{tmp / 'corpus'}/1x,{tmp / 'corpus'}/more", path, tmp / f"out-{name}-10x")
            assert big["tokens"] == n + len(files), (big["tokens"], n)  # each file's tokens and an end-of-text
            rows.append({"tokenizer": name, "own_tokens_per_s": own, "make_shards_1x": small, "make_shards_10x": big,
                         "ratio": big["tokens_per_s"] / own, "rss_growth": big["rss_peak_mb"] / small["rss_peak_mb"]})
    print(f"\n{'tokenizer':<15} {'own tok/s':>11} {'make_shards tok/s':>18} {'ratio':>6} {'tokens':>11} "
          f"{'RSS 1x MB':>10} {'RSS 10x MB':>11} {'growth':>7}")
    for r in rows:
        b, s = r["make_shards_10x"], r["make_shards_1x"]
        print(f"{r['tokenizer']:<15} {r['own_tokens_per_s']:>11,.0f} {b['tokens_per_s']:>18,.0f} {r['ratio']:>6.2f} "
              f"{b['tokens']:>11,} {s['rss_peak_mb']:>10.0f} {b['rss_peak_mb']:>11.0f} {r['rss_growth']:>7.3f}")
    out = ROOT / "benchmarks" / "results" / "text_shards.json"
    out.write_text(json.dumps({"corpus_mb": total / 1e6, "vocab": a.vocab, "rows": rows}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
