"""Expert-tensor parallelism from dataflow: a grouped matmul of a 3-D expert parameter is a
linear per expert, found, placed and split like a dense MLP (gate/up column-wise, down
row-wise), on a hand-written MoE block whose experts run transformers' grouped matmul op (the
one its MoE families capture on CPU; ``torch._grouped_mm``'s meta kernel takes bfloat16 only)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest

import sptransform
from sptransform.capture import FakeTemplate, capture
from sptransform.graph.analysis import analyze, find_linears, parameter_placements
from sptransform.graph.placement import DimShard
from simulate import simulated_ranks

pytest.importorskip("transformers.integrations.moe")  # registers torch.ops.transformers.grouped_mm_fallback

E, H, I, V = 4, 16, 32, 64  # experts, hidden, expert width, vocabulary 


class GroupedExperts(nn.Module):
    """Top-1 routing with tokens sorted by expert, the experts one grouped matmul each way:
    ``gate_up [E, 2I, H]`` read transposed (as transformers stores it), ``down [E, I, H]``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * I, H) / H ** 0.5)
        self.down = nn.Parameter(torch.randn(E, I, H) / I ** 0.5)
        self.norm = nn.RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids).flatten(0, 1)  # [S, H]
        scores = self.router(x).softmax(-1)
        weight, expert = scores.max(-1)
        order = expert.argsort(stable=True)
        counts = torch.histc(expert.float(), bins=E, min=0, max=E - 1)  # expert e's rows end at offs[e]
        offs = counts.cumsum(0).to(torch.int32)
        xs = x[order]
        gate, up = torch.ops.transformers.grouped_mm_fallback(xs, self.gate_up.transpose(-2, -1), offs).chunk(2, dim=-1)
        ys = torch.ops.transformers.grouped_mm_fallback(F.silu(gate) * up, self.down, offs)  # [S, H]
        y = torch.empty_like(ys).index_copy(0, order, ys) * weight[:, None]
        logits = self.head(self.norm(x + y))
        return F.cross_entropy(logits, labels.flatten())


def _inputs(tokens=16):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (2, tokens), generator=g), torch.randint(0, V, (2, tokens), generator=g)


def test_grouped_matmuls_of_expert_parameters_are_linears_per_expert():
    captured = capture(FakeTemplate(GroupedExperts(), torch.device("cpu")), _inputs(), {})
    found = {lm.weight_name: lm for lm in find_linears(captured).values() if lm.per_group}
    gate_up, down = found["gate_up"], found["down"]
    assert (gate_up.out_dim, gate_up.weight_in_dim, gate_up.in_features, gate_up.out_features) == (1, 2, H, 2 * I)
    assert (down.out_dim, down.weight_in_dim, down.in_features, down.out_features) == (2, 1, I, H)


def test_experts_split_like_a_dense_mlp_per_expert_and_the_router_stays_whole():
    analysis = analyze(capture(FakeTemplate(GroupedExperts(), torch.device("cpu")), _inputs(), {}), 2)
    (region,) = analysis.regions
    assert region.kind == "mlp" and region.row.weight_name == "down"
    placements = parameter_placements(analysis, 2)
    # gate and up halves of each expert's rows, each split over the ranks: two segments
    assert placements["gate_up"].spec == DimShard(1, ((0, I), (I, I)))
    assert placements["down"].spec == DimShard(1, ((0, I),))
    assert "router.weight" not in placements
    assert "neither column- nor row-parallel" in analysis.whole_reasons["router.weight"]


def test_grouped_experts_train_like_the_original_on_simulated_ranks_and_explain_names_what_stays_whole():
    from simulate import train_side_by_side

    train_side_by_side(GroupedExperts, _inputs(), tp=2, sp=False, steps=2, rtol=1e-4, atol=1e-5)
    with simulated_ranks(2):
        torch.manual_seed(0)
        pm = sptransform.parallelize(GroupedExperts(), tp=2, sp=False, example_inputs=_inputs())
        report = pm.explain()
        held = pm.held_share()
    assert "held whole on every rank: 2 parameters" in report, report
    assert "router.weight" in report.split("held whole on every rank")[1], report
    assert held < 0.55, held


def _one_op_graph(fn, *inputs) -> torch.fx.GraphModule:
    from graph.test_rules import _graph

    return _graph(fn, *inputs)


