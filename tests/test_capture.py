"""Capture refuses graphs whose meaning is not in their dataflow: in-place writes read through
another alias of the same storage (the matching on its own, on exported graphs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from sptransform.capture import _refuse_hidden_writes


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
