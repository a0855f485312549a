"""The region classifier and the graph-tensor facts, on small graphs traced by hand."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from sptransform.graph.regions import classify_regions
from sptransform.graph.nodes import is_fused_attention, is_random, is_view, storage_nbytes, storage_root

aten = torch.ops.aten
S, H, A = 8, 16, 2


def _layer(x, ln_w, w_qkv, w_o, ln2_w, w_up, w_down, causal):
    """One pre-norm transformer layer with explicit softmax attention and dropout."""
    h = F.layer_norm(x, (H,), ln_w)
    q, k, v = (h @ w_qkv).split(H, dim=-1)
    q, k, v = (t.view(S, A, H // A).transpose(0, 1) for t in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(H // A)
    att = F.dropout(att.masked_fill(~causal, float("-inf")).softmax(-1), 0.1, True)
    x = x + F.dropout((att @ v).transpose(0, 1).reshape(S, H) @ w_o, 0.1, True)
    return x + F.gelu(F.layer_norm(x, (H,), ln2_w) @ w_up) @ w_down


def _fused_layer(x, ln_w, w_qkv, w_o, *_):
    q, k, v = (F.layer_norm(x, (H,), ln_w) @ w_qkv).split(H, dim=-1)
    q, k, v = (t.view(S, A, H // A).transpose(0, 1) for t in (q, k, v))
    y = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[0]
    return x + y.transpose(0, 1).reshape(S, H) @ w_o


def _inputs():
    return [torch.randn(S, H), torch.ones(H), torch.randn(H, 3 * H), torch.randn(H, H), torch.ones(H),
            torch.randn(H, 4 * H), torch.randn(4 * H, H), torch.ones(S, S, dtype=torch.bool).tril()]


def _trace(fn, layers=1):
    def model(x, *state):
        for _ in range(layers):
            x = fn(x, *state)
        return (x,)

    gm = make_fx(model, tracing_mode="fake")(*_inputs())
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    output = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    return gm, classify_regions(gm.graph, state=placeholders[1:], outputs=list(output))


def _by_target(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


def test_explicit_attention_core_runs_from_qk_to_attention_over_v():
    gm, regions = _trace(_layer)
    (core,) = regions.cores
    assert not core.fused
    bmms = _by_target(gm, aten.bmm.default)
    assert (core.scores, core.values) == (bmms[0], bmms[1])
    assert any("softmax" in str(n.target) for n in core.internals)
    assert any(is_random(n) for n in core.internals)  # the dropout's draw joins the attention it drops
    assert {regions.region[n] for n in core.internals} <= {"attention_internals", "dropout_masks"}


def test_weight_matmuls_norms_and_up_projection_come_from_dataflow():
    gm, regions = _trace(_layer)
    mms = _by_target(gm, aten.mm.default)
    assert set(regions.weight_matmuls) == set(mms)  # qkv, out, up, down: a parameter on one side
    assert regions.up_projections == {mms[2]}
    norms = [n for n in regions.norms if n.target == aten.native_layer_norm.default]
    assert len(norms) == 2 and {regions.region[n] for n in norms} == {"norms"}
    assert [regions.region[m] for m in mms] == ["attention_projections"] * 2 + ["mlp"] * 2


def test_layers_are_counted_by_attention_sublayers_and_bounded_by_residuals():
    gm, regions = _trace(_layer, layers=3)
    assert regions.num_layers == 3 and len(regions.sublayers) == 6
    assert [regions.layer[c.values] for c in regions.cores] == [0, 1, 2]
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    assert regions.boundaries[0] is x and len(regions.boundaries) == 4


def test_fused_attention_is_one_core():
    gm, regions = _trace(_fused_layer)
    (core,) = regions.cores
    assert core.fused and regions.num_layers == 1


def test_attention_kernel_without_dropout_draws_nothing():
    """Fused attention kernels are tagged random; with ``dropout_p=0`` they draw nothing, so the
    rematerialisation pass must not save a generator state to replay them."""
    def attend(q, k, v, p):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p=p, is_causal=True)[0]

    q = torch.randn(1, 2, S, H // A)
    for p, random in ((0.0, False), (0.1, True)):
        gm = make_fx(lambda q, k, v: attend(q, k, v, p), tracing_mode="fake")(q, q, q)
        (kernel,) = [n for n in gm.graph.nodes if is_fused_attention(n)]
        assert is_random(kernel) is random


def test_fused_attention_is_recognised_inside_an_rng_wrapper():
    gm, _ = _trace(_fused_layer)
    (kernel,) = [n for n in gm.graph.nodes if is_fused_attention(n)]
    with gm.graph.inserting_before(kernel):
        wrapped = gm.graph.call_function(torch._prims.rng_prims.run_and_save_rng_state,
                                         (kernel.target, *kernel.args), dict(kernel.kwargs))
    assert is_fused_attention(wrapped) and is_random(wrapped) == is_random(kernel)


def test_classification_never_reads_node_names():
    gm, regions = _trace(_layer, layers=2)
    before = [(regions.region[n], regions.layer[n]) for n in gm.graph.nodes if n.op != "output"]
    for i, node in enumerate(gm.graph.nodes):
        if node.op != "output":
            node.name = f"renamed_{(i * 7919) % 1000}_{i}"
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    output = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    again = classify_regions(gm.graph, state=placeholders[1:], outputs=list(output))
    assert [(again.region[n], again.layer[n]) for n in gm.graph.nodes if n.op != "output"] == before


def test_views_share_the_storage_of_their_base():
    def f(x):
        a, b = x.view(4, 4).split(2)
        return a.t().contiguous(), b.reshape(8)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(16))
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    views = [n for n in gm.graph.nodes if n.op == "call_function" and is_view(n)]
    assert views and all(storage_root(n) is x for n in views)
    clone = next(n for n in gm.graph.nodes if n.target == aten.clone.default)
    assert not is_view(clone) and storage_root(clone) is clone and storage_nbytes(clone) == 8 * 4


def test_unannotated_aliases_count_as_views():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 4)
    y = graph.call_function(aten._unsafe_view.default, (x, [16]))
    assert is_view(y) and storage_root(y) is x
