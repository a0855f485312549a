"""The pipeline split pass on captured graphs: layer boundaries, replicable nodes, tied
weights, stage graphs that chain back to the model, and balancing by measured cost."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from sptransform.graph.analysis import analyze
from sptransform.capture import FakeTemplate, capture
from sptransform.passes.pipeline_split import (
    GraphFlow, balance_layers, find_layer_boundaries, split_graph, stage_costs,
)
from sptransform.pipeline.plan import find_loss_output
from sptransform.pipeline.costs import measure_layer_costs
from tiny_models import Block, TinyConfig, TinyLM


def _flow(model: nn.Module, args: tuple, kwargs: dict | None = None):
    captured = capture(FakeTemplate(model, torch.device("cpu")), args, kwargs or {})
    analysis = analyze(captured, 1)
    flow = GraphFlow(captured, find_loss_output(captured, analysis))
    return flow, analysis


def _ids(vocab: int, batch: int = 2, seq: int = 8):
    return torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))


def _hf(kind: str, layers: int = 4):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=97, n_positions=32,
                                         attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config).train()
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, vocab_size=97,
                                      max_position_embeddings=32, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).train()


def _hf_inputs():
    ids, labels = _ids(97)
    return dict(input_ids=ids, labels=labels, use_cache=False)


@pytest.mark.parametrize("kind", ["tiny", "gpt2", "llama"])
def test_each_layer_boundary_is_crossed_by_the_residual_stream_alone(kind):
    if kind == "tiny":
        flow, analysis = _flow(TinyLM(TinyConfig(layers=4)), _ids(61))
    else:
        flow, analysis = _flow(_hf(kind), (), _hf_inputs())
    boundaries = find_layer_boundaries(flow, analysis)
    assert [b.layer for b in boundaries] == [1, 2, 3]
    for b in boundaries:
        assert len(b.crossing) == 1, [n.name for n in b.crossing]
        value = b.crossing[0].meta["val"]
        assert tuple(value.shape) == (2, 8, 32) and b.nbytes == value.numel() * 4


def test_llama_rotary_tables_and_shifted_labels_are_recomputed_by_each_stage_not_sent():
    flow, analysis = _flow(_hf("llama"), (), _hf_inputs())
    boundaries = find_layer_boundaries(flow, analysis)
    stages = split_graph(flow, [boundaries[1]], analysis.num_layers)
    assert [len(s.received) for s in stages] == [0, 1]
    # the rotary tables (from the inv_freq buffer) are computed in both stages
    assert "model.rotary_emb.inv_freq" in stages[0].state_names and "model.rotary_emb.inv_freq" in stages[1].state_names
    assert 1 in stages[1].user_inputs  # labels reach the last stage as an input
    assert 1 not in stages[0].user_inputs


def test_tied_embedding_and_head_are_a_parameter_of_both_end_stages():
    flow, analysis = _flow(TinyLM(TinyConfig(layers=2, tied=True)), _ids(61))
    boundaries = find_layer_boundaries(flow, analysis)
    first, last = split_graph(flow, boundaries, analysis.num_layers)
    tied = [name for name in first.state_names if name in last.state_names]
    assert tied == ["head.weight"]
    assert all(n in ("head.weight",) or n.startswith(("tok", "pos", "blocks.0")) for n in first.state_names)
    assert first.sent_bytes == 2 * 8 * 32 * 4  # only the residual, no weight travels


@pytest.mark.parametrize("kind,starts", [("tiny", [0, 1]), ("tiny", [0, 2, 3]), ("gpt2", [0, 1, 2, 3]),
                                         ("llama", [0, 3])])
def test_stage_graphs_chained_reproduce_the_model_loss_and_gradients(kind, starts):
    torch.manual_seed(0)
    if kind == "tiny":
        model, args, kwargs = TinyLM(TinyConfig(layers=4)), _ids(61), {}
    else:
        model, args, kwargs = _hf(kind), (), _hf_inputs()
    flow, analysis = _flow(model, args, kwargs)
    boundaries = find_layer_boundaries(flow, analysis)
    stages = split_graph(flow, [boundaries[s - 1] for s in starts[1:]], analysis.num_layers)
    assert [s.layers.start for s in stages] == starts

    ref = copy.deepcopy(model)
    out = ref(*args, **kwargs)
    ref_loss = out if isinstance(out, torch.Tensor) else out.loss
    ref_loss.backward()

    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    flat = list(args) + list(kwargs.values())
    activations: tuple = ()
    for stage in stages:
        out = stage.gm(*activations, *[state[n] for n in stage.state_names], *[flat[i] for i in stage.user_inputs])
        activations = out if isinstance(out, tuple) else (out,)
    (loss,) = activations
    loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m, n=name: f"{n}: {m}")


def _brute_force(times, num_stages, memory, inflight):
    best = None
    for cuts in itertools.combinations(range(1, len(times)), num_stages - 1):
        starts = [0, *cuts]
        slowest = max(stage_costs(times, starts))
        peak = max(m * f for m, f in zip(stage_costs(memory, starts), inflight))
        if best is None or (slowest, peak) < best[0]:
            best = ((slowest, peak), starts)
    return best


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_balance_minimizes_the_slowest_stage_then_the_peak_memory(data):
    layers = data.draw(st.integers(1, 9))
    num_stages = data.draw(st.integers(1, layers))
    times = data.draw(st.lists(st.integers(1, 50), min_size=layers, max_size=layers))
    memory = data.draw(st.lists(st.integers(0, 50), min_size=layers, max_size=layers))
    inflight = data.draw(st.lists(st.integers(1, 8), min_size=num_stages, max_size=num_stages))
    starts = balance_layers(times, num_stages, activation_bytes=memory, inflight=inflight)
    (slowest, peak), _ = _brute_force(times, num_stages, memory, inflight)
    assert starts[0] == 0 and len(starts) == num_stages and starts == sorted(set(starts))
    assert max(stage_costs(times, starts)) == slowest
    assert max(m * f for m, f in zip(stage_costs(memory, starts), inflight)) == peak


class UnevenLM(TinyLM):
    """TinyLM whose layers have MLPs of different widths."""

    def __init__(self, c: TinyConfig, widths: list[int]):
        super().__init__(replace(c, layers=len(widths)))
        self.blocks = nn.ModuleList(Block(replace(c, ffn=w)) for w in widths)


@pytest.mark.parametrize("widths,num_stages,expected", [
    ([1024, 32, 32, 32], 2, [0, 1]),
    ([32, 32, 32, 1024], 2, [0, 3]),
    ([32, 512, 512, 32, 32, 32], 3, [0, 2, 3]),
])
def test_measured_costs_balance_uneven_layers_at_the_cut_minimizing_the_slowest_stage(widths, num_stages, expected):
    torch.manual_seed(0)
    c = TinyConfig(vocab=61, hidden=32, heads=4, kv_heads=4)
    ids, targets = _ids(61)
    flow, analysis = _flow(UnevenLM(c, widths), (ids, targets))
    boundaries = find_layer_boundaries(flow, analysis)
    costs = measure_layer_costs(flow, boundaries, analysis.num_layers, [ids, targets])
    times = [cost.time for cost in costs]
    memory = [cost.activation_bytes for cost in costs]
    # the wide layers cost more, in time and in saved bytes
    wide = max(range(len(widths)), key=widths.__getitem__)
    assert times[wide] == max(times) and memory[wide] == max(memory)
    starts = balance_layers(times, num_stages, activation_bytes=memory, inflight=[1] * num_stages)
    assert starts == expected
    best_slowest = min(max(stage_costs(times, [0, *cuts]))
                       for cuts in itertools.combinations(range(1, len(widths)), num_stages - 1))
    assert max(stage_costs(times, starts)) == best_slowest


def test_saved_bytes_count_what_autograd_keeps_per_layer():
    """A layer of TinyLM (LayerNorm, fused K/V, explicit softmax attention, GELU MLP) saves, per
    token, its inputs to norms and matmuls, softmax probabilities and the GELU input."""
    torch.manual_seed(0)
    c = TinyConfig(layers=3, hidden=32, heads=4, kv_heads=4, ffn=64)
    ids, targets = _ids(61, batch=2, seq=8)
    flow, analysis = _flow(TinyLM(c), (ids, targets))
    costs = measure_layer_costs(flow, find_layer_boundaries(flow, analysis), 3, [ids, targets])
    middle = costs[1].activation_bytes
    assert costs[0].activation_bytes >= middle and costs[2].activation_bytes > middle  # embedding / head extra
    tokens, h, a = 2 * 8, 32, 4
    floor = 4 * tokens * (2 * h + h + 2 * h + 64 + 64) + 4 * 2 * a * 8 * 8  # norms, qkv/o/fc in, gelu, probs
    assert floor <= middle <= 3 * floor


# ---------------------------------------------------------------------------
# layers from structure: models whose attention the tensor-parallel analysis leaves whole


def _chained_loss_and_grads(model: nn.Module, stages, args: tuple):
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    activations: tuple = ()
    for stage in stages:
        out = stage.gm(*activations, *[state[n] for n in stage.state_names], *[args[i] for i in stage.user_inputs])
        activations = out if isinstance(out, tuple) else (out,)
    (loss,) = activations
    loss.backward()
    return loss, {name: p.grad for name, p in model.named_parameters()}


def _assert_stages_reproduce(model: nn.Module, stages, args: tuple):
    ref = copy.deepcopy(model)
    ref_loss = ref(*args)
    ref_loss.backward()
    loss, grads = _chained_loss_and_grads(model, stages, args)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", ["alternating", "qk_norm", "multi_query"])
def test_layers_are_residual_blocks_whether_or_not_the_analysis_recognises_the_attention(name):
    """The alternating model's attention is no block of the analysis; the multi-query one is (its
    fused projection computed whole, its heads split, since 2026-11-28), and the QK-norm one is
    (its norm's mean square over the split projection a partial sum, since the same day). Either
    way the layers are the residual blocks."""
    from models.pipeline_blocks import BLOCK_MODELS, BlocksConfig

    torch.manual_seed(0)
    model = BLOCK_MODELS[name](BlocksConfig(layers=3)).double()
    args = _ids(96)
    flow, analysis = _flow(model, args)
    assert analysis.num_layers == (1 if name == "alternating" else 3)  # 1: what refused pp=2 before
    boundaries = find_layer_boundaries(flow, analysis)
    assert [b.layer for b in boundaries] == [1, 2]
    for b in boundaries:
        assert len(b.crossing) == 1, [n.name for n in b.crossing]
        assert tuple(b.crossing[0].meta["val"].shape) == (2, 8, 32) and b.nbytes == 2 * 8 * 32 * 8
    _assert_stages_reproduce(model, split_graph(flow, boundaries, 3), args)


class ResidualFreeLM(nn.Module):
    """Embedding, a plain stack of linears (no residual add anywhere), final norm, head, loss."""

    def __init__(self, widths=(32, 64, 32, 64, 32)):
        super().__init__()
        self.embed = nn.Embedding(61, widths[0])
        self.stack = nn.Sequential(*(m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.Tanh())))
        self.norm = nn.LayerNorm(widths[-1])
        self.head = nn.Linear(widths[-1], 61)

    def forward(self, idx, targets):
        logits = self.head(self.norm(self.stack(self.embed(idx))))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 61), targets.reshape(-1))


@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_graph_without_residual_blocks_is_cut_at_cheap_points_that_balance_the_stages(num_stages):
    from sptransform.passes.pipeline_split import find_stage_cuts

    torch.manual_seed(0)
    model = ResidualFreeLM().double()
    args = _ids(61)
    flow, analysis = _flow(model, args)
    assert find_layer_boundaries(flow, analysis) == []
    cuts = find_stage_cuts(flow, analysis, num_stages)
    assert cuts.num_layers == num_stages and "no residual block" in cuts.found
    for b in cuts.boundaries:  # between linears, where one 32-wide activation crosses (not a 64-wide one)
        assert len(b.crossing) == 1 and b.crossing[0].meta["val"].shape[-1] == 32, [n.name for n in b.crossing]
    costs = measure_layer_costs(flow, cuts.boundaries, cuts.num_layers, list(args))
    assert max(c.time for c in costs) < 0.75 * sum(c.time for c in costs)
    _assert_stages_reproduce(model, split_graph(flow, cuts.boundaries, cuts.num_layers), args)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_balanced_cuts_minimize_the_slowest_stage_counting_what_each_stage_sends(data):
    from sptransform.passes.pipeline_split import _min_max_partition

    nodes = data.draw(st.integers(2, 12))
    work = data.draw(st.lists(st.integers(0, 50), min_size=nodes, max_size=nodes))
    candidates = sorted(data.draw(st.sets(st.integers(1, nodes - 1), min_size=1)))
    cuts = data.draw(st.integers(1, len(candidates)))
    sends = data.draw(st.lists(st.integers(0, 30), min_size=len(candidates), max_size=len(candidates)))
    prefix = [sum(work[:p]) for p in range(nodes + 1)]
    points, send = [0, *candidates, nodes], [0, *sends, 0]

    def price(chosen):
        bounds = [0, *(points.index(c) for c in chosen), len(points) - 1]
        stages = [prefix[points[j]] - prefix[points[i]] + send[j] for i, j in zip(bounds, bounds[1:])]
        return max(stages), sum(send[j] for j in bounds[1:])

    chosen = _min_max_partition(prefix, points, send, cuts)
    assert len(chosen) == cuts and chosen == sorted(set(chosen))
    assert price(chosen) == min(price(list(c)) for c in itertools.combinations(candidates, cuts))
