"""The planner's activation bytes per layer agree with the bytes measured on the
partitioned graph (fake tensors, one rank) within 2%, for the GPT-family presets."""

from __future__ import annotations

import pytest

from sptransform.measure.layer import measure_shape
from sptransform.passes.remat import RematOptions
from sptransform.planner.activations import activation_bytes_per_layer
from sptransform.presets import PRESETS

CASES = [("gpt2", 1, False, 512), ("gpt2-medium", 1, False, 512), ("gpt-22b", 8, True, 2048), ("gpt-175b", 8, False, 2048)]


@pytest.mark.parametrize("name,tp,sp,seq", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_planner_activation_bytes_match_the_graph(name, tp, sp, seq, policy):
    shape = PRESETS[name]
    # "full" re-runs the layer's collectives in backward, as the planner (and Megatron) assume
    options = RematOptions(policy=policy, recompute_collectives=policy == "full")
    measured = measure_shape(shape, options=options, seq=seq, tp=tp, sp=sp).layer_bytes()
    planned = activation_bytes_per_layer(shape, tp=tp, sp=sp, recompute=policy, micro_batch=1, seq_len=seq,
                                         include_norm_statistics=True)
    assert planned == pytest.approx(measured, rel=0.02)
