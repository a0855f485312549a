"""The overlap pass on hand-built traced graphs: the finder on its own, then the rewrite, and a
property over random programs: dataflow, values, collective issue order and barriers kept,
never less work between an issue and its wait.

Graphs are traced with ``make_fx`` from functions calling torch's functional collectives on a
one-rank gloo group (so each all-reduce is the identity and the graphs run as they are)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from simulate import one_rank
from sptransform.passes.overlap import WAIT, find_collectives, is_barrier, overlap_report, schedule_collectives

aten = torch.ops.aten


def _bucket_then_work(group):
    def f(a, b, p, q):
        g = a @ b                                          # a gradient
        c = torch.cat([g.view(-1), b.view(-1)])            # the bucket
        r = funcol.all_reduce(c, "sum", group)
        s = r[:4].view(2, 2)                               # one member of the bucket
        y = torch.relu(p @ q)                              # independent work
        return s, y
    return f


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(2, 2), torch.randn(2, 2), torch.randn(3, 3), torch.randn(3, 3)]


def _order(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def test_find_collectives_returns_issue_prologue_waits_and_epilogue():
    with one_rank() as group:
        gm = make_fx(_bucket_then_work(group))(*_inputs())
    (site,) = find_collectives(gm)
    assert site.issue.target is torch.ops._c10d_functional.all_reduce.default
    assert [n.target for n in site.prologue] == [aten.mm.default, aten.view.default, aten.view.default, aten.cat.default]
    assert [w.target for w in site.waits] == [WAIT]
    assert [n.target for n in site.epilogue] == [aten.slice.Tensor, aten.view.default]


def test_wait_and_epilogue_sink_past_independent_work_and_values_are_kept():
    with one_rank() as group:
        gm = make_fx(_bucket_then_work(group))(*_inputs())
        expected = gm(*_inputs())
        assert overlap_report(gm).ops_between == 0  # traced: waited at once
        schedule_collectives(gm)
        got = gm(*_inputs())
    position = _order(gm)
    (site,) = find_collectives(gm)
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert position[site.issue] < position[relu] < position[site.waits[0]]
    assert overlap_report(gm).overlapped == 1 and overlap_report(gm).ops_between == 2  # mm, relu
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_issue_moves_above_unrelated_work_but_never_above_an_earlier_collective():
    def f(x, y):
        u = torch.relu(y) * 2                              # unrelated work, traced first
        r1 = funcol.all_reduce(y.sin(), "sum", group)      # issued second in the program
        r2 = funcol.all_reduce(x.cos(), "sum", group)      # its input was ready at the start
        return r1 + u, r2

    with one_rank() as group:
        gm = make_fx(f)(torch.randn(4), torch.randn(4))
        issues_before = [s.issue.name for s in find_collectives(gm)]
        schedule_collectives(gm)
    position = _order(gm)
    sites = find_collectives(gm)
    assert [s.issue.name for s in sites] == issues_before
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert position[sites[0].issue] < position[relu]  # sin then all_reduce, before the relu
    assert position[sites[0].issue] < position[sites[1].issue]


def test_parameter_gathers_are_prefetched_one_ahead_not_all_at_the_start():
    """ZeRO-3's shape: each layer gathers a parameter (a graph input) and uses it. The gather of
    layer k+1 is issued while layer k runs, never earlier (memory: two layers' parameters)."""
    def f(x, w1, w2, w3):
        for w in (w1, w2, w3):
            x = torch.tanh(x @ funcol.all_gather_single(w, 0, group))
        return x

    with one_rank() as group:
        gm = make_fx(f)(torch.randn(2, 4), torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
        expected = gm(*[torch.ones(2, 4)] + [torch.eye(4)] * 3)
        schedule_collectives(gm)
        got = gm(*[torch.ones(2, 4)] + [torch.eye(4)] * 3)
    position = _order(gm)
    sites = find_collectives(gm)
    matmuls = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    assert position[sites[1].issue] < position[matmuls[0]] < position[sites[2].issue] < position[matmuls[1]]
    for site, mm in zip(sites, matmuls):
        assert position[site.waits[0]] < position[mm]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_nothing_moves_across_a_mutation():
    def f(x, buf):
        r = funcol.all_reduce(x * 2, "sum", group)
        buf.add_(1)                                        # a barrier
        y = torch.relu(buf)
        return r + 1, y

    with one_rank() as group:
        gm = make_fx(f)(torch.randn(4), torch.zeros(4))
        schedule_collectives(gm)
    position = _order(gm)
    (site,) = find_collectives(gm)
    add_ = next(n for n in gm.graph.nodes if is_barrier(n))
    assert add_.target is aten.add_.Tensor
    assert position[site.waits[0]] < position[add_]


def test_random_ops_never_move():
    def f(x):
        d = torch.nn.functional.dropout(x, 0.5, True)      # a random prologue: stays
        r = funcol.all_reduce(d, "sum", group)
        y = torch.rand(4)                                  # a random op after it
        return r * 2, y

    with one_rank() as group:
        gm = make_fx(f)(torch.randn(4))
        random_before = [n.name for n in gm.graph.nodes if _random(n)]
        schedule_collectives(gm)
    assert [n.name for n in gm.graph.nodes if _random(n)] == random_before
    (site,) = find_collectives(gm)
    assert not any(_random(n) for n in site.prologue)


def test_graph_without_collectives_is_returned_untouched():
    gm = make_fx(lambda x: torch.relu(x) + 1)(torch.randn(3))
    code = gm.code
    assert schedule_collectives(gm) is gm and gm.code == code


def _random(node) -> bool:
    target = node.target
    return hasattr(target, "tags") and torch.Tag.nondeterministic_seeded in target.tags


# -- a property over random programs ---------------------------------------------------------

STEPS = st.lists(st.tuples(st.sampled_from(["mm", "relu", "add", "reduce", "reduce", "slice", "mutate"]),
                           st.integers(0, 50), st.integers(0, 50)), min_size=3, max_size=14)


def _program(steps, group):
    """A straight-line program over [4, 4] tensors built from ``steps`` (op, operand picks)."""
    def f(x, y, buf):
        values = [x, y]
        for op, i, j in steps:
            a, b = values[i % len(values)], values[j % len(values)]
            if op == "mm":
                values.append(a @ b)
            elif op == "relu":
                values.append(torch.relu(a))
            elif op == "add":
                values.append(a + b)
            elif op == "reduce":
                values.append(funcol.all_reduce(a, "sum", group) * 0.5)
            elif op == "slice":
                values.append(a[1:].sum(0).expand(4, 4))
            else:
                buf.add_(a)
                values.append(buf.clone())
        return tuple(values[2:])
    return f


@settings(derandomize=True, max_examples=40, deadline=None)
@given(steps=STEPS)
def test_schedule_keeps_dataflow_values_issue_order_and_barriers_for_any_program(steps):
    torch.manual_seed(0)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with one_rank() as group:
        gm = make_fx(_program(steps, group))(x, y, torch.zeros(4, 4))
        expected = gm(x, y, torch.zeros(4, 4))
        issues = [s.issue.name for s in find_collectives(gm)]
        barriers = [n.name for n in gm.graph.nodes if is_barrier(n)]
        before = overlap_report(gm)
        schedule_collectives(gm)
        gm.graph.lint()  # every node after its inputs
        got = gm(x, y, torch.zeros(4, 4))
    assert [s.issue.name for s in find_collectives(gm)] == issues
    assert [n.name for n in gm.graph.nodes if is_barrier(n)] == barriers
    assert overlap_report(gm).ops_between >= before.ops_between
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("coalesced", [False, True])
def test_waits_behind_getitem_are_found(coalesced):
    def f(x, y):
        if coalesced:
            a, b = funcol.all_reduce_coalesced([x, y], "sum", group)
        else:
            a, b = funcol.all_reduce(x, "sum", group), funcol.all_reduce(y, "sum", group)
        return torch.relu(x * 3), a + b

    with one_rank() as group:
        gm = make_fx(f)(torch.randn(4), torch.randn(4))
        schedule_collectives(gm)
        got = gm(torch.ones(4), torch.ones(4))
    sites = find_collectives(gm)
    assert sites and all(site.waits for site in sites)
    assert overlap_report(gm).overlapped >= 1
    torch.testing.assert_close(got[1], torch.full((4,), 2.0))


def test_window_order_puts_the_windows_kernels_after_the_issue_and_the_wait_after_them():
    """The match of ``pin_windows``: the matmul scheduled into the all-reduce's window follows the
    issue, the wait follows the matmul; the relu beside it is no library kernel and is left to
    inductor (ordering it would cost its fusion)."""
    from sptransform.passes.overlap import window_order

    with one_rank() as group:
        gm = make_fx(_bucket_then_work(group))(*_inputs())
        assert window_order(gm) == {}  # traced: waited at once, no window
        schedule_collectives(gm)
    (site,) = find_collectives(gm)
    (wait,) = site.waits
    kernels = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    independent = kernels[-1]  # p @ q
    assert window_order(gm) == {independent: [site.issue], wait: [independent]}


def test_pinned_windows_run_the_same_values():
    from sptransform.passes.overlap import pin_windows

    with one_rank() as group:
        gm = make_fx(_bucket_then_work(group))(*_inputs())
        expected = gm(*_inputs())
        schedule_collectives(gm)
        pin_windows(gm)
        got = gm(*_inputs())
    assert sum(1 for n in gm.graph.nodes if "control_deps" in str(n.target)) == 2
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
