"""ZeRO-3's saved-tensor hook (``runtime.zero.Regather``) on a real one-rank gloo group: a gathered
parameter (or a view of it) saved for backward is not kept but gathered again, found through its
own autograd history, so two forwards under their own hooks never see each other's buckets."""

from __future__ import annotations

import torch

from simulate import one_rank
from sptransform.runtime import zero


class _Counting(zero.Regather):
    def __init__(self):
        super().__init__()
        self.regathered, self.kept = 0, 0

    def pack(self, tensor):
        packed = super().pack(tensor)
        if packed is tensor:
            self.kept += 1
        else:
            self.regathered += 1
        return packed


def _layer(group, w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    wf, bf = zero.gather_params(group, 1, [0, 0], [list(w.shape), list(b.shape)], w, b)
    return torch.tanh(x @ wf.t() + bf).sum()  # saves wf.t(), a view of the gathered weight


def test_gathered_parameters_are_gathered_again_for_backward_and_their_gradients_are_exact():
    with one_rank() as group:
        torch.manual_seed(0)
        w, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, requires_grad=True)
        x = torch.randn(2, 4, requires_grad=True)  # its gradient needs the weight: mm saves it
        first, second = _Counting(), _Counting()
        with first:
            loss_first = _layer(group, w, b, x)
        with second:  # a second forward (another module's) under its own hook, before either backward
            loss_second = _layer(group, w, b, 2 * x)
        assert first.regathered >= 1 and second.regathered >= 1
        (loss_first + loss_second).backward()
        w_ref, b_ref = w.detach().requires_grad_(), b.detach().requires_grad_()
        x_ref = x.detach().requires_grad_()
        (torch.tanh(x_ref @ w_ref.t() + b_ref).sum() + torch.tanh(2 * x_ref @ w_ref.t() + b_ref).sum()).backward()
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=0)
        torch.testing.assert_close(b.grad, b_ref.grad, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


def test_tensors_that_are_not_gathered_parameters_are_kept():
    with one_rank():
        regather = _Counting()
        x = torch.randn(2, 3, requires_grad=True)
        with regather:
            y = (x.exp() * x).sum()
        y.backward()
        assert regather.regathered == 0 and regather.kept > 0
