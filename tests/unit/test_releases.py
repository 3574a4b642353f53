"""A test that needs a newer torch than the installed one skips, naming why (Note [tests on older torch releases]
in tests/releases.py); nothing else does."""
import pytest
import torch

from parallel.config import ConfigError
from parallel.torch_compat import release, require_release
from tests import releases


def _gate(at_least: str) -> str:
    with pytest.raises(ConfigError) as info:
        require_release(at_least, "a V-shaped schedule's stage pairs", "strategy.schedule", "ZBVZeroBubble",
                        ["1F1B"], version="1.0.0")  # a release older than any: the error's wording
    return str(info.value).replace("1.0.0", torch.__version__)


def test_the_gate_of_a_newer_release_than_this_one_skips():
    newer = f"{release()[0]}.{release()[1] + 1}"
    text = f"train.py exited 2\nconfig error: {_gate(newer)}\n"
    same = releases.too_old(text) == f"a V-shaped schedule's stage pairs needs torch >= {newer}; this is torch " \
                                     f"{torch.__version__}"
    assert same, "the reason is not the gate's"  # (a message holding the gate's text would itself read as a skip)


def test_anything_else_fails_as_it_is():
    this = f"{release()[0]}.{release()[1]}"
    assert releases.too_old(_gate(this)) is None  # this release has it: a real failure
    assert releases.too_old(_gate("99.0").replace(torch.__version__, "2.0.0")) is None  # another torch's error
    assert releases.too_old("AssertionError: losses differ") is None
