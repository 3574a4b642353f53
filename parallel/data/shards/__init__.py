"""Datasets larger than RAM: fixed-size record shards on disk (manifest.py: Note [shard format]), written in
bounded memory (writer.py; text corpora tokenized and packed by text.py: Note [packing text]) and streamed a
batch at a time (reader.py: Note [shard order])."""
from parallel.data.shards.manifest import Manifest, ShardError, check_shards, read_hints, vocab_is_bound
from parallel.data.shards.reader import ShardData
from parallel.data.shards.text import text_files, write_text_shards
from parallel.data.shards.tokenizer import load_tokenizer
from parallel.data.shards.writer import ShardWriter, write_shards

__all__ = ["Manifest", "ShardData", "ShardError", "ShardWriter", "check_shards", "load_tokenizer", "read_hints",
           "text_files", "vocab_is_bound", "write_shards", "write_text_shards"]
