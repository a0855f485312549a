"""A clear error for a loss computed on vocabulary-split logits without ``loss_parallel``.

A parallel module returns vocabulary-split logits as DTensors (``Shard`` on the vocabulary dim
over the tp ranks), so that the head's output is never gathered. ``F.cross_entropy(logits, y)``
with plain targets then fails inside DTensor with "got mixed torch.Tensor and DTensor", which
names neither cause nor fix. DTensor calls a Python handler for the ops in its custom-handler
table; this module puts one there for the NLL-loss ops (the op ``cross_entropy`` ends in), only
while no other handler is there: under torch's ``loss_parallel()`` its own handlers are installed
and computing the loss works, and after that context pops them, the next call of a parallel
module puts this one back. The handler changes no result: a call that mixes plain tensors and
DTensors raises here instead of in DTensor (it would raise anyway); any other call runs as if
the handler were absent.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from sptransform.torch_internals import dtensor_op_handlers

aten = torch.ops.aten
NLL_OPS = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)

MIXED_LOSS_MESSAGE = (
    "the loss was computed from a parallel module's logits, which are a DTensor split over the "
    "vocabulary across the tp ranks, and plain-tensor targets. Either compute it under torch's "
    "loss_parallel(), which keeps the vocabulary split (as torchtitan does):\n"
    "    from torch.distributed.tensor.parallel import loss_parallel\n"
    "    with loss_parallel():\n"
    "        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())\n"
    "        loss.backward()\n"
    "or gather the logits first, logits.full_tensor() (every rank then holds the whole "
    "[tokens, vocab] tensor), or pass labels= to a model that computes its own loss (it runs "
    "vocabulary-parallel)"
)


def install_loss_hint() -> None:
    """Put the handler in DTensor's table unless a handler for these ops is already there."""
    handlers = dtensor_op_handlers()
    for op in NLL_OPS:
        handlers.setdefault(op, _nll_loss)


def _nll_loss(op, args, kwargs):
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(isinstance(t, DTensor) for t in tensors) and not all(isinstance(t, DTensor) for t in tensors):
        raise TypeError(MIXED_LOSS_MESSAGE)
    # Every tensor a DTensor: what DTensor does without this handler.
    handlers = dtensor_op_handlers()
    handlers.pop(op, None)
    try:
        return op(*args, **kwargs)
    finally:
        handlers.setdefault(op, _nll_loss)
