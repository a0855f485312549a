"""sptransform.graph.dtensor_rules: DTensor's registered op strategies as a
fallback sharding rule, read on traced ATen graphs without a process group."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.export import export
from torch.fx.experimental.proxy_tensor import make_fx

from sptransform.graph import dtensor_rules as dr

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard


def _exported(fn, *args):
    class M(torch.nn.Module):
        def forward(self, *a):
            return fn(*a)

    return export(M(), args, strict=False).graph


def _node(graph, target):
    found = [n for n in graph.nodes if n.op == "call_function" and n.target is target]
    assert found, f"{target} not in {[n.target for n in graph.nodes]}"
    return found[0]


def _pairs(strategies):
    return {(s.inputs, s.outputs) for s in strategies}


def _assert_among(prop, strategies):
    """DTensor's pick must be one of the strategies we enumerate."""
    assert prop is not None
    assert (prop.inputs, prop.outputs) in _pairs(strategies)


def test_no_process_group_and_abstract_mesh():
    mesh = dr.abstract_mesh(8)
    assert mesh.size() == 8 and mesh.ndim == 1
    assert dr.abstract_mesh(8) is mesh  # cached
    # under an active FakeTensorMode (as while tracing) a fresh mesh still builds
    with FakeTensorMode():
        assert dr.abstract_mesh(5).size() == 5
    assert not dist.is_initialized()


def test_add_broadcast_shard_replicate_mixes():
    g = _exported(lambda x, y: x + y, torch.randn(4, 8, 16), torch.randn(16))
    n = _node(g, aten.add.Tensor)
    st = dr.dtensor_strategies(n, 2).value
    pairs = _pairs(st)
    assert ((S(0), R), (S(0),)) in pairs
    assert ((S(2), S(0)), (S(2),)) in pairs  # y's dim 0 is broadcast onto x's dim 2
    assert ((P, P), (P,)) in pairs  # add is linear
    assert ((P, R), (P,)) not in pairs  # P + R would add y tp times
    assert all(s.inputs[0] == S(2) for s in st if s.inputs[1] == S(0))
    # negative dims are normalized; R -> Shard is a local slice (cost 0)
    prop = dr.dtensor_propagate(n, [S(-1), R], 2).value
    assert prop.inputs == (S(2), S(0)) and prop.outputs == (S(2),)
    assert prop.redistribute_cost == 0
    _assert_among(prop, st)
    # x and y sharded on dims that do not line up: DTensor moves one of them
    prop = dr.dtensor_propagate(n, [S(0), S(0)], 2).value
    _assert_among(prop, st)
    assert prop.redistribute_cost > 0


def test_stack_shifts_shard_dims():
    g = _exported(lambda x, y: torch.stack([x, y], 1), torch.randn(4, 8), torch.randn(4, 8))
    n = _node(g, aten.stack.default)
    assert len(dr.flat_input_nodes(n)) == 2  # the tensor list is flattened
    pairs = _pairs(dr.dtensor_strategies(n, 2).value)
    assert pairs == {
        ((R, R), (R,)),
        ((S(0), S(0)), (S(0),)),
        ((S(1), S(1)), (S(2),)),  # the new dim 1 pushes the sharded dim right
        ((P, P), (P,)),
    }


def test_cat_refuses_sharding_the_cat_dim():
    g = _exported(lambda x, y: torch.cat([x, y], -1), torch.randn(4, 8), torch.randn(4, 6))
    n = _node(g, aten.cat.default)
    st = dr.dtensor_strategies(n, 2).value
    assert ((S(0), S(0)), (S(0),)) in _pairs(st)
    assert not any(S(1) in s.inputs for s in st)
    prop = dr.dtensor_propagate(n, [S(-1), S(1)], 2).value
    assert S(1) not in prop.inputs and prop.redistribute_cost > 0
    _assert_among(prop, st)


def test_view_as_complex_and_real():
    # DTensor supports both: any dim but the (re, im) pair may be sharded, and
    # they are linear, so Partial passes through.
    g = _exported(lambda x: torch.view_as_complex(x), torch.randn(4, 8, 2))
    st = dr.dtensor_strategies(_node(g, aten.view_as_complex.default), 2).value
    assert _pairs(st) == {((R,), (R,)), ((S(0),), (S(0),)), ((S(1),), (S(1),)), ((P,), (P,))}
    g = _exported(lambda z: torch.view_as_real(z), torch.randn(4, 8, dtype=torch.complex64))
    st = dr.dtensor_strategies(_node(g, aten.view_as_real.default), 2).value
    assert _pairs(st) == {((R,), (R,)), ((S(0),), (S(0),)), ((S(1),), (S(1),)), ((P,), (P,))}


