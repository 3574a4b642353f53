"""Datasets larger than RAM: fixed-size record shards on disk (manifest.py: Note [shard format]), written in
bounded memory (writer.py) and streamed a batch at a time (reader.py: Note [shard order])."""
from parallel.data.shards.manifest import Manifest, ShardError, check_shards, read_hints
from parallel.data.shards.reader import ShardData
from parallel.data.shards.writer import ShardWriter, write_shards

__all__ = ["Manifest", "ShardData", "ShardError", "ShardWriter", "check_shards", "read_hints", "write_shards"]
