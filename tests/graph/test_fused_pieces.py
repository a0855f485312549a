"""Linears that read pieces of a parameter (a fused projection taken apart with ``split``,
``chunk``, ``slice``, ``narrow``, as ``nn.MultiheadAttention`` does for cross-attention) are found
with the rows they read, and the parameter is split as its pieces are, side by side; a parameter
whose pieces no split fits stays whole, with a note, and the model stays equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sptransform
from sptransform.capture import FakeTemplate, capture
from sptransform.graph.analysis import analyze, find_linears, parameter_placements
from sptransform.graph.placement import DimShard
from sptransform.passes.canonicalize import narrow_as_slice


def _captured(model, inputs):
    captured = capture(FakeTemplate(model, torch.device("cpu")), inputs, {})
    narrow_as_slice(captured.gm)
    return captured


class Pieces(nn.Module):
    """Every way torch takes rows of a weight; each linear's output is summed alone."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 8))
        self.b = nn.Parameter(torch.randn(24))

    def forward(self, x):
        w_q, w_kv = self.w.split([8, 16])
        w_k, w_v = w_kv.chunk(2)  # a piece of a piece: rows [8, 16) and [16, 24)
        b_q, b_k, b_v = self.b.chunk(3)
        outs = [
            F.linear(x, w_q, b_q), F.linear(x, w_k, b_k), F.linear(x, w_v, b_v),
            F.linear(x, self.w.narrow(0, -8, 8)),  # rows [16, 24)
            F.linear(x, self.w[4:12]),
            F.linear(x, torch.unsafe_split(self.w, 12)[1]),
            x @ self.w.tensor_split(3)[1].t(),  # mm of a transposed piece: its output features are rows
            F.linear(x, self.w.t()[:, 4:8].t()),  # a piece of the transposed weight, taken back
            F.linear(x[:, :4], self.w[:, :4]),  # a piece along the input features: not a column piece
        ]
        return sum(o.sum() for o in outs)


def test_linears_reading_pieces_of_a_parameter_are_found_with_their_rows():
    captured = _captured(Pieces(), (torch.randn(2, 8),))
    found = sorted(((lm.weight_piece, lm.bias_piece, lm.out_features) for lm in find_linears(captured).values()
                    if lm.weight_name == "w"), key=str)
    assert found == sorted([
        ((0, 8), (0, 8), 8), ((8, 8), (8, 8), 8), ((16, 8), (16, 8), 8),
        ((16, 8), None, 8), ((4, 8), None, 8), ((12, 12), None, 12), ((8, 8), None, 8), ((4, 4), None, 4),
    ], key=str)


class CrossAttention(nn.Module):
    def __init__(self, kdim=None, bias=True):
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True, kdim=kdim, vdim=kdim, bias=bias)

    def forward(self, x, memory):
        x = x + self.pre(x)
        return (x + self.attn(x, memory, memory, need_weights=False)[0]).sum()


def _cross_analysis(model, memory_features=16, tp=2):
    inputs = (torch.randn(2, 4, 16), torch.randn(2, 6, memory_features))
    return analyze(_captured(model, inputs), tp)


def test_multihead_cross_attentions_q_and_kv_pieces_make_three_segments_split_per_head():
    """``in_proj_weight.split([E, 2E])``: the q rows split per head, the kv rows per head inside
    k and inside v: three segments, torch's ``_StridedShard(0, split_factor=3)``."""
    analysis = _cross_analysis(CrossAttention())
    attention = next(r for r in analysis.regions if r.kind == "attention")
    pieces = sorted((attention.column_linears[c].weight_piece, spec) for c, spec in attention.columns.items())
    assert pieces == [((0, 16), DimShard(2, ((0, 16),))), ((16, 32), DimShard(2, ((0, 16), (16, 16))))]
    three = DimShard(0, ((0, 16), (16, 16), (32, 16)))
    assert analysis.fused == {"attn.in_proj_weight": three, "attn.in_proj_bias": three}
    placements = parameter_placements(analysis, 2)
    assert placements["attn.in_proj_weight"].spec == three and not placements["attn.in_proj_weight"].stored_whole


def test_kdim_cross_attentions_separate_weights_and_chunked_bias_are_split():
    analysis = _cross_analysis(CrossAttention(kdim=12), memory_features=12)
    placements = parameter_placements(analysis, 2)
    assert {n: placements[n].spec for n in ("attn.q_proj_weight", "attn.k_proj_weight", "attn.v_proj_weight")} == {
        "attn.q_proj_weight": DimShard(0, ((0, 16),)),
        "attn.k_proj_weight": DimShard(0, ((0, 16),)),
        "attn.v_proj_weight": DimShard(0, ((0, 16),)),
    }
    assert analysis.fused == {"attn.in_proj_bias": DimShard(0, ((0, 16), (16, 16), (32, 16)))}


