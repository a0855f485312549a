"""``passes.unfuse`` on its own: which projections' outputs are taken apart (matching), and the
rewrite into one linear per piece, which keeps the graph's value."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from sptransform.passes.unfuse import projection_pieces, unfuse

aten = torch.ops.aten


class FalconLike(nn.Module):
    """Falcon's multi-query split: the fused output viewed as H + 2 groups of d, the query groups
    sliced, K and V taken by a constant index each."""

    def __init__(self, heads=4, d=8, hidden=16):
        super().__init__()
        self.heads, self.d = heads, d
        self.w = nn.Parameter(torch.randn((heads + 2) * d, hidden) / 4)

    def forward(self, x):
        b, s, _ = x.shape
        y = (x @ self.w.T).view(b, s, self.heads + 2, self.d)
        q, k, v = y[..., :-2, :], y[..., [-2], :], y[..., [-1], :]
        return (q * k).sum(-1) + v.mean(-1)


class BigCodeLike(nn.Module):
    """GPT-BigCode's: the fused output (with a bias) unsqueezed, then split by sizes."""

    def __init__(self, hidden=16, kv=4):
        super().__init__()
        self.hidden, self.kv = hidden, kv
        self.proj = nn.Linear(hidden, hidden + 2 * kv)

    def forward(self, x):
        q, k, v = self.proj(x).unsqueeze(1).split([self.hidden, self.kv, self.kv], dim=3)
        return q.sum(-1) * k.sum(-1) + v.sum(-1)


class NotTiled(FalconLike):
    """Only the query and K groups are read: the pieces do not tile the rows."""

    def forward(self, x):
        b, s, _ = x.shape
        y = (x @ self.w.T).view(b, s, self.heads + 2, self.d)
        return (y[..., :-2, :] * y[..., [-2], :]).sum()


class ReadWhole(FalconLike):
    """The output is also read whole (a sum over all features): nothing to take apart."""

    def forward(self, x):
        y = x @ self.w.T
        return y.split([32, 16], -1)[0].sum() + y.sum()


def _export(module, x):
    return torch.export.export(module, (x,), strict=False).module()


def _match(gm):
    """The projection of ``gm`` (a matmul/linear of a parameter) and its pieces, if any."""
    constants = {n: gm.get_parameter(n.target) if n.target in dict(gm.named_parameters()) else gm.get_buffer(n.target)
                 if n.target in dict(gm.named_buffers()) else getattr(gm, n.target)
                 for n in gm.graph.nodes if n.op == "get_attr"}
    for node in gm.graph.nodes:
        if node.target in (aten.linear.default, aten.matmul.default):
            w = node.args[1]
            while w.op == "call_function":
                w = w.args[0]
            return projection_pieces(node, w, 0, constants)
    raise AssertionError("no projection")


def _unfused(model, shape):
    """``model``'s exported graph after ``unfuse`` of its projection, an input, and the value the
    graph gave before."""
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    gm = _export(model().double(), x)
    expected = gm(x)
    unfuse(gm, _match(gm))
    gm.graph.lint()
    gm.recompile()
    return gm, x, expected


@pytest.mark.parametrize("model, rows", [
    (FalconLike, [(0, 32), (32, 40), (40, 48)]),
    (BigCodeLike, [(0, 16), (16, 20), (20, 24)]),
])
def test_pieces_of_a_projection_taken_apart_are_found_with_their_weight_rows(model, rows):
    gm = _export(model(), torch.randn(2, 3, 16))
    pieces = _match(gm)
    assert pieces is not None
    assert sorted((a, b) for _, a, b, _ in pieces.readers) == rows


@pytest.mark.parametrize("model", [NotTiled, ReadWhole])
def test_a_projection_not_wholly_taken_apart_is_not_matched(model):
    gm = _export(model(), torch.randn(2, 3, 16))
    assert _match(gm) is None


@pytest.mark.parametrize("model", [FalconLike, BigCodeLike])
def test_unfuse_makes_one_linear_per_piece_on_its_weight_rows_and_keeps_the_value(model):
    gm, x, expected = _unfused(model, (2, 3, 16))
    projections = [n for n in gm.graph.nodes if n.target in (aten.linear.default, aten.matmul.default)]
    assert len(projections) == 3
    slices = sorted(tuple(n.args[2:4]) for n in gm.graph.nodes
                    if n.target is aten.slice.Tensor and n.args[0].op == "get_attr" and n.args[1] == 0
                    and n.args[0].meta["val"].dim() == 2)
    assert slices == sorted((a, b) for _, a, b, _ in _match(_export(model(), x)).readers)
    assert not any(n.target in (aten.index.Tensor, aten.split_with_sizes.default) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=1e-12)


class MambaLike(nn.Module):
    """Mamba-2's in_proj: [gate | x B C | dt], the middle piece convolved per channel (depthwise,
    causal), then taken apart again into x, B and C."""

    def __init__(self, hidden=16, inner=8, state=4, heads=2):
        super().__init__()
        self.sizes = [inner, inner + 2 * state, heads]
        self.inner_sizes = [inner, state, state]
        channels = inner + 2 * state
        self.in_proj = nn.Linear(hidden, sum(self.sizes), bias=False)
        self.conv = nn.Conv1d(channels, channels, 3, groups=channels, padding=2)

    def forward(self, u):
        t = u.shape[1]
        gate, xbc, dt = self.in_proj(u).split(self.sizes, dim=-1)
        xbc = torch.nn.functional.silu(self.conv(xbc.transpose(1, 2))[..., :t]).transpose(1, 2)
        x, b, c = xbc.split(self.inner_sizes, dim=-1)
        return (x * gate).sum(-1) + (b * c).sum(-1) + dt.sum(-1)


def test_pieces_taken_apart_again_after_a_depthwise_convolution_are_found_through_it():
    gm = _export(MambaLike(), torch.randn(2, 5, 16))
    pieces = _match(gm)
    assert pieces is not None
    found = sorted((a, b, tuple(s.node.target for s in steps)) for _, a, b, steps in pieces.readers)
    assert [(a, b) for a, b, _ in found] == [(0, 8), (8, 16), (16, 20), (20, 24), (24, 26)]
    through_conv = [steps for a, b, steps in found if 8 <= a < 24]
    assert all(aten.conv1d.default in steps for steps in through_conv), found


def test_unfuse_replays_the_convolution_on_each_pieces_filters_and_keeps_the_value():
    gm, x, expected = _unfused(MambaLike, (2, 5, 16))
    convs = [n for n in gm.graph.nodes if n.target is aten.conv1d.default]
    assert sorted(n.args[6] for n in convs) == [4, 4, 8]  # one group per channel of each piece
    assert len([n for n in gm.graph.nodes if n.target is aten.linear.default]) == 5
    assert not any(n.target is aten.split_with_sizes.default for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=1e-12)
