"""Checkpointing whole blocks (the notebook's question), measured on the graph."""

from __future__ import annotations

import pytest

from sptransform.measure.layer import measure_shape
from sptransform.passes.remat import RematOptions
from sptransform.planner.presets import PRESETS

SEQ = 256


def _bytes(**options) -> float:
    return measure_shape(PRESETS["gpt2"], options=RematOptions(**options, recompute_fusible=False), seq=SEQ).layer_bytes()


def test_checkpointing_attention_saves_more_than_mlp_and_both_keep_two_block_inputs():
    sbh = SEQ * 768  # bf16: one [s, h] tensor is 2 sbh bytes
    none = _bytes(policy="none")
    attention = _bytes(policy="blocks", blocks=("attention",))
    mlp = _bytes(policy="blocks", blocks=("mlp",))
    both = _bytes(policy="blocks", blocks=("attention", "mlp"))
    full = _bytes(policy="full")
    assert none > mlp > attention > both > full
    assert both / sbh == pytest.approx(4.0, rel=0.03)  # the two block inputs, 2 bytes each
    assert full / sbh == pytest.approx(2.0, rel=0.05)  # the layer input


def test_blocks_needs_its_policy_and_known_kinds():
    with pytest.raises(ValueError, match="policy='blocks' takes blocks from"):
        RematOptions(policy="full", blocks=("mlp",))
    with pytest.raises(ValueError, match="policy='blocks' takes blocks from"):
        RematOptions(policy="blocks", blocks=("embedding",))
