"""Dropout masks: independent across shards of a split activation, equal across ranks
for replicated ones, reproducible for a seed; "reference" equals single device."""

from __future__ import annotations

import torch

import sptransform
from sptransform.torch_internals import maybe_disable_local_tensor_mode
from sptransform.runtime.ops import RankGenerators, independent_dropout
from simulate import per_rank, simulated_ranks
from tiny_models import TinyConfig, TinyLM

CONFIG = TinyConfig(layers=1, dropout=0.5, hidden=32, heads=4, kv_heads=4, ffn=64)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 61, (2, 8), generator=g), torch.randint(0, 61, (2, 8), generator=g)


def test_split_activations_get_different_masks_on_each_rank_and_the_same_ones_for_a_seed():
    with simulated_ranks(4) as mode:
        ones = mode.rank_map(lambda r: torch.ones(64, 64))
        gens, gens_again = RankGenerators(7, 4, None), RankGenerators(7, 4, None)  # alive while used
        first = per_rank(independent_dropout(ones, 0.5, True, gens.key))
        again = per_rank(independent_dropout(ones, 0.5, True, gens_again.key))
    assert all(not torch.equal(first[0], m) for m in first[1:])
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert 0.4 < float((first[0] == 0).float().mean()) < 0.6


def test_losses_repeat_for_a_seed_and_change_with_it():
    def loss_with(seed: int, sp: bool):
        torch.manual_seed(0)
        model = TinyLM(CONFIG)
        with simulated_ranks(2):
            torch.manual_seed(123)
            pm = sptransform.parallelize(model, tp=2, sp=sp, example_inputs=_data(), seed=seed)
            with maybe_disable_local_tensor_mode():  # random draws under LocalTensorMode differ per rank
                data = _data()
            return per_rank(pm(*data))

    first, again, other = loss_with(5, True), loss_with(5, True), loss_with(6, True)
    assert [float(x) for x in first] == [float(x) for x in again]
    assert float(first[0]) != float(other[0])


def test_replicated_activations_get_the_same_mask_on_every_rank_without_sp():
    torch.manual_seed(0)
    model = TinyLM(CONFIG)
    with simulated_ranks(4):
        pm = sptransform.parallelize(model, tp=4, sp=False, example_inputs=_data())
        with maybe_disable_local_tensor_mode():
            data = _data()
        losses = per_rank(pm(*data))
    # the embedding and residual dropouts act on replicated data: a mask differing between
    # ranks would make the ranks' residual streams, and so their losses, differ
    assert len({float(x) for x in losses}) == 1
