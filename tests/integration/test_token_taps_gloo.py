"""Attention with per-token convolution taps and a relative bias shared by the heads, split over
real gloo ranks.

Inkling-2's full-attention layers pass keys and values through a short causal convolution whose
taps depend on the token (static per-channel taps plus per-head taps projected from the layer
input), applied to windows made along time by ``unfold`` and ``flip``; and they add a relative
position bias made from per-head states times one ``[d_rel, extent]`` bank that every head shares.
Neither op had a rule, and the bank's matmul, a linear, stopped the walk back from the output
projection (a split along its heads was taken for one along its tokens): the whole attention ran
replicated (HF ``inkling2_text`` held 0.70 of the parameter bytes per rank at tp=2 + SP, the
zoo's ``token_taps`` 0.729). ``unfold`` and ``flip`` now keep a split of the dims they do not
window or flip (``graph.rules.links``), and a linear needed split along a dim it maps row by row
runs on each rank's rows with its weight whole (``graph.walk._batch_dim``).

Cases: the zoo's ``token_taps`` (float64) and HF Inkling-2 (float32, as the sweep shrinks it),
tp=2 with SP: loss and every gradient at 3 AdamW steps, and the parameters after two. One spawn
of 2 ranks."""

from __future__ import annotations

import pytest

from gloo_cases import split_on_simulated_ranks, train_cases
from simulate import spawn_with_deadline

CASES = (  # (model, sp, the share of the parameter bytes a rank may hold at tp=2)
    ("token_taps", True, 0.51),  # 0.503 (0.729 with the attention whole)
    ("inkling2_text", True, 0.575),  # 0.569 (0.70 before; the bank, 12% of its bytes, stays whole)
)


@pytest.mark.slow
def test_token_tap_convolutions_and_a_shared_bias_bank_train_like_the_original_on_gloo():
    spawn_with_deadline(train_cases, 2, 600.0, CASES)


def test_token_tap_attention_is_one_block_per_layer_on_simulated_ranks():
    """The fast lane's check: every linear of ``token_taps`` split but the shared banks' matmuls
    (21 of 23), float64 equal at tp=2 + SP on simulated ranks."""
    split_on_simulated_ranks("token_taps", 0.51, (21, 23))
