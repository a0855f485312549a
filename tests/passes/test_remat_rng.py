"""The joint-graph rewrites for random ops in rematerialisation (``passes.remat_rng``) on
hand-built graphs: which draws they match, the graph after, and values equal bit for bit
under the same seed."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from sptransform.passes.remat_rng import compact_bernoulli_masks, isolate_dropout_masks

aten = torch.ops.aten


def _dropout(x):
    out, mask = aten.native_dropout.default(x, 0.5, True)
    return out * 2, mask


def _bernoulli(x):
    return x * aten.bernoulli.p(x, 0.5)


def _ops(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def _same_draws(gm, reference, x):
    torch.manual_seed(0)
    got = gm(x)
    torch.manual_seed(0)
    want = reference(x)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a, b)


def test_a_training_dropout_draws_its_mask_from_ones_and_scales_x_by_it():
    x = torch.randn(4, 8)
    gm = make_fx(_dropout, tracing_mode="fake")(x)
    assert isolate_dropout_masks(gm) == 1
    (drop,) = _ops(gm, aten.native_dropout.default)
    assert drop.args[0].target is aten.full.default  # the draw reads the shape only
    (mul,) = [n for n in _ops(gm, aten.mul.Tensor) if n.args[0].op == "placeholder"]
    assert mul.args[1].args == (drop, 0)
    _same_draws(gm, _dropout, x)


def test_an_eval_dropout_is_left_alone():
    gm = make_fx(lambda x: aten.native_dropout.default(x, 0.5, False), tracing_mode="fake")(torch.randn(4, 8))
    code = gm.code
    assert isolate_dropout_masks(gm) == 0 and gm.code == code


def test_a_float_bernoulli_is_kept_as_a_bool_mask_drawn_from_a_blank():
    x = torch.randn(4, 8)
    gm = make_fx(_bernoulli, tracing_mode="fake")(x)
    assert compact_bernoulli_masks(gm) == 1
    (draw,) = _ops(gm, aten.bernoulli.p)
    assert draw.args[0].target is aten.empty.memory_format
    (mask,) = _ops(gm, aten.ne.Scalar)
    assert mask.args[0] is draw and mask.meta["val"].dtype is torch.bool
    (keep,) = _ops(gm, aten._to_copy.default)
    assert list(keep.users)[0].target is aten.mul.Tensor
    _same_draws(gm, _bernoulli, x)


def test_a_comparison_reading_the_draw_reads_the_rebuilt_values_and_stays_one_op():
    gm = make_fx(lambda x: aten.bernoulli.p(x, 0.5) > 0, tracing_mode="fake")(torch.randn(4, 8))
    assert compact_bernoulli_masks(gm) == 1
    assert _ops(gm, aten.gt.Scalar)[0].args[0].target is aten._to_copy.default
    assert len(_ops(gm, aten.gt.Scalar)) == 1
