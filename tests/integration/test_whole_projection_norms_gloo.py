"""Query and key norms over the whole projections (OLMo-2, OLMo-3, OLMoE, FlexOlmo, OLMo-hybrid),
split over real gloo ranks.

OLMo-2 normalizes ``q_proj(x)`` and ``k_proj(x)`` over all their features, before the head split.
The walk back from ``o_proj`` met that norm's mean square over the split features ("used outside
the tensor-parallel region") and the projections ran whole: OLMo-2 held 0.67 of its parameter
bytes per rank at tp=2 + SP (7 of 15 linears split). Now a statistic of the split tensor over its
split dim inside an attention block (elementwise steps ending in ``sum``/``mean``,
``graph.walk._statistic``) is a partial sum (a ``mean``: each rank's mean over tp), reduced where
it is read: one small collective of ``[batch, seq, 1]`` per norm instead of the projections whole.
Outside attention blocks such a norm still ends the walk (the residual stream's norms: without that
the walk back from the head would cross every layer).

A fused ``rms_norm`` of a projection's output (torch's ``nn.RMSNorm``, the zoo's ``qk_norm_whole``)
is first written out as the ops its composite runs, bitwise alike (``passes.canonicalize.
written_norms``), and is then the same case.

Cases: the zoo's ``qk_norm_written`` and ``qk_norm_whole`` (float64) and HF OLMo-2 and OLMoE
(float32, as the sweep shrinks them), tp=2 with SP: loss and every gradient at 3 AdamW steps, and the parameters after
two. One spawn of 2 ranks."""

from __future__ import annotations

import pytest

from gloo_cases import split_on_simulated_ranks, train_cases
from simulate import spawn_with_deadline

CASES = (  # (model, sp, the share of the parameter bytes a rank may hold at tp=2)
    ("qk_norm_written", True, 0.51),  # 0.501 (0.645 with the attention whole)
    ("qk_norm_whole", True, 0.51),  # 0.501 (0.57: its fused nn.RMSNorm gathered the projection)
    ("olmo2", True, 0.51),  # 0.502 (0.67 before)
    ("olmoe", True, 0.51),  # 0.502 (0.57 before)
)


@pytest.mark.slow
def test_whole_projection_query_and_key_norms_train_like_the_original_on_gloo():
    spawn_with_deadline(train_cases, 2, 600.0, CASES)


def test_whole_projection_norms_leave_every_linear_split_on_simulated_ranks():
    """The fast lane's check: all 13 linears of ``qk_norm_written`` split, the head
    vocabulary-parallel (not a row crossing the residual norms), float64 equal at tp=2 + SP."""
    split_on_simulated_ranks("qk_norm_written", 0.51, (13, 13))


def test_a_fused_rms_norm_over_the_whole_projection_leaves_every_linear_split_on_simulated_ranks():
    split_on_simulated_ranks("qk_norm_whole", 0.51, (13, 13))