def test_bmm_from_einsum():
    gm = make_fx(lambda a, b: torch.einsum("bij,bjk->bik", a, b), tracing_mode="fake")(
        torch.randn(4, 8, 16), torch.randn(4, 16, 6)
    )
    n = _node(gm.graph, aten.bmm.default)
    st = dr.dtensor_strategies(n, 2).value
    pairs = _pairs(st)
    assert ((S(0), S(0)), (S(0),)) in pairs  # batch
    assert ((S(1), R), (S(1),)) in pairs  # rows of a
    assert ((R, S(2)), (S(2),)) in pairs  # columns of b
    assert ((S(2), S(1)), (P,)) in pairs  # contraction dim -> partial sums
    prop = dr.dtensor_propagate(n, [S(2), S(1)], 2).value
    assert prop.outputs == (P,) and prop.redistribute_cost == 0


def test_cumsum_sharded_on_cumulative_dim_needs_replicate():
    g = _exported(lambda x: torch.cumsum(x, 1), torch.randn(4, 8))
    n = _node(g, aten.cumsum.default)
    st = dr.dtensor_strategies(n, 2).value
    assert ((S(0),), (S(0),)) in _pairs(st)
    assert not any(s.inputs == (S(1),) for s in st)
    ok = dr.dtensor_propagate(n, [S(0)], 2).value
    assert ok.inputs == (S(0),) and ok.outputs == (S(0),) and ok.redistribute_cost == 0
    moved = dr.dtensor_propagate(n, [S(1)], 2).value
    assert moved.inputs == (R,) and moved.outputs == (R,)
    assert moved.redistribute_cost == pytest.approx(4 * 8 * 4 / 2)  # all-gather of half the bytes


def test_sum_over_sharded_dim_is_partial():
    g = _exported(lambda x: x.sum(dim=1, dtype=torch.float64), torch.randn(4, 8))
    n = _node(g, aten.sum.dim_IntList)
    assert n.kwargs == {"dtype": torch.float64}  # non-tensor kwarg passed through
    st = dr.dtensor_strategies(n, 2).value
    assert ((S(1),), (P,)) in _pairs(st)
    assert ((S(0),), (S(0),)) in _pairs(st)
    prop = dr.dtensor_propagate(n, [S(1)], 2).value
    assert prop.outputs == (P,) and prop.inputs == (S(1),)


def test_amax_over_sharded_dim_is_partial_max_not_basic():
    g = _exported(lambda x: x.amax(1), torch.randn(4, 8))
    n = _node(g, aten.amax.default)
    prop = dr.dtensor_propagate(n, [S(1)], 2).value
    assert prop.outputs == (Partial("max"),) and not dr.is_basic(prop.outputs[0])
    assert not any(s.inputs == (S(1),) for s in dr.dtensor_strategies(n, 2).value)
    assert any(s.inputs == (S(1),) for s in dr.dtensor_strategies(n, 2, basic_only=False).value)


def test_repeat_cannot_shard_repeated_dim():
    g = _exported(lambda x: x.repeat(2, 1), torch.randn(4, 8))
    n = _node(g, aten.repeat.default)
    st = dr.dtensor_strategies(n, 2).value
    assert ((S(1),), (S(1),)) in _pairs(st)
    assert not any(s.inputs == (S(0),) for s in st)


def test_index_select_on_sharded_dim_refused():
    g = _exported(lambda x, i: torch.index_select(x, 0, i), torch.randn(4, 8), torch.tensor([0, 2]))
    n = _node(g, aten.index_select.default)
    st = dr.dtensor_strategies(n, 2).value
    assert ((S(1), R), (S(1),)) in _pairs(st)
    assert not any(s.inputs[0] == S(0) for s in st)


def test_multi_output_ops():
    g = _exported(lambda x: torch.split(x, 2, 1), torch.randn(4, 8))
    n = _node(g, aten.split.Tensor)
    st = dr.dtensor_strategies(n, 2).value
    assert ((S(0),), (S(0),) * 4) in _pairs(st)  # one placement per chunk
    assert not any(s.inputs == (S(1),) for s in st)

    gm = make_fx(lambda x: torch.var_mean(x, -1), tracing_mode="fake")(torch.randn(4, 8))
    n = _node(gm.graph, aten.var_mean.correction)
    assert ((S(0),), (S(0), S(0))) in _pairs(dr.dtensor_strategies(n, 2).value)
    prop = dr.dtensor_propagate(n, [S(-1)], 2).value
    assert prop.inputs == (R,) and prop.outputs == (R, R)

    gm = make_fx(lambda x, w: torch.nn.functional.layer_norm(x, (8,), w), tracing_mode="fake")(
        torch.randn(4, 8), torch.randn(8)
    )
    n = _node(gm.graph, aten.native_layer_norm.default)
    # (x, weight, bias=None): the None bias is not a node, so two inputs
    st = dr.dtensor_strategies(n, 2).value
    assert ((S(0), R), (S(0), S(0), S(0))) in _pairs(st)
    assert not any(s.inputs[0] == S(1) for s in st)  # the normalized dim


