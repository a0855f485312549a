"""Rank-aware local ops the passes put into graphs.

Every op that depends on which rank runs it takes ``rank``, a 0-dim int64 tensor
input of the graph, rather than a Python int: the same graph then serves every
rank, and in-process simulation (LocalTensorMode) gives each simulated rank its
own value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sptransform.runtime.collectives import _all_gather
from sptransform.runtime.rng import RankGenerators  # noqa: F401  (re-exported)
from sptransform.torch_internals import tensor_map


def take_local(x: torch.Tensor, dim: int, table: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """Cut a replicated tensor to this rank's part along ``dim`` (row ``rank`` of ``table``
    holds the indices). Backward puts the gradient back in place, zeros elsewhere: the
    gradient of the replicated tensor is then partial over the group."""
    return x.index_select(dim, _row(table, rank))


def _row(table: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    # Indexed by a tensor op, not table[rank]: a simulated rank is not a Python int.
    return table.index_select(0, rank.reshape(1)).squeeze(0)


def pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad a vocab shard with zero rows up to ``rows`` (the last ranks of an uneven split)."""
    return F.pad(w, (0, 0, 0, rows - w.shape[0]))


def pad_last(w: torch.Tensor, cols: int) -> torch.Tensor:
    return F.pad(w, (0, cols - w.shape[-1]))


def narrow_vocab(logits: torch.Tensor, per_rank: int, vocab: int, rank: int | None) -> torch.Tensor:
    """Drop the padded vocab columns of this rank's logits (an uneven split leaves the
    last ranks fewer real columns). The width depends on the rank, so a real rank's graph
    carries it as a constant (nothing for torch.compile to break on); simulated ranks
    (``rank=None``) each cut their own."""

    def width(r: int) -> int:
        return max(0, min(per_rank, vocab - r * per_rank))

    if rank is None:
        return _NarrowSimulated.apply(logits, per_rank, width)
    keep = width(rank)
    return logits if keep == per_rank else logits[..., :keep]


class _NarrowSimulated(torch.autograd.Function):
    """``narrow_vocab`` of simulated ranks: ``tensor_map`` is invisible to autograd, so the
    backward (zero gradient for the padded columns) is spelled out."""

    @staticmethod
    def forward(ctx, logits, per_rank, width):
        ctx.per_rank = per_rank
        return tensor_map(logits, lambda r, t: t[..., : width(r)])

    @staticmethod
    def backward(ctx, grad):
        return tensor_map(grad, lambda r, g: F.pad(g, (0, ctx.per_rank - g.shape[-1]))), None, None


