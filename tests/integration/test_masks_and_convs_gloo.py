"""Attention masks chosen by top-k and queries and keys convolved per head, split over real gloo
ranks.

A dynamic sparse attention scores the keys per head, keeps each query's ``k`` best-scored keys
(``topk`` along the keys, ``scatter`` of the picks into a 0/1 mask) and masks the rest. Top-k,
sort and scatter had no placement rule: the walk back from the output projection stopped at the
mask and the whole attention ran replicated (HF Doge held 0.67 of the parameter bytes per rank at
tp=2 + SP, the zoo's ``topk_mask`` 0.70). They now keep a split of every dim but the one they
work along (``graph.rules.links.along_dim_links``, ``scatter_links``), so the heads split through
the mask; the key-score linear, which reads every head's values, is a row of the same block.

A convolution over the concatenated queries and keys, one group per head (ZAYA's CCA), had no
rule either (only depthwise ones did), nor did the causal ``pad`` in front of it, and a ``cat`` of
inputs split along its dim was gathered forward: the attention ran whole. A grouped convolution
now keeps a channel split whose pieces are whole groups, ``pad`` a split of the dims it does not
pad, and ``cat`` lays split inputs side by side in their segments (which also spares Qwen3-Next's
gated delta-net an all-gather per layer).

Cases: the zoo's ``topk_mask`` and ``conv_qk`` (float64), HF Doge and ZAYA (float32, as the sweep
shrinks them), tp=2 with SP: loss and every gradient at 3 AdamW steps, and the parameters after
two. One spawn of 2 ranks."""

from __future__ import annotations

import pytest

from gloo_cases import split_on_simulated_ranks, train_cases
from simulate import spawn_with_deadline

CASES = (  # (model, sp, the share of the parameter bytes a rank may hold at tp=2)
    ("topk_mask", True, 0.51),  # 0.503 (0.70 with the attention whole)
    ("doge", True, 0.51),  # 0.503 (0.67 before)
    ("conv_qk", True, 0.51),  # 0.503 (0.57 with the convolution whole)
    ("zaya", True, 0.575),  # 0.573 (0.68 before; its unequal [q | k] filter bank stays whole)
)


@pytest.mark.slow
def test_top_k_masks_and_per_head_convolutions_train_like_the_original_on_gloo():
    spawn_with_deadline(train_cases, 2, 600.0, CASES)


def test_top_k_masked_attention_is_one_block_per_layer_on_simulated_ranks():
    """The fast lane's check: every linear of ``topk_mask`` split (11 of 11), float64 equal at
    tp=2 + SP on simulated ranks."""
    split_on_simulated_ranks("topk_mask", 0.51, (11, 11))


def test_per_head_convolution_of_queries_and_keys_is_split_with_its_filters_on_simulated_ranks():
    """``conv_qk``: every linear split, the grouped convolution's filters and bias stored split
    (two segments: queries' and keys'), float64 equal at tp=2 + SP on simulated ranks."""
    split_on_simulated_ranks("conv_qk", 0.51, (13, 13))
