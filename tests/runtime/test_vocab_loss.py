"""The vocabulary-parallel cross-entropy against ``F.cross_entropy`` on the whole logits: each
simulated rank holds ``per_rank`` columns (the last ranks' beyond the vocabulary are padding, a
rank may hold padding only), logits far from zero, ignored targets, every reduction; the loss and
each rank's gradient of its columns, float64. And its one collective: the ranks' row statistics
gathered, where the row max, the sum of exponentials and the target logit took three."""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.distributed._local_tensor import LocalTensor

from simulate import per_rank, simulated_ranks
from sptransform.runtime.ops import vocab_parallel_cross_entropy

IGNORE = -100


def _case(tp: int, vocab: int, tokens: int, offset: float, reduction: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    per = -(-vocab // tp)
    whole = (torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * 4 + offset).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[torch.rand(tokens, generator=g) < 0.25] = IGNORE
    expected = F.cross_entropy(whole, target, ignore_index=IGNORE, reduction=("none", "mean", "sum")[reduction])
    weight = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    (expected_grad,) = torch.autograd.grad((expected * weight).sum(), whole)
    # padding columns hold garbage: the op must mask them, not rely on their value
    padded = torch.cat([whole.detach(), torch.full((tokens, per * tp - vocab), 1e4, dtype=torch.float64)], dim=-1)
    grad_padded = F.pad(expected_grad, (0, per * tp - vocab))
    with simulated_ranks(tp) as mode:
        with mode.disable():
            pieces = {r: padded[:, r * per:(r + 1) * per].clone() for r in range(tp)}
            ranks = {r: torch.tensor(r) for r in range(tp)}
        logits = LocalTensor(pieces).requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, target, LocalTensor(ranks), per, vocab, IGNORE, reduction,
                                            dist.group.WORLD.group_name)
        (loss * weight).sum().backward()  # the backward needs no collective: each rank has the row statistics
        losses, grads = per_rank(loss), per_rank(logits.grad)
    for r in range(tp):
        torch.testing.assert_close(losses[r], expected.detach(), rtol=1e-12, atol=1e-10, msg=lambda m: f"loss rank {r}: {m}")
        torch.testing.assert_close(grads[r], grad_padded[:, r * per:(r + 1) * per], rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"gradient rank {r}: {m}")


@settings(derandomize=True, max_examples=30, deadline=None)
@given(tp=st.sampled_from([2, 3, 4]), vocab=st.integers(1, 13), tokens=st.integers(1, 5),
       offset=st.sampled_from([0.0, 900.0, -900.0]), reduction=st.sampled_from([0, 1, 2]), seed=st.integers(0, 99))
def test_vocab_parallel_cross_entropy_equals_the_whole_logits_loss_and_gradient(tp, vocab, tokens, offset, reduction, seed):
    _case(tp, vocab, tokens, offset, reduction, seed)


def test_a_rank_holding_only_padding_and_far_logits():
    _case(4, 5, 4, -900.0, 1, 0)  # per_rank 2: rank 3's columns 6, 7 are padding


def test_the_loss_takes_one_collective():
    """The forward gathers every rank's [row max, sum of exponentials, shifted target logit] once."""
    from torch.profiler import profile

    with simulated_ranks(2) as mode:
        with mode.disable():
            pieces = {r: torch.randn(3, 4, dtype=torch.float64) for r in range(2)}
        logits = LocalTensor(pieces).requires_grad_()
        with profile() as prof:
            loss = vocab_parallel_cross_entropy(logits, torch.tensor([0, 5, 7]), LocalTensor({0: torch.tensor(0), 1: torch.tensor(1)}),
                                                4, 8, IGNORE, 1, dist.group.WORLD.group_name)
            loss.backward()
    names = collections.Counter(e.name for e in prof.events())
    kinds = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
    collectives = {n: c for n, c in names.items() if n.startswith("_c10d_functional::") and n.split("::")[1] in kinds}
    assert collectives == {"_c10d_functional::all_gather_into_tensor": 1}, collectives
