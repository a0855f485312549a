"""The canonicalizing passes and the localizing helper on their own, on exported graphs: each
keeps the graph's value and produces the form its docstring shows."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sptransform.graph.placement import DimShard
from sptransform.passes.canonicalize import (
    narrow_as_slice, remove_dead_code, repeat_grouped_kv, sizes_as_arguments, split_bias, written_norms,
)
from sptransform.passes.localize import localize

aten = torch.ops.aten


def _export(module: nn.Module, *args):
    return torch.export.export(module, args, strict=False).module()


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


class DeadAndBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        unused = x.norm()  # noqa: F841  (dead: no output reads it)
        return self.lin(x)


def test_remove_dead_code_erases_what_no_output_reads_and_keeps_the_value():
    x = torch.randn(3, 4)
    module = DeadAndBias()
    gm = _export(module, x)
    assert aten.linalg_vector_norm.default in _targets(gm)
    assert remove_dead_code(gm) >= 1
    assert aten.linalg_vector_norm.default not in _targets(gm)
    torch.testing.assert_close(gm(x), module(x))


def test_split_bias_takes_the_bias_out_of_linear_and_addmm():
    x = torch.randn(3, 4)
    module = DeadAndBias()
    gm = _export(module, x)
    linear = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    split_bias(gm, linear)
    gm.recompile()
    assert len(linear.args) == 2 and [u.target for u in linear.users] == [aten.add.Tensor]
    torch.testing.assert_close(gm(x), module(x))

    class Addmm(nn.Module):
        def forward(self, b, x, w):
            return torch.addmm(b, x, w)

    b, w = torch.randn(6), torch.randn(4, 6)
    gm = _export(Addmm(), b, x, w)
    node = next(n for n in gm.graph.nodes if n.target is aten.addmm.default)
    split_bias(gm, node)
    gm.recompile()
    assert node.target is aten.mm.default and aten.add.Tensor in _targets(gm)
    torch.testing.assert_close(gm(b, x, w), torch.addmm(b, x, w))


class Narrows(nn.Module):
    def forward(self, x):
        return x.narrow(0, 1, 2) * x.narrow(-1, -3, 2).narrow(0, -2, 2).sum()  # negative starts count from the end


def test_narrow_as_slice_keeps_the_rows_including_negative_starts():
    x = torch.randn(4, 5)
    gm = _export(Narrows(), x)
    assert aten.narrow.default in _targets(gm)
    assert narrow_as_slice(gm) == 3
    assert aten.narrow.default not in _targets(gm) and _targets(gm).count(aten.slice.Tensor) == 3
    torch.testing.assert_close(gm(x), Narrows()(x))


class ProjectionNorms(nn.Module):
    """A fused RMSNorm of a projection (weighted and not) and one of the input (the residual's)."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.q_norm, self.k_norm, self.x_norm = nn.Linear(d, d), nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d), nn.RMSNorm(d)

    def forward(self, x):
        q = self.q(x)
        return self.q_norm(q) + F.rms_norm(q.view(*q.shape[:-1], 4, 4), [4]).flatten(-2) + self.x_norm(x)


def test_written_norms_write_out_a_projections_fused_rms_norm_bitwise_alike():
    """The written form is the one torch's composite runs: equal bit for bit in float32, bfloat16 and
    float64 (with and without a weight, eps given or torch's default); the norm of the input (not a
    projection's output) stays fused."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        torch.manual_seed(0)
        model, x = ProjectionNorms().to(dtype), torch.randn(2, 5, 16, dtype=dtype)
        gm = _export(model, x)
        assert written_norms(gm) == 2
        assert _targets(gm).count(aten.rms_norm.default) == 1 and aten.mean.dim in _targets(gm)
        assert torch.equal(gm(x), model(x)), dtype


class SizedByAnother(nn.Module):
    def forward(self, mask, scores, flat):
        return mask.expand_as(scores) * scores + flat.view_as(scores) + flat.reshape_as(scores)


def test_sizes_taken_from_another_tensor_become_size_arguments():
    """XLM's ``mask.view(...).expand_as(scores)``: under SP the other tensor's local shape would
    size the op (refused by the shape safety net before this pass)."""
    args = (torch.randn(2, 1, 1, 4) > 0, torch.randn(2, 3, 4, 4), torch.randn(2, 48))
    gm = _export(SizedByAnother(), *args)
    assert aten.expand_as.default in _targets(gm)
    changed = sizes_as_arguments(gm)
    assert changed >= 1 and not {aten.expand_as.default, aten.view_as.default, aten.reshape_as.default} & set(_targets(gm))
    expands = [n for n in gm.graph.nodes if n.target is aten.expand.default]
    assert [list(n.args[1]) for n in expands] == [[2, 3, 4, 4]]
    torch.testing.assert_close(gm(*args), SizedByAnother()(*args))


class GQA(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_repeat_grouped_kv_only_where_tp_does_not_divide_the_kv_heads():
    q, k, v = torch.randn(1, 8, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    gm = _export(GQA(), q, k, v)
    assert repeat_grouped_kv(gm, tp=2) == 0  # 2 K/V heads split over 2 ranks as they are
    assert repeat_grouped_kv(gm, tp=4) == 1
    sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert "enable_gqa" not in sdpa.kwargs
    assert [a.target for a in sdpa.args[1:3]] == [aten.repeat_interleave.self_int] * 2
    assert all(a.meta["val"].shape[-3] == 8 for a in sdpa.args[1:3])
    torch.testing.assert_close(gm(q, k, v), GQA()(q, k, v))


class Reshape(nn.Module):
    def forward(self, x):
        return x.view(2, 3, 4).new_zeros(2, 3, 4) + x.view(2, 3, 4)


def test_localize_rewrites_size_arguments_to_the_local_shard():
    gm = _export(Reshape(), torch.randn(6, 4))
    view = next(n for n in gm.graph.nodes if n.target is aten.view.default)
    zeros = next(n for n in gm.graph.nodes if n.target is aten.new_zeros.default)
    spec = DimShard(2, ((0, 4),))
    localize(view, spec, tp=2)
    localize(zeros, spec, tp=2)
    assert list(view.args[1]) == [2, 3, 2] and list(zeros.args[1]) == [2, 3, 2]
    assert view.meta["sptransform_spec"] == spec
    fused = DimShard(2, ((0, 2), (2, 2)))  # two segments, each split: 1 + 1 local columns
    assert fused.local_size(2) == 2 and fused.indices(1, 2) == [1, 3]
