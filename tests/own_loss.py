"""A user's own loss on a parallel module's logits, checked the same way on simulated and real
ranks: the plain call is a clear error naming the fixes; ``loss_parallel()`` and
``logits.full_tensor()`` give the single-device loss and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from simulate import per_rank


def check_own_loss_paths(pm, ref, ids: torch.Tensor, *, rtol: float = 1e-5) -> None:
    """``pm`` parallelizes an unmodified copy of ``ref``; both get ``ids`` without labels."""
    targets = ids.roll(-1, dims=1).flatten()
    ref_loss = F.cross_entropy(ref(ids).logits.flatten(0, 1), targets)
    ref_loss.backward()
    expected = {name: p.grad.clone() for name, p in ref.named_parameters()}

    with pytest.raises(TypeError, match=r"loss_parallel\(\)[\s\S]*full_tensor\(\)"):
        F.cross_entropy(pm(ids).logits.flatten(0, 1), targets)

    def vocabulary_parallel(logits):
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets)
            loss.backward()
        return loss

    def gathered(logits):
        loss = F.cross_entropy(logits.full_tensor().flatten(0, 1), targets)
        loss.backward()
        return loss

    for compute in (vocabulary_parallel, gathered):
        pm.zero_grad(set_to_none=True)
        loss = compute(pm(ids).logits)
        for value in per_rank(loss):
            torch.testing.assert_close(value.detach(), ref_loss.detach(), rtol=rtol, atol=1e-6)
        for name, p in pm.named_parameters():
            for value in per_rank(p.grad):
                torch.testing.assert_close(value, expected[name], rtol=rtol * 10, atol=1e-6,
                                           msg=lambda m, n=name: f"grad of {n}: {m}")
    # after loss_parallel() popped its handlers, the plain call is still the clear error
    with pytest.raises(TypeError, match="loss_parallel"):
        F.cross_entropy(pm(ids).logits.flatten(0, 1), targets)
