"""Token-weighted data parallelism: each replica's gradient weighted by its share of the tokens.

A replica's loss is the mean over its own non-ignored targets; averaging the replicas' gradients
(``runtime.collectives.average_grads``: sum / dp) gives the mean of the replicas' means, which
differs from single-device training on the concatenated batch when the replicas count different
tokens (other ``-100`` counts, other local batch sizes). ``weight_by_tokens`` makes it equal:

    forward:   the loss, unchanged (each replica returns its own mean); one all-reduce of the
               replica's count of non-ignored targets n over the data-parallel group (N = sum)
    backward:  the loss's gradient times dp * n / N

so that, after ``average_grads``, a parameter's gradient is sum_r (n_r / N) * grad(mean_r) =
grad(sum of every token's loss / N), the single-device gradient — as torchtitan's and HF's
``average_tokens_across_devices`` do. N = 0 (every target ignored on every replica) gives weight
0: the single-device gradient is zero there too (no target contributes).
"""

from __future__ import annotations

import torch

from sptransform.runtime.collectives import fresh, waited
from sptransform.torch_internals import funcol


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``weight`` (a 0-dim tensor)."""

    @staticmethod
    def forward(ctx, loss, weight):
        ctx.save_for_backward(weight)
        return fresh(loss)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad * weight.to(grad.dtype), None


def weight_by_tokens(loss: torch.Tensor, target: torch.Tensor, ignore_index: int, group: str, size: int) -> torch.Tensor:
    """``loss`` (a token mean over ``target``'s entries other than ``ignore_index``), whose
    gradient is weighted by this replica's share of the tokens of the ``size`` replicas of
    ``group`` (module docstring)."""
    count = (target != ignore_index).sum().to(torch.float64).reshape(1)
    total = waited(funcol.all_reduce(count, "sum", group))  # one wait (collectives.waited)
    weight = (count * size / total.clamp(min=1)).reshape(())
    return _ScaleGradient.apply(loss, weight)
