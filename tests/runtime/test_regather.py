"""ZeRO-3's saved-tensor hook (``runtime.zero.Regather``) on a real one-rank gloo group: a gathered
parameter (or a view of it) saved for backward is not kept but gathered again, found through its
own autograd history, so two forwards under their own hooks never see each other's buckets.
ZeRO-1's bucket: the whole gradient all-reduced, this rank's piece kept; refused in simulation."""

from __future__ import annotations

import pytest
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


def test_zero_1_keeps_this_ranks_piece_of_the_whole_gradient_and_the_gathered_parameter():
    """ZeRO-1's bucket (``whole_gradient``): the gradient is all-reduced whole and this rank's row
    kept (exact on one rank); without ``Regather`` the gathered parameter is what autograd saves."""
    with one_rank() as group:
        torch.manual_seed(0)
        w, x = torch.randn(3, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)  # mm saves w for x
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(zero._gathered(t)) or t, lambda t: t):
            (wf,) = zero.gather_params(group, 1, [0], [list(w.shape)], w, whole_gradient=True)
            loss = torch.tanh(x @ wf.t()).sum()
        assert any(found is not None for found in saved)  # kept for backward, not gathered again
        loss.backward()
        w_ref, x_ref = w.detach().requires_grad_(), x.detach().requires_grad_()
        torch.tanh(x_ref @ w_ref.t()).sum().backward()
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


def test_zero_1_refuses_simulated_ranks_by_name():
    from simulate import simulated_ranks

    with simulated_ranks(2):
        import torch.distributed as dist

        w = torch.randn(4, 2, requires_grad=True)
        with pytest.raises(ValueError, match=r"zero=1 keeps the row .* use zero=2"):
            zero.gather_params(dist.group.WORLD.group_name, 2, [0], [[8, 2]], w, whole_gradient=True)
