"""The parallel model trains exactly like the original: loss, every gradient and
every parameter after AdamW steps, on simulated ranks (LocalTensorMode)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simulate import train_side_by_side
from tiny_models import SeqFirstLM, TinyConfig, TinyLM


@st.composite
def tiny_configs(draw):
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    sp = draw(st.booleans())
    kv_groups = draw(st.sampled_from([1, 2]))
    kv_heads = tp * draw(st.integers(1, 2 if tp < 8 else 1))
    heads = kv_heads * kv_groups
    head_dim = draw(st.sampled_from([4, 8]))
    config = TinyConfig(
        vocab=draw(st.integers(17, 97)),  # often not divisible by tp: exercises vocab padding
        hidden=heads * head_dim,
        heads=heads,
        kv_heads=kv_heads,
        layers=draw(st.integers(1, 2)),
        ffn=tp * 4 * draw(st.integers(1, 3)),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        mlp=draw(st.sampled_from(["gelu", "swiglu"])),
        bias=draw(st.booleans()),
        tied=draw(st.booleans()),
        dropout=draw(st.sampled_from([0.0, 0.1])),
        sdpa=draw(st.booleans()),
    )
    seq = tp * draw(st.integers(1, 3))
    batch = draw(st.integers(1, 3))
    return config, tp, sp, seq, batch


@pytest.mark.slow
@pytest.mark.in_process  # no spawned ranks: runs beside the process tests
@settings(derandomize=True, max_examples=14, deadline=None)
@given(case=tiny_configs())
def test_parallel_training_matches_single_device_for_any_config(case):
    config, tp, sp, seq, batch = case
    ids = torch.randint(0, config.vocab, (batch, seq))
    targets = torch.randint(0, config.vocab, (batch, seq))
    train_side_by_side(lambda: TinyLM(config), (ids, targets), tp=tp, sp=sp, steps=3)


@pytest.mark.parametrize("sp", [True, False])
def test_sequence_first_layout_matches_single_device(sp):
    config = TinyConfig(hidden=32, heads=4, ffn=64)
    ids = torch.randint(0, config.vocab, (8, 2))  # [s, b]
    targets = torch.randint(0, config.vocab, (8, 2))
    train_side_by_side(lambda: SeqFirstLM(config), (ids, targets), tp=2, sp=sp, steps=2)


def test_nanogpt_example_with_dropout_matches_in_reference_mode():
    from examples.nanogpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=101, n_layer=2, n_head=4, n_embd=32, block_size=32, dropout=0.1)
    idx = torch.randint(0, 101, (2, 16))
    targets = torch.randint(0, 101, (2, 16))
    train_side_by_side(lambda: GPT(config), (idx, targets), tp=4, sp=True, steps=3)
