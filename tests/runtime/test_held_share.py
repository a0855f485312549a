"""``pm.held_share()``: the share of parameter bytes a rank stores, measured on its tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import sptransform
from simulate import simulated_ranks

transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                                      intermediate_size=128, vocab_size=256, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_llama_rank_holds_about_one_over_tp(tp):
    model = _llama()
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    total = sum(p.numel() for p in model.parameters())
    with simulated_ranks(tp):
        pm = sptransform.parallelize(model, tp=tp)
        # every weight split except the norms, which are replicated
        assert pm.held_share() == pytest.approx((total - norms) / tp / total + norms / total, rel=1e-9)


def test_nothing_split_is_held_whole():
    model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8))
    pm = sptransform.parallelize(model, tp=1, example_inputs=(torch.zeros(2, 4, dtype=torch.long),))
    assert pm.held_share() == 1.0
