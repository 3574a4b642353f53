"""Locally connected layers against a per-position reference loop: values and gradients."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from parallel.models.layers import LocallyConnected1d, LocallyConnected2d


def reference_1d(x, weight, bias, k, s, p):
    """Output position by position: out[:, :, i] = W_i^T . patch_i (+ b_i)."""
    x = F.pad(x, (p, p))
    positions, _, c_out = weight.shape
    outs = []
    for i in range(positions):
        patch = x[:, :, i * s:i * s + k].reshape(x.shape[0], -1)  # (N, C_in * k), channel-major
        o = patch @ weight[i]
        outs.append(o + bias[:, i] if bias is not None else o)
    return torch.stack(outs, dim=2)


def reference_2d(x, weight, bias, k, s, p, out_hw):
    x = F.pad(x, (p[1], p[1], p[0], p[0]))
    ho, wo = out_hw
    outs = []
    for i, j in itertools.product(range(ho), range(wo)):
        patch = x[:, :, i * s[0]:i * s[0] + k[0], j * s[1]:j * s[1] + k[1]].reshape(x.shape[0], -1)
        pos = i * wo + j
        o = patch @ weight[pos]
        outs.append(o + bias[:, pos] if bias is not None else o)
    return torch.stack(outs, dim=2).reshape(x.shape[0], -1, ho, wo)


def check(layer, x, reference):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    ref_x = x.detach().clone().requires_grad_(True)
    w = layer.weight.detach().clone().requires_grad_(True)
    b = layer.bias.detach().clone().requires_grad_(True) if layer.bias is not None else None
    ref = reference(ref_x, w, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-5, atol=1e-6)
    if b is not None:
        torch.testing.assert_close(layer.bias.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k,s,p,bias", [(1, 1, 0, True), (3, 1, 0, True), (3, 2, 1, True), (2, 3, 2, False),
                                        (5, 1, 2, False)])
def test_locally_connected_1d_matches_the_per_position_loop(k, s, p, bias):
    torch.manual_seed(0)
    layer = LocallyConnected1d(3, 5, input_size=11, kernel_size=k, stride=s, padding=p, bias=bias)
    assert layer.output_size == (11 + 2 * p - k) // s + 1
    check(layer, torch.randn(4, 3, 11), lambda x, w, b: reference_1d(x, w, b, k, s, p))


@pytest.mark.parametrize("k,s,p,bias", [((1, 1), (1, 1), (0, 0), True), ((2, 3), (1, 1), (0, 0), True),
                                        ((3, 3), (2, 1), (1, 1), True), ((2, 2), (2, 3), (1, 0), False)])
def test_locally_connected_2d_matches_the_per_position_loop(k, s, p, bias):
    torch.manual_seed(0)
    layer = LocallyConnected2d(2, 3, input_size=(6, 7), kernel_size=k, stride=s, padding=p, bias=bias)
    out_hw = layer.output_size
    assert out_hw == tuple((n + 2 * pp - kk) // ss + 1 for n, kk, ss, pp in zip((6, 7), k, s, p))
    check(layer, torch.randn(3, 2, 6, 7), lambda x, w, b: reference_2d(x, w, b, k, s, p, out_hw))


def test_weights_are_not_shared_between_positions():
    """One position's weight moves only that position's output."""
    layer = LocallyConnected1d(2, 1, input_size=5, kernel_size=1)
    x = torch.randn(1, 2, 5)
    before = layer(x).detach()
    with torch.no_grad():
        layer.weight[2] += 1.0
    changed = (layer(x).detach() != before).squeeze()
    assert changed.tolist() == [False, False, True, False, False]


def test_memory_is_weights_input_and_output_not_positions_times_activation():
    """The user's layer (4 -> 1 channels, 5000 positions, kernel 1) at batch 40: what forward keeps
    for backward is about one copy of the input's patches, not a slice per position."""
    from parallel.memory.tracker import LiveTensorBytes

    layer = LocallyConnected2d(4, 1, input_size=(1, 5000), kernel_size=(1, 1))
    x = torch.randn(40, 4, 1, 5000, requires_grad=True)
    tracker = LiveTensorBytes()
    tracker.track([x, layer.weight, layer.bias])
    start = tracker.current
    with tracker:
        out = layer(x)
        out.sum().backward()
    weights = (layer.weight.numel() + layer.bias.numel()) * 4
    # input patches (one copy), output, their gradients, the weights' gradients: a few x (input + output + weights)
    budget = 4 * (x.numel() * 4 + out.numel() * 4 + weights)
    assert tracker.peak - start <= budget, (tracker.peak - start, budget)


@pytest.mark.parametrize("bad", [dict(kernel_size=0), dict(stride=0), dict(padding=-1), dict(kernel_size=20)])
def test_bad_sizes_are_refused(bad):
    args = dict(in_channels=2, out_channels=2, input_size=8, kernel_size=3) | bad
    with pytest.raises(ValueError, match="kernel_size|input_size"):
        LocallyConnected1d(**args)


def test_wrong_input_shape_names_the_expected_one():
    layer = LocallyConnected2d(4, 1, input_size=(1, 50), kernel_size=1)
    with pytest.raises(ValueError, match=r"expects \(N, 4, 1, 50\)"):
        layer(torch.randn(2, 4, 1, 49))
