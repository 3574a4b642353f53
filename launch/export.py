"""Export a run's trained weights (docs/fine-tuning.md, "Exporting"; Note [export] in parallel/export/__init__.py).

    python launch/export.py checkpoint=PATH out=DIR [overwrite=true] [lora=merged|adapter] [max_shard_size=5GB]

PATH: a run directory (its final_model.pt, else its newest complete checkpoint), a checkpoint directory
(<run>/checkpoints/step-N, from any strategy and world size) or a run's final_model.pt. A Hugging Face model
becomes a directory `AutoModel*.from_pretrained(DIR)` loads; any other model one DIR/model.safetensors.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.entry import reported  # noqa: E402
from parallel.export import export, parse_options  # noqa: E402


@reported
def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(__doc__.strip())
        return
    print(export(parse_options(sys.argv[1:])))


if __name__ == "__main__":
    main()
