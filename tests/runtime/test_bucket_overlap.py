"""Gradient buckets with ``overlap``: issued in backward and left in flight, every one waited on
when the backward pass ends (a pass that raised: when its buffers are freed) and ``.grad`` a plain
tensor again, on a real one-rank gloo group. Torch's registry of unwaited collectives is what
tells: nothing of sptransform's keeps a bucket beyond its pass."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

import sptransform.runtime.collectives as collectives
from simulate import one_rank


def _unwaited() -> int:
    """Collectives torch's work registry still holds (issued, never waited on)."""
    return torch._C._distributed_c10d._get_work_registry_size()


def _bucket_loss(group, overlap: bool):
    torch.manual_seed(0)
    w, b = torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    ws, bs = collectives.average_grads(group, 1, w, b, overlap=overlap)
    x = torch.randn(2, 4)
    return (torch.tanh(x @ ws + bs) ** 2).sum(), (w, b), x


def _expected(x, w, b):
    w, b = w.detach().requires_grad_(), b.detach().requires_grad_()
    (torch.tanh(x @ w + b) ** 2).sum().backward()
    return w.grad, b.grad


@pytest.mark.parametrize("overlap", [False, True])
def test_bucket_gradients_are_complete_plain_and_nothing_is_in_flight_after_backward(overlap):
    with one_rank() as group:
        loss, (w, b), x = _bucket_loss(group, overlap)
        arrived = []  # what .grad was when autograd stored it: the bucket still in flight, with overlap
        for p in (w, b):
            p.register_post_accumulate_grad_hook(lambda p: arrived.append(type(p.grad)))
            p.register_post_accumulate_grad_hook(collectives.note_gradient)
        before = _unwaited()
        loss.backward()
        assert arrived == [AsyncCollectiveTensor if overlap else torch.Tensor] * 2
        assert _unwaited() == before  # the bucket issued in backward (with overlap: in flight) was waited on
        assert type(w.grad) is torch.Tensor and type(b.grad) is torch.Tensor  # settled: plain again
        for got, want in zip((w.grad, b.grad), _expected(x, w, b)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def test_a_backward_that_raises_leaves_nothing_in_flight_once_its_buffers_are_freed():
    with one_rank() as group:
        torch.manual_seed(0)
        before = _unwaited()
        w = torch.randn(3, requires_grad=True)
        (ws,) = collectives.sync_grads(group, _Fails.apply(w), overlap=True)
        with pytest.raises(RuntimeError, match="on purpose"):
            (ws * 2).sum().backward()  # the bucket is issued, then the op before it raises
        gc.collect()  # the failed pass ran no end-of-backward callback; the bucket's finalizer waits
        assert _unwaited() == before
        loss, (w, b), _ = _bucket_loss(group, True)
        for p in (w, b):
            p.register_post_accumulate_grad_hook(collectives.note_gradient)
        loss.backward()
        assert _unwaited() == before
        assert type(w.grad) is torch.Tensor and type(b.grad) is torch.Tensor