def test_grouped_matmul_rule_keeps_rows_whole_and_splits_features_per_expert():
    from graph.test_rules import _backward, _forward, _inputs as placeholders
    from sptransform.graph.placement import PARTIAL, REPLICATED, whole

    grouped = torch.ops.transformers.grouped_mm_fallback.default
    offs = torch.tensor([3, 8], dtype=torch.int32)
    gm = _one_op_graph(lambda x, w, o: grouped(x, w, o), torch.randn(8, 4), torch.randn(2, 4, 6), offs)
    (x, w, o), op = placeholders(gm), next(n for n in gm.graph.nodes if n.op == "call_function")
    column = _forward(op, {w: whole(2, 6)}, constant={w})
    assert column.output == whole(1, 6) and column.needs == {x: REPLICATED, w: whole(2, 6), o: REPLICATED}
    row = _forward(op, {x: whole(1, 4), w: whole(1, 4)}, constant={w})
    assert row.output == PARTIAL and row.needs[o] == REPLICATED
    # rows split by tokens: which rows form each group is fixed by all of them, so the op runs whole
    assert _forward(op, {x: whole(0, 8)}).needs[x] == REPLICATED
    assert _backward(op, whole(1, 6)) == {x: None, w: whole(2, 6), o: None}


def test_strided_slices_of_a_whole_dim_carry_its_split_both_ways():
    from graph.test_rules import _backward, _forward, _inputs as placeholders
    from sptransform.graph.placement import REPLICATED, whole

    gm = _one_op_graph(lambda x: torch.ops.aten.slice.Tensor(x, 1, 1, 9223372036854775807, 2), torch.randn(3, 8))
    (x,), op = placeholders(gm), next(n for n in gm.graph.nodes if n.op == "call_function")
    assert _backward(op, whole(1, 4)) == {x: whole(1, 8)}
    assert _forward(op, {x: whole(1, 8)}).output == whole(1, 4)
    # each rank's part of 6 is 3: not whole pairs, the local x[:, 1::2] would take the wrong ones
    gm = _one_op_graph(lambda x: torch.ops.aten.slice.Tensor(x, 1, 1, 9223372036854775807, 2), torch.randn(3, 6))
    (x,), op = placeholders(gm), next(n for n in gm.graph.nodes if n.op == "call_function")
    assert _forward(op, {x: whole(1, 6)}).output == REPLICATED


# ---------------------------------------------------------------------------
# experts gathered per token and run by bmm (transformers' experts_implementation="batched_mm")


class BatchedExperts(nn.Module):
    """Top-2 routing, each token-expert pair's weights gathered (``W[expert_ids]``) and applied by
    ``bmm``, the pairs summed back per token, as transformers' ``batched_mm`` experts run.
    ``transposed``: weights stored ``[E, in, out]`` (GPT-OSS) instead of ``[E, out, in]``;
    ``bias``: a bias per expert and projection; ``interleaved``: gate and up interleaved along the
    features (GPT-OSS's ``gate_up[..., ::2]``) instead of two halves."""

    def __init__(self, transposed=False, bias=False, interleaved=False):
        super().__init__()
        self.transposed, self.interleaved = transposed, interleaved
        self.emb = nn.Embedding(V, H)
        self.router = nn.Linear(H, E, bias=False)
        shape = (lambda out, inp: (E, inp, out)) if transposed else (lambda out, inp: (E, out, inp))
        self.gate_up = nn.Parameter(torch.randn(*shape(2 * I, H)) / H ** 0.5)
        self.down = nn.Parameter(torch.randn(*shape(H, I)) / I ** 0.5)
        self.gate_up_bias = nn.Parameter(torch.randn(E, 2 * I) / 10) if bias else None
        self.down_bias = nn.Parameter(torch.randn(E, H) / 10) if bias else None
        self.norm = nn.RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def _linear(self, x, w, b):  # x [S, in], w [S, out, in] (or [S, in, out] transposed)
        y = torch.bmm(x.unsqueeze(1), w).squeeze(1) if self.transposed else torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
        return y if b is None else y + b

    def forward(self, ids, labels):
        x = self.emb(ids).flatten(0, 1)  # [T, H]
        weights, experts = self.router(x).softmax(-1).topk(2, dim=-1)  # [T, 2]
        pairs = experts.reshape(-1)  # [S = 2T]
        xs = x.repeat_interleave(2, dim=0)  # [S, H]
        h = self._linear(xs, self.gate_up[pairs], self.gate_up_bias[pairs] if self.gate_up_bias is not None else None)
        gate, up = (h[..., ::2], h[..., 1::2]) if self.interleaved else h.chunk(2, dim=-1)  # [S, I] each
        h = F.silu(gate) * up
        ys = self._linear(h, self.down[pairs], self.down_bias[pairs] if self.down_bias is not None else None)  # [S, H]
        y = (ys * weights.reshape(-1, 1)).view(-1, 2, H).sum(1)  # [T, H]
        logits = self.head(self.norm(x + y))
        return F.cross_entropy(logits, labels.flatten())