def vocab_parallel_embedding(
    weight: torch.Tensor, ids: torch.Tensor, rank: torch.Tensor, per_rank: int, padding_idx: int = -1
) -> torch.Tensor:
    """Look up the ids this rank's vocab slice holds; the rest give zero rows.
    The output is partial: summing it over the group gives the full embedding.

    ``padding_idx`` (global, -1 for none) keeps ``nn.Embedding``'s rule on every shard: its row
    is looked up as usual but receives no gradient."""
    local = ids - rank * per_rank
    outside = (local < 0) | (local >= per_rank)
    index = local.masked_fill(outside, 0)
    rows = F.embedding(index, weight)
    if padding_idx >= 0:
        padding = (ids == padding_idx).unsqueeze(-1)
        rows = torch.where(padding, F.embedding(index, weight.detach()), rows)
    return rows.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Each rank reduces its own vocabulary columns to three numbers per token, the ranks trade
    them in one all-gather, and every rank combines them into the loss. Per token, on rank r:
    ``m_r`` its largest logit (``-inf`` where all its columns are padding), ``s_r`` the sum of
    ``exp(logit - m_r)`` over its columns, ``p_r`` the target's ``logit - m_r`` on the rank that
    holds the target's column (0 elsewhere). With ``M = max_r m_r``:
    ``total = sum_r s_r exp(m_r - M)`` and ``target logit - M = sum_r p_r + m_owner - M``, so
    ``loss = log(total) - (target logit - M)``: the same differences of nearby numbers as
    ``log_softmax`` takes on one device, and one collective where the row max, the sum of
    exponentials and the target logit took three (three waits, each a point where every rank
    stops for the slowest)."""

    @staticmethod
    def forward(ctx, logits, target, rank, per_rank, vocab, ignore_index, reduction, group):
        n_classes = logits.shape[-1]
        columns = torch.arange(n_classes, device=logits.device) + rank * per_rank
        logits = logits.masked_fill(columns >= vocab, float("-inf"))
        local_max = logits.detach().amax(dim=-1)
        # a rank whose columns are all padding shifts by 0 (exp(-inf) = 0) and reports -inf
        shift = local_max.masked_fill(torch.isinf(local_max), 0.0)
        exp = (logits - shift.unsqueeze(-1)).exp()
        local_target = target - rank * per_rank
        mine = (local_target >= 0) & (local_target < n_classes)
        index = local_target.masked_fill(~mine, 0).unsqueeze(-1)
        picked = (logits.gather(-1, index).squeeze(-1) - shift).masked_fill(~mine, 0.0)
        mine_stats = torch.stack([local_max, exp.sum(dim=-1), picked])
        stats = _all_gather(mine_stats, 0, group)
        stats = stats.view(stats.shape[0] // 3, 3, *mine_stats.shape[1:])  # [ranks, 3, *tokens]
        maxes, sums, picks = stats.unbind(1)
        top = maxes.amax(dim=0)
        total = (sums * (maxes - top).exp()).sum(dim=0)
        owner = (target // per_rank).clamp(0, stats.shape[0] - 1)
        owner_max = maxes.gather(0, owner.unsqueeze(0)).squeeze(0)
        target_shifted = picks.sum(dim=0) + (owner_max - top)
        valid = target != ignore_index
        losses = (total.log() - target_shifted).masked_fill(~valid, 0.0)
        count = valid.sum()
        # softmax = exp(logit - shift) * exp(shift - top) / total; exp(m_r - top) <= 1, and 0 on a
        # rank of padding only (its shift is 0: exp(-top) could overflow, times its zeros a NaN)
        scale = ((local_max - top).exp() / total).unsqueeze(-1)
        ctx.save_for_backward(exp * scale, index, mine, valid, count)
        ctx.reduction = reduction
        if reduction == 0:
            return losses
        if reduction == 2:
            return losses.sum()
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine, valid, count = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        grad_logits = grad_logits * valid.unsqueeze(-1)
        if ctx.reduction == 0:
            grad_logits = grad_logits * grad.unsqueeze(-1)
        elif ctx.reduction == 2:
            grad_logits = grad_logits * grad
        else:
            grad_logits = grad_logits * (grad / count)
        return grad_logits, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    rank: torch.Tensor,
    per_rank: int,
    vocab: int,
    ignore_index: int,
    reduction: int,
    group: str,
) -> torch.Tensor:
    """Cross-entropy over logits split along the vocab (last) dim; the full-vocab
    logits never exist on one rank. ``reduction``: 0 none, 1 mean, 2 sum (ATen's enum)."""
    return _VocabParallelCrossEntropy.apply(
        logits, target, rank, per_rank, vocab, ignore_index, reduction, group
    )


# ---------------------------------------------------------------------------
# dropout


def reference_dropout(
    x: torch.Tensor,
    p: float,
    train: bool,
    dim: int,
    table: torch.Tensor,
    rank: torch.Tensor,
    full_shape: list[int],
    full_stride: list[int],
) -> torch.Tensor:
    """Dropout whose mask is, bit for bit, the one the single-device model draws:
    draw the full mask exactly as ATen's CPU dropout does (``empty_like(input)``
    with the input's strides, ``bernoulli_(1 - p)``, ``div_(1 - p)``) from the
    default generator, then keep this rank's slice."""
    if not train or p == 0:
        return x
    return x * _reference_noise(x, p, dim, table, rank, full_shape, full_stride)


def _reference_noise(x, p, dim, table, rank, full_shape, full_stride) -> torch.Tensor:
    noise = torch.empty_strided(full_shape, full_stride, dtype=x.dtype, device=x.device)
    noise.bernoulli_(1 - p)
    if p < 1:  # p == 1: zeros, as ATen (no 0 / 0)
        noise.div_(1 - p)
    return noise.index_select(dim, _row(table, rank))


def reference_native_dropout(
    x: torch.Tensor,
    p: float,
    train: bool | None,
    dim: int,
    table: torch.Tensor,
    rank: torch.Tensor,
    full_shape: list[int],
    full_stride: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_dropout`` for ``aten.native_dropout`` (what ``dropout`` becomes when the captured
    graph is functionalized): the same mask draw, and ``native_dropout``'s ``(output, bool mask)``.
    ``train=None`` means training, as in ATen."""
    if train is False or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    noise = _reference_noise(x, p, dim, table, rank, full_shape, full_stride)
    return x * noise, noise != 0
