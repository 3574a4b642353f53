"""The planner's values from shapes (parallel.planning.shape_values, Note [planner]): positions are real under fake
tensors, so a Hugging Face model takes the real run's attention path and saves the same tensors for backward."""
import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from parallel.planning.shape_values import LIMIT, ShapeValues
from tests import hf_models


def test_positions_are_real_and_everything_else_stays_fake():
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, ShapeValues(fake):
        positions = torch.arange(16).unsqueeze(0)
        packed = (torch.diff(positions, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
        x = torch.randn(4, 16)  # data: no value is known
        mixed = x + positions
        big = torch.arange(LIMIT + 1)
        on_meta = torch.arange(16, device="meta")
        square = torch.arange(LIMIT // 2)[:, None] + torch.arange(LIMIT // 2)[None, :]  # too large to make
    assert not isinstance(positions, FakeTensor) and positions.tolist() == [list(range(16))]
    assert not isinstance(packed, FakeTensor) and bool((packed == 0).all())  # readable, as in a real run
    assert all(isinstance(t, FakeTensor) for t in (x, mixed, big, square, on_meta))  # left to the fake mode


def _saved(model, x, fake: bool, values: bool) -> list[tuple]:
    """(shape, dtype, bytes) of each storage the forward saves for backward."""
    saved = {}

    def pack(t):
        saved.setdefault(id(t.untyped_storage()), (tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    with contextlib.ExitStack() as stack:
        if fake:
            fake_mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            if values:
                stack.enter_context(ShapeValues(fake_mode))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        model(x)
    return sorted(saved.values(), key=str)


@pytest.mark.parametrize("factory", [hf_models.llama, hf_models.gpt2])
def test_hugging_face_attention_saves_what_the_real_run_saves(factory):
    torch.manual_seed(0)
    model, x = factory(), torch.randint(0, 64, (8, 16))
    real = _saved(model, x, fake=False, values=False)
    # Without values Hugging Face reads the fake positions as a trace: it builds the causal mask (and
    # repeats grouped keys and values) that the real run leaves to SDPA's is_causal.
    assert _saved(model, x, fake=True, values=False) != real
    assert _saved(model, x, fake=True, values=True) == real
