"""Collectives per layer, read from the parallel graph: TP has 4 all-reduces per layer
(f, f̄ for attention and MLP, forward + backward); TP+SP has 4 all-gathers and 4
reduce-scatters moving the same bytes, plus one bucketed gradient all-reduce."""

from __future__ import annotations

import torch

import sptransform
from sptransform.runtime.collectives import gather_seq, scatter_seq, sync_grads
from sptransform.runtime.explain import COLLECTIVE_DIRECTIONS, collective_bytes, collective_counts, collective_nodes
from simulate import fake_group
from tiny_models import TinyConfig, TinyLM

TP = 4


def _graph(layers: int, sp: bool):
    config = TinyConfig(layers=layers, hidden=64, heads=8, kv_heads=8, ffn=128, vocab=64)
    ids = torch.randint(0, 64, (2, 16))
    with fake_group(TP):
        pm = sptransform.parallelize(TinyLM(config), tp=TP, sp=sp, example_inputs=(ids, ids.clone()))
    return pm._last.gm


def _per_layer(sp: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Counts and ring bytes added by one more layer (3 layers minus 1, halved)."""
    one, three = _graph(1, sp), _graph(3, sp)
    counts = {k: (collective_counts(three).get(k, 0) - collective_counts(one).get(k, 0)) // 2
              for k in ("all-gather", "reduce-scatter", "all-reduce")}
    return counts, {k: (_ring_bytes(three, k) - _ring_bytes(one, k)) // 2 for k in counts}


def _ring_bytes(gm, kind: str) -> int:
    """Bytes a ring algorithm sends per rank: all-reduce 2(t-1)/t N, the others (t-1)/t N."""
    total = 0
    for node in collective_nodes(gm):
        if node.target is sync_grads:
            continue  # the gradient bucket is counted separately
        forward, backward = COLLECTIVE_DIRECTIONS[node.target]
        n = collective_bytes(node, TP)
        factor = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1}[kind]
        total += sum(factor * n * (TP - 1) // TP for k in forward + backward if k == kind)
    return total


def test_tensor_parallel_has_four_all_reduces_per_layer():
    counts, _ = _per_layer(sp=False)
    assert counts == {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 4}


def test_sequence_parallel_has_four_gathers_four_scatters_and_one_bucket_per_layer():
    counts, _ = _per_layer(sp=True)
    assert counts == {"all-gather": 4, "reduce-scatter": 4, "all-reduce": 1}


def test_sequence_parallel_moves_the_same_activation_bytes_as_tensor_parallel():
    _, tp_bytes = _per_layer(sp=False)
    _, sp_bytes = _per_layer(sp=True)
    assert sp_bytes["all-gather"] + sp_bytes["reduce-scatter"] == tp_bytes["all-reduce"] > 0


def test_one_gradient_bucket_per_layer_holds_the_layer_norm_weights_and_row_biases():
    gm = _graph(2, sp=True)
    buckets = [n for n in gm.graph.nodes if n.target is sync_grads]
    assert len(buckets) == 3  # one per layer, and one for what follows the last block
    sizes = [len(b.args) - 1 for b in buckets]
    # layer 0: positions + 2 norms x (w, b) + the attention's row bias; layer 1: the previous MLP's
    # row bias + 2 norms x (w, b) + its attention's row bias; then the last MLP bias + the final norm
    assert sizes == [6, 6, 3]


def test_g_and_g_bar_gather_and_scatter_along_the_sequence_dim():
    gm = _graph(1, sp=True)
    dims = {n.args[1] for n in gm.graph.nodes if n.target in (gather_seq, scatter_seq)}
    assert dims == {1}  # [b, s, h]