LAYOUTS = [dict(), dict(transposed=True, bias=True, interleaved=True)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["stored_out_in", "transposed_biased_interleaved"])
def test_bmm_of_expert_weights_gathered_per_token_splits_like_a_dense_mlp_per_expert(layout):
    captured = capture(FakeTemplate(BatchedExperts(**layout), torch.device("cpu")), _inputs(), {})
    found = {lm.weight_name: lm for lm in find_linears(captured).values() if lm.per_group}
    out_dim, in_dim = (2, 1) if layout else (1, 2)
    gate_up, down = found["gate_up"], found["down"]
    assert (gate_up.out_dim, gate_up.weight_in_dim, gate_up.in_features, gate_up.out_features) == (out_dim, in_dim, H, 2 * I)
    assert (down.out_dim, down.weight_in_dim, down.in_features, down.out_features) == (out_dim, in_dim, I, H)
    analysis = analyze(captured, 2)
    (region,) = analysis.regions
    assert region.row.weight_name == "down"
    placements = parameter_placements(analysis, 2)
    # halves [gate | up]: two segments; interleaved [g0 u0 g1 u1 ...]: rank r's gate and up rows are contiguous
    gate_up_split = ((0, 2 * I),) if layout.get("interleaved") else ((0, I), (I, I))
    assert placements["gate_up"].spec == DimShard(out_dim, gate_up_split)
    assert placements["down"].spec == DimShard(in_dim, ((0, I),))
    assert "router.weight" not in placements


@pytest.mark.parametrize("layout", LAYOUTS, ids=["stored_out_in", "transposed_biased_interleaved"])
def test_batched_experts_train_like_the_original_on_simulated_ranks_holding_half_the_expert_bytes(layout):
    from simulate import train_side_by_side

    train_side_by_side(lambda: BatchedExperts(**layout), _inputs(), tp=2, sp=False, steps=2, rtol=1e-4, atol=1e-5)
    with simulated_ranks(2):
        torch.manual_seed(0)
        pm = sptransform.parallelize(BatchedExperts(**layout), tp=2, sp=False, example_inputs=_inputs())
        held = pm.held_share()
    assert held < 0.56, held


class StackedExperts(nn.Module):
    """Every expert on every token, the experts as ``bmm``'s batch dim (Llama 4's experts run on
    tokens laid out ``[E, T, H]``), the outputs weighted by the router and summed over experts."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * I) / H ** 0.5)
        self.down = nn.Parameter(torch.randn(E, I, H) / I ** 0.5)
        self.norm = nn.RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids).flatten(0, 1)  # [T, H]
        scores = self.router(x).softmax(-1)  # [T, E]
        xs = x.unsqueeze(0).expand(E, -1, -1)  # [E, T, H]
        gate, up = torch.bmm(xs, self.gate_up).chunk(2, dim=-1)  # [E, T, I] each
        ys = torch.bmm(F.silu(gate) * up, self.down)  # [E, T, H]
        y = (ys * scores.t().unsqueeze(-1)).sum(0)  # [T, H]
        logits = self.head(self.norm(x + y))
        return F.cross_entropy(logits, labels.flatten())


def test_bmm_with_the_experts_as_its_batch_dim_splits_like_a_dense_mlp_per_expert():
    from simulate import train_side_by_side

    captured = capture(FakeTemplate(StackedExperts(), torch.device("cpu")), _inputs(), {})
    found = {lm.weight_name: lm for lm in find_linears(captured).values() if lm.per_group}
    assert (found["gate_up"].out_dim, found["gate_up"].weight_in_dim) == (2, 1)
    placements = parameter_placements(analyze(captured, 2), 2)
    assert placements["gate_up"].spec == DimShard(2, ((0, I), (I, I)))
    assert placements["down"].spec == DimShard(1, ((0, I),))
    train_side_by_side(StackedExperts, _inputs(), tp=2, sp=False, steps=2, rtol=1e-4, atol=1e-5)


class SelectedExperts(nn.Module):
    """Expert ``e``'s weight as the slice ``W[e]`` of a 3-D parameter, in both storage layouts
    (JetMoE's ``F.linear(rows, W[e])``; ``rows @ W[e]``), and a slice along another dim that is
    no expert's weight."""

    def __init__(self):
        super().__init__()
        self.out_in = nn.Parameter(torch.randn(3, 12, 8))
        self.in_out = nn.Parameter(torch.randn(3, 8, 12))
        self.across = nn.Parameter(torch.randn(12, 3, 8))

    def forward(self, x):  # x: [4, 8]
        return F.linear(x, self.out_in[1]) + x @ self.in_out[2] + F.linear(x, self.across[:, 0])


def test_a_slice_of_a_3d_parameter_by_expert_is_a_linear_per_expert():
    captured = capture(FakeTemplate(SelectedExperts(), torch.device("cpu")), (torch.randn(4, 8),), {})
    by_weight = {m.weight_name: m for m in find_linears(captured).values()}
    assert set(by_weight) == {"out_in", "in_out"}  # W[:, 0] selects along another dim: no expert
    out_in, in_out = by_weight["out_in"], by_weight["in_out"]
    assert (out_in.out_dim, out_in.weight_in_dim, out_in.per_group) == (1, 2, True)
    assert (in_out.out_dim, in_out.weight_in_dim, in_out.per_group) == (2, 1, True)
    assert (out_in.in_features, out_in.out_features) == (in_out.in_features, in_out.out_features) == (8, 12)