class HalfColumn(nn.Module):
    """``w``'s first rows feed an MLP (a column piece); the rest a layer norm over its features,
    which no column split survives: ``w`` must stay whole, and its first piece run whole too."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 16))
        self.down = nn.Linear(16, 16)

    def forward(self, x):
        w_up, w_side = self.w.split([16, 32])
        h = self.down(F.gelu(F.linear(x, w_up)))
        return (x + h).sum() + F.layer_norm(F.linear(x, w_side), (32,)).sum()


class TwoMLPs(nn.Module):
    """One weight feeding two MLPs of different widths: pieces of 16 and 32 rows, unequal
    segments that no DTensor placement describes (stored whole, cut in the graph)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 16) / 4)
        self.down_a, self.down_b = nn.Linear(16, 16), nn.Linear(32, 16)

    def forward(self, x):
        w_a, w_b = self.w.split([16, 32])
        x = x + self.down_a(F.gelu(F.linear(x, w_a)))
        return (x + self.down_b(F.gelu(F.linear(x, w_b)))).sum()


def test_a_parameter_read_split_and_whole_splits_its_column_piece_and_keeps_the_rest_whole():
    # rows [0, 16) feed an MLP (column-parallel), rows [16, 48) a linear that runs replicated: the
    # first piece is split in the graph, the second read whole (not in the split's segments)
    analysis = analyze(_captured(HalfColumn(), (torch.randn(2, 4, 16),)), 2)
    assert analysis.fused == {"w": DimShard(0, ((0, 16),))} and analysis.kept_whole == set()
    assert analysis.read_whole_rows == {"w": ((16, 32),)}
    assert any(lm.weight_name == "w" for r in analysis.regions for lm in r.column_linears.values())
    assert parameter_placements(analysis, 2)["w"].stored_whole


@pytest.mark.parametrize("model, split", [(HalfColumn, False), (TwoMLPs, True)])
def test_models_reading_pieces_of_a_weight_equal_one_device(model, split):
    torch.manual_seed(0)
    report = sptransform.verify(model().double(), tp=2, sp=False, example_inputs=(torch.randn(2, 4, 16).double(),),
                                processes=False)
    assert report.ok, str(report)
    rows = {r.name: r.placement for r in report.rows if r.kind == "grad"}
    # TwoMLPs: the fused weight is split in the graph in unequal segments; HalfColumn: its MLP
    # piece split in the graph, the rest read whole. No DTensor placement holds either split, so
    # the weight is stored in 1/tp pieces, gathered where read, its gradient reduce-scattered
    # (``gather_summed``); the rows read whole count once (``counted_once``)
    assert report.linears == ((4, 4) if split else (3, 3)), str(report)
    assert rows["w"] == "Shard(0)", rows
    # shard_whole: the same, and what runs whole (the biases) in pieces too
    whole = sptransform.verify(model().double(), tp=2, sp=False, example_inputs=(torch.randn(2, 4, 16).double(),),
                               processes=False, shard_whole=True)
    assert whole.ok and whole.held_share == pytest.approx(0.5), str(whole)
    assert whole.held_share <= report.held_share < 0.6, (whole.held_share, report.held_share)
    assert {r.name: r.placement for r in whole.rows if r.kind == "grad"}["w"] == "Shard(0)", str(whole)


class TakenApart(nn.Module):
    """Attention whose q, k, v weights and biases are rows of one fused parameter, taken ``how``."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.w, self.b = nn.Parameter(torch.randn(48, 16) / 4), nn.Parameter(torch.randn(48) / 4)
        self.out = nn.Linear(16, 16)

    def _pieces(self, t):
        if self.how == "unsafe_split":
            return torch.unsafe_split(t, 16)
        if self.how == "tensor_split":
            return t.tensor_split(3)
        if self.how == "narrow":
            return [t.narrow(0, 16 * i, 16) for i in range(3)]
        return [t[16 * i:16 * (i + 1)] for i in range(3)]

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (F.linear(x, w, bias).view(b, s, 4, 4).transpose(1, 2)
                   for w, bias in zip(self._pieces(self.w), self._pieces(self.b)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 16)
        return (x + self.out(a)).sum()


@pytest.mark.parametrize("how", ["unsafe_split", "tensor_split", "narrow", "slice"])
def test_qkv_taken_apart_from_one_parameter_is_split_per_head_and_equal(how):
    torch.manual_seed(0)
    report = sptransform.verify(TakenApart(how).double(), tp=2, sp=True,
                                example_inputs=(torch.randn(2, 4, 16).double(),), processes=False)
    assert report.ok, str(report)
    assert report.linears == (4, 4), str(report)
    rows = {r.name: r.placement for r in report.rows if r.kind == "grad"}
    assert rows["w"] == rows["b"] == "_StridedShard(0, split_factor=3)", rows
    assert not [n for n in report.notes if "runs whole" in n], report.notes  # the pieces are taken on each rank's rows
