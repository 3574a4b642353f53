"""Tests of what an older torch release cannot run skip there, naming why.

# Note [tests on older torch releases]
Some features need a newer torch than the oldest the project supports
(`require_release` in parallel/torch_compat.py: V-shaped pipeline schedules and
pipelines over blocks nested inside other modules need 2.12). On an older
release asking for them is a one-line config error, which
tests/unit/test_torch_compat.py checks with a stand-in version on every
release. A test that runs such a feature would fail on the older release with
that error; tests/conftest.py reports it as skipped instead, with the error as
the reason (`too_old`). Only that error does this, and only where the installed
torch is the one it names and older than the release it asks for: on the
release CI runs (2.13) nothing is skipped this way.
"""
from __future__ import annotations

import re

import torch

from parallel.torch_compat import release

_GATE = re.compile(r"(?P<what>[^:\n]*) needs torch >= (?P<at_least>\d+\.\d+); this is torch (?P<this>\S+?)"
                   r"(?= \(valid|$|\n)")


def too_old(text: str) -> str | None:
    """The skip reason when `text` (a failure's message) holds the release gate's config error for this
    torch, older than the release the feature needs; else None."""
    for m in _GATE.finditer(text):
        if m["this"] == torch.__version__ and release() < release(m["at_least"]):
            return f"{m['what'].strip()} needs torch >= {m['at_least']}; this is torch {m['this']}"
    return None
