"""Lookups whose indices the graph computes from constants (positions from ``arange``) are
checked against their table when a graph is captured (``graph/lookups.py``, issue 20 item 8)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import sptransform
from sptransform.graph.lookups import constant_lookup_problems
from simulate import simulated_ranks

aten = torch.ops.aten


def _graph(rows: int, end: int):
    """ids -> embedding(tokens, ids) + embedding(positions, arange(end)), traced to ATen."""
    tokens, positions = torch.randn(50, 4), torch.randn(rows, 4)

    def f(tokens, positions, ids):
        return aten.embedding.default(tokens, ids) + aten.embedding.default(positions, aten.arange.start(0, end))

    gm = fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(tokens, positions, torch.zeros(end, dtype=torch.long))
    names = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], ["tokens", "positions", "ids"]))
    return gm, names


def test_constant_indices_past_the_table_are_found_and_inputs_are_not_evaluated():
    gm, names = _graph(rows=8, end=12)
    problems = constant_lookup_problems(gm, names)
    assert len(problems) == 1 and "'positions' has 8 rows" in problems[0] and "row 11" in problems[0], problems
    gm, names = _graph(rows=12, end=12)
    assert constant_lookup_problems(gm, names) == []  # the ids (an input) are checked per call, not here


def test_a_sequence_longer_than_gpt2s_positions_names_the_table():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                                                 n_positions=16))
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=(torch.randint(0, 64, (2, 16)),))
        with pytest.raises(IndexError, match=r"'transformer.wpe.weight' has 16 rows and the model reads row 23"):
            pm(torch.randint(0, 64, (2, 24)))
