"""Capture refuses graphs whose meaning is not in their dataflow: in-place writes read through
another alias of the same storage (the matching on its own, on exported graphs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


from sptransform.capture import _refuse_hidden_writes

aten = torch.ops.aten


def _graph(fn, *args):
    class Wrap(nn.Module):
        def forward(self, *a):
            return fn(*a)

    return torch.export.export(Wrap(), args, strict=False).graph_module


def _buffer(x):
    out = x.new_empty(2, 8)
    out[:, :4].copy_(x)  # written through a view...
    out[:, 4:].copy_(x * 2)
    return out.sum(-1)  # ...read through the buffer


def _through_result(x):
    y = (x + 1).mul_(2)  # the in-place op's own result is read: dataflow
    z = y.clone()
    return z.masked_fill_(z > 3, 0.0).sum()


def _earlier_view(x):
    base = x + 0
    view = base[:, :2]
    base.add_(1)
    return view * 3  # a view taken before the write, read after it


def test_a_write_read_through_the_buffer_is_refused_naming_the_write_and_the_read():
    with pytest.raises(ValueError) as info:
        _refuse_hidden_writes(_graph(_buffer, torch.randn(2, 4)))
    message = str(info.value)
    assert "writes in place into a tensor that it then reads under another name" in message
    assert message.count("aten.copy_.default") == 2 and "aten.sum.dim_IntList" in message  # both writes, one read
    assert "write it out of place" in message


def test_reads_through_the_in_place_result_are_dataflow_and_pass():
    _refuse_hidden_writes(_graph(_through_result, torch.randn(2, 4)))


def test_a_view_taken_before_the_write_and_read_after_it_is_refused():
    with pytest.raises(ValueError, match=r"aten\.add_\.Tensor.*\n.*read afterwards.*aten\.mul\.Tensor"):
        _refuse_hidden_writes(_graph(_earlier_view, torch.randn(2, 4)))


def test_capture_functionalizes_a_graph_with_hidden_writes_and_keeps_the_model_s_ops():
    """``capture`` turns ``copy_`` into slices of a buffer into ``slice_scatter`` (every read of the
    written value an edge of the graph), keeps linear / SDPA whole, and views become reshapes."""
    import sys

    from sptransform.capture import FakeTemplate, capture

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "models"))
    import zoo

    model, inputs = zoo.build("buffer_key")
    graph = capture(FakeTemplate(model, torch.device("cpu")), inputs, {}).gm
    targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    assert aten.slice_scatter.default in targets and aten.copy_.default not in targets
    assert {aten.linear.default, aten.scaled_dot_product_attention.default} <= targets
    assert aten.view.default not in targets
    _refuse_hidden_writes(graph)  # the safety net finds nothing left


def test_functional_copies_become_casts_or_broadcast_copies():
    from sptransform.passes.canonicalize import functional_copies

    class Copy(nn.Module):
        def forward(self, dst, src, wide):
            return torch.ops.aten.copy.default(dst, src), torch.ops.aten.copy.default(wide, src[:1].double())

    dst, src, wide = torch.zeros(2, 3), torch.randn(2, 3), torch.zeros(4, 3)
    gm = _graph(lambda *a: Copy()(*a), dst, src, wide)
    assert functional_copies(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.copy.default not in targets and aten.expand.default in targets
    first, second = gm(dst, src, wide)
    torch.testing.assert_close(first, src)
    torch.testing.assert_close(second, src[:1].expand(4, 3))
    src.requires_grad_()
    gm(dst, src, wide)[0].sum().backward()  # functional copy has no autograd formula; these do
    torch.testing.assert_close(src.grad, torch.ones(2, 3))


def test_functional_copies_drop_the_slice_written_into_when_nothing_else_reads_it():
    """MLA's key: ``k = x.new_empty(...); k[..., :8].copy_(a); k[..., 8:].copy_(b)``. Once the copies
    are ``a`` and ``b``, the slices of ``k`` they wrote into are read by nobody; left in, they would
    read ``k`` whole, outside the attention's tensor-parallel region."""
    from sptransform.passes.canonicalize import functional_copies

    def write_halves(a, b):
        k = a.new_empty(2, 16)
        first = torch.ops.aten.copy.default(k[:, :8], a)
        k = torch.ops.aten.slice_scatter.default(k, first, 1, 0, 8)
        second = torch.ops.aten.copy.default(k[:, 8:], b)
        return torch.ops.aten.slice_scatter.default(k, second, 1, 8, 16)

    a, b = torch.randn(2, 8), torch.randn(2, 8)
    gm = _graph(write_halves, a, b)
    slices = sum(n.target is aten.slice.Tensor for n in gm.graph.nodes)
    assert functional_copies(gm) == 2
    assert sum(n.target is aten.slice.Tensor for n in gm.graph.nodes) == slices - 2
    torch.testing.assert_close(gm(a, b)[0], torch.cat([a, b], 1))