def test_unbind_along_sharded_dim_returns_error_not_exception():
    g = _exported(lambda x: torch.unbind(x, 1), torch.randn(4, 8))
    n = _node(g, aten.unbind.int)
    st = dr.dtensor_strategies(n, 2).value
    assert ((S(0),), (S(0),) * 8) in _pairs(st)
    answer = dr.dtensor_propagate(n, [S(1)], 2)
    assert answer.value is None and "unbind" in answer.reason  # torch's strategy raises


def test_nonzero_and_boolean_mask_are_data_dependent():
    g = _exported(lambda x: (torch.nonzero(x), x[x > 0]), torch.randn(4, 8))
    n = _node(g, aten.nonzero.default)
    answer = dr.dtensor_strategies(n, 2)
    assert answer.value is None and "aten.nonzero.default" in answer.reason
    assert dr.dtensor_propagate(n, [R], 2).value is None
    m = _node(g, aten.index.Tensor)
    answer = dr.dtensor_strategies(m, 2)
    assert answer.value is None and "data-dependent" in answer.reason


def test_op_without_rule_and_non_aten_node():
    g = _exported(lambda s, v: torch.searchsorted(s, v), torch.arange(8.0), torch.randn(4))
    n = _node(g, aten.searchsorted.Tensor)
    assert dr.dtensor_rule_source(aten.searchsorted.Tensor) is None
    answer = dr.dtensor_strategies(n, 2)
    assert answer.value is None and "no sharding rule for aten.searchsorted.Tensor" in answer.reason
    assert dr.dtensor_propagate(n, [R, R], 2).value is None
    # lookup is by OpOverload object only
    assert dr.dtensor_rule_source("aten::add.Tensor") is None
    g = _exported(lambda x: torch.split(x, 2, 0)[0], torch.randn(4, 8))
    item = _node(g, operator.getitem)
    answer = dr.dtensor_strategies(item, 2)
    assert answer.value is None and "not a call to an ATen" in answer.reason


def test_decomposition_path_handles_transposed_inputs():
    # export keeps aten.matmul (CompositeImplicit): DTensor only has it through
    # its decomposition, which needs the contiguous-stride workaround for k^T.
    g = _exported(lambda q, k: q @ k.transpose(-2, -1), torch.randn(2, 4, 8, 6), torch.randn(2, 4, 8, 6))
    n = _node(g, aten.matmul.default)
    assert dr.dtensor_rule_source(n.target) == "decomposition"
    answer = dr.dtensor_strategies(n, 2)
    st = answer.value
    assert st is not None, answer.reason
    pairs = _pairs(st)
    assert ((S(1), S(1)), (S(1),)) in pairs  # heads
    assert ((S(3), S(2)), (P,)) in pairs  # contraction
    _assert_among(dr.dtensor_propagate(n, [S(1), S(1)], 2).value, st)


def test_works_under_fake_mode_and_caches():
    with FakeTensorMode():
        g = _exported(lambda x, y: x * y, torch.randn(6, 9), torch.randn(6, 9))
        n = _node(g, aten.mul.Tensor)
        first = dr.dtensor_strategies(n, 3).value
        assert ((S(1), S(1)), (S(1),)) in _pairs(first)
        assert ((P, R), (P,)) in _pairs(first) and ((P, P), (P,)) not in _pairs(first)
        assert dr.dtensor_strategies(n, 3).value == first
        prop = dr.dtensor_propagate(n, [P, P], 3).value
        assert P in prop.inputs and R in prop.inputs
        assert prop.redistribute_cost == pytest.approx(2 * 2 / 3 * 6 * 9 * 4)  # one all-reduce
    assert not dist.is_initialized()


def test_positional_tensor_given_as_kwarg():
    # DTensor reads tensors from args only; add.Tensor(x, other=y) must be
    # normalized or y's placement would be ignored.
    fm = FakeTensorMode()
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    x.meta["val"] = fm.from_tensor(torch.randn(4, 8))
    y.meta["val"] = fm.from_tensor(torch.randn(4, 8))
    n = g.call_function(aten.add.Tensor, (x,), {"alpha": 2, "other": y})
    with fm:
        n.meta["val"] = aten.add.Tensor(x.meta["val"], other=y.meta["val"], alpha=2)
    assert dr.dispatch_args(n) == ((x, y), {"alpha": 2})
    assert dr.flat_input_nodes(n) == [x, y]
    assert ((S(0), R), (S(0),)) not in _pairs(dr.dtensor_strategies(n, 2).value)
    prop = dr.dtensor_propagate(n, [S(0), S(1)], 2).value
    assert prop.inputs[0] == prop.inputs[1] and prop.redistribute_cost > 0


def test_propagate_rejects_wrong_arity():
    g = _exported(lambda x, y: x + y, torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(ValueError):
        dr.dtensor_propagate(_node(g, aten.add.Tensor), [R], 2).value


def test_registered_op_count():
    counts = dr.registered_op_count()
    assert counts["total"] > 1000
    assert counts["total"] <= counts["single_dim"] + counts["strategy"] + counts["rule"]
