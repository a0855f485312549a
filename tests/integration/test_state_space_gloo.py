"""Selective state-space mixers (Mamba-style) split over real gloo ranks.

A Mamba mixer reads its expanded, convolved channels twice: ``out_proj`` at the end, and a small
``x_proj`` in the middle whose output (step size, input and output matrices) goes back into the
scan. The block is walked from both: ``in_proj`` and the step projection column-parallel,
``out_proj`` and ``x_proj`` row-parallel, ``x_proj``'s partial sums reduced where the scan reads
them. Before, the whole mixer ran replicated (HF Mamba held 0.92 of the parameter bytes per rank
at tp=2, Jamba 0.59).

Cases: the zoo's ``selective_scan`` (its own code, float64 throughout, beside attention, tp=2 with
SP); HF Mamba (tp=2 + SP: no attention, the sequence dim found at its short convolution) and
Jamba (tp=2 + SP), float32 as the sweep runs
them, since transformers' Mamba casts its decay and skip to float32 inside a float64 model.
Also the zoo's ``einsum_projections`` (every projection an ``einsum`` of a raw parameter, its head
split unevenly along its 257 columns). Loss and every gradient at 3 AdamW steps, and the
parameters after two. One spawn of 2 ranks."""

from __future__ import annotations

import pytest

from gloo_cases import model_for as _model
from gloo_cases import split_on_simulated_ranks, train_cases
from models import zoo
from simulate import spawn_with_deadline

CASES = (  # (model, sp, the share of the parameter bytes a rank may hold at tp=2)
    ("selective_scan", True, 0.51),  # 0.502 (0.656 with the mixer whole)
    ("mamba", True, 0.51),  # 0.501 (0.92 before; SP's sequence dim from its short convolution)
    ("jamba", True, 0.51),  # 0.502 (0.59 before)
    # not a state-space model: projections as einsum of raw parameters, the head [hidden, 257]
    # split unevenly along its columns (1.00 when einsum was no linear)
    ("einsum_projections", True, 0.51),
)


@pytest.mark.slow
def test_selective_scan_mixers_train_like_the_original_on_gloo():
    spawn_with_deadline(train_cases, 2, 600.0, CASES)


def test_selective_scan_block_is_one_region_with_two_rows():
    """The fast lane's check, on simulated ranks: the mixer is one block whose rows are
    ``out_proj`` and ``params_proj`` (which reads the channels through a transpose), the step
    projection (``weight @ x``) a column beside ``in_proj``; float64 equal at tp=2 + SP."""
    split_on_simulated_ranks("selective_scan", 0.52, (11, 11))


def test_sequence_parallelism_finds_the_sequence_at_a_short_convolution_without_attention():
    """A selective-scan stack with no attention layer: SP takes the sequence length from the
    depthwise convolution's time dim (16), and is equal on simulated ranks in float64."""
    import sptransform

    model, batch, _ = _model("selective_scan")
    only_scans = zoo.SelectiveScanLM(n_layer=1).double()  # layer 0 is a scan, no attention
    report = sptransform.verify(only_scans, tp=2, sp=True, example_inputs=batch, processes=False, rtol=1e-9)
    assert report.status == "equal", report
