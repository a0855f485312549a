"""Attention masks chosen by top-k, split over real gloo ranks.

A dynamic sparse attention scores the keys per head, keeps each query's ``k`` best-scored keys
(``topk`` along the keys, ``scatter`` of the picks into a 0/1 mask) and masks the rest. Top-k,
sort and scatter had no placement rule: the walk back from the output projection stopped at the
mask and the whole attention ran replicated (HF Doge held 0.67 of the parameter bytes per rank at
tp=2 + SP, the zoo's ``topk_mask`` 0.70). They now keep a split of every dim but the one they
work along (``graph.rules.links.along_dim_links``, ``scatter_links``), so the heads split through
the mask; the key-score linear, which reads every head's values, is a row of the same block.

Cases: the zoo's ``topk_mask`` (float64) and HF Doge (float32, as the sweep shrinks it), tp=2 with
SP: loss and every gradient at 3 AdamW steps, and the parameters after two. One spawn of 2 ranks."""

from __future__ import annotations

import pytest

from gloo_cases import model_for as _model
from gloo_cases import train_cases
from simulate import spawn_with_deadline

CASES = (  # (model, sp, the share of the parameter bytes a rank may hold at tp=2)
    ("topk_mask", True, 0.51),  # 0.503 (0.70 with the attention whole)
    ("doge", True, 0.51),  # 0.503 (0.67 before)
)


@pytest.mark.slow
def test_top_k_masked_attentions_train_like_the_original_on_gloo():
    spawn_with_deadline(train_cases, 2, 600.0, CASES)


def test_top_k_masked_attention_is_one_block_per_layer_on_simulated_ranks():
    """The fast lane's check: every linear of ``topk_mask`` split (11 of 11), float64 equal at
    tp=2 + SP on simulated ranks."""
    import sptransform

    model, batch, _ = _model("topk_mask")
    report = sptransform.verify(model, tp=2, sp=True, example_inputs=batch, processes=False, rtol=1e-9)
    assert report.status == "equal", report
    assert report.held_share <= 0.51, report
    assert report.linears == (11, 11), report
