"""Expert regions found from dataflow (``graph.experts``), on small MoE layers written here (not
transformers'): which nodes hold owned rows, which partial sums, what is exchanged, where the
region ends, and what keeps a region from being split."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest

from sptransform.capture import FakeTemplate, capture
from sptransform.graph.experts import OWNED, PARTIAL, PLAIN, data_nodes, find_expert_regions, is_zero, rowwise

aten = torch.ops.aten


class RoutedMLP(nn.Module):
    """Top-k routing; each token-expert pair gathers its expert's weights (``w[idx]``) and applies them by ``bmm``."""

    def __init__(self, experts=4, hidden=8, inner=16, k=2, dropout=0.0, inplace_sum=False, shared=False):
        super().__init__()
        self.k, self.hidden, self.inplace_sum = k, hidden, inplace_sum
        self.router = nn.Linear(hidden, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, inner, hidden) / hidden ** 0.5)
        self.up_bias = nn.Parameter(torch.randn(experts, inner) / 10)
        self.down = nn.Parameter(torch.randn(experts, hidden, inner) / inner ** 0.5)
        self.dropout = nn.Dropout(dropout)
        self.shared = nn.Linear(hidden, hidden) if shared else None

    def forward(self, x):
        h = x.reshape(-1, self.hidden)
        weights, idx = torch.topk(self.router(h).softmax(-1), self.k)
        flat = idx.reshape(-1)
        pairs = h.repeat_interleave(self.k, 0)
        a = torch.bmm(self.up[flat], pairs.unsqueeze(-1)).squeeze(-1) + self.up_bias[flat]
        a = self.dropout(F.gelu(a))
        y = torch.bmm(self.down[flat], a.unsqueeze(-1)).squeeze(-1) * weights.reshape(-1, 1)
        if self.inplace_sum:
            out = torch.zeros_like(h)
            out.index_add_(0, torch.arange(h.shape[0]).repeat_interleave(self.k), y)
        else:
            out = y.view(-1, self.k, self.hidden).sum(1)
        if self.shared is not None:
            out = out + self.shared(h)
        return x + out.view_as(x)


def _regions(model, x=None):
    x = torch.randn(2, 6, 8) if x is None else x
    captured = capture(FakeTemplate(model, torch.device("cpu")), (x,), {})
    state = dict(zip(captured.state_placeholders, captured.state_names))
    params = {node: name for node, name in state.items() if name in captured.param_names}
    gm = captured.gm
    return gm, params, *find_expert_regions(gm, params, data_nodes(gm, captured.user_placeholders))


def _by_target(nodes, target):
    return [n for n in nodes if n.target == target]


def test_a_routed_mlp_is_one_region_from_the_gathers_to_the_sum_over_the_chosen_experts():
    gm, params, regions, problems = _regions(RoutedMLP().eval())
    assert problems == []
    (region,) = regions
    assert sorted(params[p] for p in region.seeds.values()) == ["down", "up", "up_bias"]
    # everything computed per pair is owned: both bmm, the bias add, the activation, the routing weight
    for node in (*_by_target(region.nodes, aten.bmm.default), *_by_target(region.nodes, aten.gelu.default)):
        assert region.state[node] == OWNED, node
    # the view to [T, k, H] mixes the pairs' dim with another: from there the sum over ranks is kept
    (view,) = [n for n in region.nodes if n.target == aten.view.default and region.state[n] == PARTIAL]
    (summed,) = _by_target(region.nodes, aten.sum.dim_IntList)
    assert region.state[summed] == PARTIAL
    assert view.args[0] in region.masked  # the masked owned tensor that turned partial
    # the residual add is not linear in the experts' sum: the region ends before it
    (output,) = region.outputs
    assert output.target == aten.view_as.default and region.state[output] == PARTIAL
    assert [u.target for u in output.users] == [aten.add.Tensor]


def test_the_tokens_are_exchanged_before_their_copies_per_chosen_expert():
    gm, params, regions, _ = _regions(RoutedMLP().eval())
    (region,) = regions
    (repeat,) = [n for n in gm.graph.nodes if n.target == aten.repeat_interleave.self_int]
    assert region.state[repeat] == PLAIN  # pulled in: each rank repeats the tokens it receives
    shapes = sorted(tuple(n.meta["val"].shape) for n in region.inputs)
    # the tokens [T, H] (not the [T * k, H] copies), the routing indices and weights [T, k]
    assert shapes == [(12, 2), (12, 2), (12, 8)], shapes
    assert all(n.op == "placeholder" for n in region.shared)  # parameters only: the same on every rank


def test_a_shared_expert_beside_the_routed_ones_stays_outside_and_the_region_ends_at_the_add():
    gm, params, regions, problems = _regions(RoutedMLP(shared=True).eval())
    assert problems == []
    (region,) = regions
    assert all(params.get(p) != "shared.weight" for p in region.shared)
    (output,) = region.outputs  # the routed sum: the add of the shared expert's output is not linear in it
    assert output.target == aten.sum.dim_IntList
    assert any(u.target == aten.add.Tensor for u in output.users)


def test_dropout_inside_the_experts_is_a_problem_named_by_node():
    _, _, _, problems = _regions(RoutedMLP(dropout=0.5).train())
    assert len(problems) == 1 and "draws random numbers inside the experts" in problems[0]


def test_an_in_place_sum_into_zeros_reads_the_pairs_summed_over_the_ranks():
    gm, _, regions, problems = _regions(RoutedMLP(inplace_sum=True).eval())
    assert problems == []
    (region,) = regions
    (output,) = region.outputs  # index_add_ is not one of the region's ops: it reads the weighted pairs
    assert output.target == aten.mul.Tensor and output in region.masked
    assert [u.target for u in output.users] == [aten.index_add_.default]


def test_an_in_place_write_into_the_experts_values_from_outside_is_a_problem():
    class Cumulative(RoutedMLP):
        def forward(self, x):
            h = x.reshape(-1, self.hidden)
            _, idx = torch.topk(self.router(h), self.k)
            y = torch.bmm(self.down[idx.reshape(-1)], torch.ones(12 * self.k, 16, 1)).squeeze(-1)
            y.cumsum_(0)  # mixes the pairs, in place
            return y.sum()

    _, _, _, problems = _regions(Cumulative().eval())
    assert len(problems) == 1 and "writes in place into a tensor of the experts' computation" in problems[0], problems


@pytest.mark.parametrize("layer, weight", [("gathered", "up"), ("grouped", "down"), ("dense", "down")])
def test_a_parameter_read_other_than_by_routing_gathers_or_grouped_matmuls_is_not_an_expert(layer, weight):
    if layer == "grouped":
        pytest.importorskip("transformers.integrations.moe")
    base = {"gathered": RoutedMLP, "grouped": GroupedMLP, "dense": DenseMLP}[layer]

    class Mixed(base):
        def forward(self, x):
            return super().forward(x) + getattr(self, weight).sum()

    _, params, regions, _ = _regions(Mixed().eval())
    (region,) = regions
    assert weight not in {params[p] for p in region.seeds.values()}


def test_rowwise_needs_the_pairs_dims_kept_first():
    gm, params, regions, _ = _regions(RoutedMLP().eval())
    (region,) = regions
    owned = {n for n, s in region.state.items() if s == OWNED}
    unsqueezed = [n for n in region.nodes if n.target == aten.unsqueeze.default and n.args[0] in owned]
    assert unsqueezed and all(rowwise(n, owned, 1) for n in unsqueezed)
    view = next(n for n in region.nodes if n.target == aten.view.default and region.state[n] == PARTIAL)
    assert not rowwise(view, owned | {view.args[0]}, 1)  # [T * k, H] -> [T, k, H]: rows regrouped


def test_zero_makers_are_recognised():
    gm, _, _, _ = _regions(RoutedMLP(inplace_sum=True).eval())
    zeros = [n for n in gm.graph.nodes if n.target in (aten.zeros_like.default, aten.zeros.default)]
    assert zeros and all(is_zero(n) for n in zeros)


def test_expert_tensors_of_different_expert_counts_under_one_routing_are_a_problem():
    class Uneven(RoutedMLP):
        def __init__(self):
            super().__init__()
            self.down = nn.Parameter(torch.randn(6, 8, 16))  # 6 "experts", routed by indices of 4

    _, _, _, problems = _regions(Uneven().eval())
    assert len(problems) == 1 and "different numbers of experts [4, 6]" in problems[0], problems


def _collective_stub(x):
    """Stands for a call an earlier pass emitted (a tensor-parallel all-reduce): opaque to the op schemas."""
    return x.clone()


def test_calls_an_earlier_pass_emitted_stay_inside_where_the_pass_says_they_keep_the_rows():
    captured = capture(FakeTemplate(RoutedMLP().eval(), torch.device("cpu")), (torch.randn(2, 6, 8),), {})
    state = dict(zip(captured.state_placeholders, captured.state_names))
    params = {node: name for node, name in state.items() if name in captured.param_names}
    gm = captured.gm
    down = [n for n in gm.graph.nodes if n.target == aten.bmm.default][-1]
    with gm.graph.inserting_after(down):
        stub = gm.graph.call_function(_collective_stub, (down,))
    down.replace_all_uses_with(stub, delete_user_cb=lambda user: user is not stub)
    gm.recompile()
    data = data_nodes(gm, captured.user_placeholders)

    # unknown: the region ends at the down projection, the call reads its rows summed over the ranks
    (region,), problems = find_expert_regions(gm, params, data)
    assert problems == [] and stub not in region.state and down in region.masked
    # an all-reduce over ranks holding the same rows: linear and row by row, so owned like its input
    (region,), problems = find_expert_regions(gm, params, data, emitted=lambda n: () if n is stub else None)
    assert problems == [] and region.state[stub] == OWNED and down not in region.masked
    # a cut along the pairs' own dim does not keep each row: it stays outside
    (region,), problems = find_expert_regions(gm, params, data, emitted=lambda n: (0,) if n is stub else None)
    assert stub not in region.state


class GroupedMLP(nn.Module):
    """Top-k routing with the pairs sorted by expert, each projection one grouped matmul (transformers'
    op, offsets from a histogram of the sorted ids), the up projection's biases gathered by those ids."""

    def __init__(self, experts=4, hidden=8, inner=16, k=2, bias=True):
        super().__init__()
        from transformers.integrations import moe  # noqa: F401  (registers transformers' grouped matmul op)

        self.k, self.hidden, self.experts = k, hidden, experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, inner, hidden) / hidden ** 0.5)  # [E, out, in]: read transposed
        self.up_bias = nn.Parameter(torch.randn(experts, inner) / 10) if bias else None
        self.down = nn.Parameter(torch.randn(experts, inner, hidden) / inner ** 0.5)  # [E, in, out]

    def forward(self, x):
        h = x.reshape(-1, self.hidden)
        weights, idx = torch.topk(self.router(h).softmax(-1), self.k)
        ids, order = idx.reshape(-1).sort()
        offs = torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1).cumsum(0).to(torch.int32)
        a = torch.ops.transformers.grouped_mm_fallback(h[order // self.k], self.up.transpose(-2, -1), offs)
        if self.up_bias is not None:
            a = a + self.up_bias[ids]
        y = torch.ops.transformers.grouped_mm_fallback(F.gelu(a), self.down, offs)
        y = y[order.argsort()] * weights.reshape(-1, 1)
        return x + y.view(-1, self.k, self.hidden).sum(1).view_as(x)


def test_grouped_matmuls_of_the_sorted_pairs_are_one_region_with_the_biases_gathered_by_the_sorted_ids():
    pytest.importorskip("transformers.integrations.moe")
    gm, params, regions, problems = _regions(GroupedMLP().eval())
    assert problems == []
    (region,) = regions  # the grouped matmuls (rows by offsets) and the bias gather (rows by ids): merged
    assert sorted(params[p] for p in region.seeds.values()) == ["down", "up", "up_bias"]
    grouped = [n for n in region.seeds if n.target.name() == "transformers::grouped_mm_fallback"]
    assert len(grouped) == 2 and all(region.state[n] == OWNED for n in grouped)
    # the pairs are put back in order by a gather of rows: not row by row, so from there partial
    (back,) = [n for n in region.nodes if n.target == aten.index.Tensor and n not in region.seeds
               and region.state[n] == PARTIAL]
    assert back.args[0] in region.masked
    (output,) = region.outputs
    assert region.state[output] == PARTIAL and [u.target for u in output.users] == [aten.add.Tensor]


def test_the_tokens_are_exchanged_not_the_sorted_copies_per_chosen_expert():
    pytest.importorskip("transformers.integrations.moe")
    gm, params, regions, _ = _regions(GroupedMLP(bias=False).eval())
    (region,) = regions
    (copies,) = [n for n in gm.graph.nodes if n.target == aten.index.Tensor and n.args[0].target == aten.reshape.default]
    assert region.state[copies] == PLAIN  # h[order // k] is computed on each rank from what it receives
    shapes = sorted(tuple(n.meta["val"].shape) for n in region.inputs)
    # the tokens [T, H], the sort's permutation and the routing weights [T * k], the counts per expert [E]
    assert (12, 8) in shapes and (12 * 2, 8) not in shapes, shapes


def test_a_grouped_matmul_of_some_of_the_experts_is_not_split_by_expert():
    pytest.importorskip("transformers.integrations.moe")

    class Halved(GroupedMLP):  # a grouped matmul of the first 2 of the 4 experts: dim 0 is no longer E
        def forward(self, x):
            h = x.reshape(-1, self.hidden)
            offs = torch.tensor([6, 12], dtype=torch.int32)
            return torch.ops.transformers.grouped_mm_fallback(h, self.down.transpose(-2, -1)[:2], offs).sum()

    _, _, regions, problems = _regions(Halved(bias=False).eval())
    assert regions == [] and problems == []


class DenseMLP(nn.Module):
    """Every expert on every token, as Llama 4 writes it: the tokens repeated per expert and scaled
    by a dense routing matrix (zero for experts not chosen), ``[E, T, H]`` through ``bmm``."""

    def __init__(self, experts=4, hidden=8, inner=16, k=2):
        super().__init__()
        self.k, self.hidden, self.experts = k, hidden, experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, hidden, 2 * inner) / hidden ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, inner, hidden) / inner ** 0.5)

    def forward(self, x):
        h = x.reshape(-1, self.hidden)
        logits = self.router(h)
        top, idx = torch.topk(logits, self.k, dim=1)
        scores = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter(1, idx, top))
        routed = h.repeat(self.experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
        gate, up = torch.bmm(routed.view(self.experts, -1, self.hidden), self.gate_up).chunk(2, dim=-1)
        y = torch.bmm(up * F.silu(gate), self.down).view(-1, self.hidden)
        return x + y.reshape(self.experts, -1, self.hidden).sum(0).view_as(x)


def test_every_expert_on_every_token_is_one_region_whose_tokens_are_exchanged_not_their_copies():
    gm, params, regions, problems = _regions(DenseMLP().eval())
    assert problems == []
    (region,) = regions  # the two batched matmuls: the second reads the first's rows
    assert sorted(params[p] for p in region.seeds.values()) == ["down", "gate_up"]
    assert all(region.state[n] == OWNED for n in region.seeds)
    (output,) = region.outputs  # the sum over the experts, read by the residual add
    assert region.state[output] == PARTIAL and [u.target for u in output.users] == [aten.add.Tensor]
    (repeat,) = _by_target(gm.graph.nodes, aten.repeat.default)
    assert region.state[repeat] == PLAIN  # computed on each rank from the tokens it receives
    shapes = sorted(tuple(n.meta["val"].shape) for n in region.inputs)
    assert shapes == [(12, 4), (12, 8)], shapes  # the routing scores [T, E] and the tokens [T, H]


def test_a_batched_matmul_of_some_of_the_experts_is_not_split_by_expert():
    class Halved(DenseMLP):
        def forward(self, x):
            h = x.reshape(-1, self.hidden).expand(2, -1, -1)
            return torch.bmm(h, self.gate_up[:2]).sum()

    _, _, regions, problems = _regions(Halved().eval())
    assert regions == [] and problems == []


class EinsumMLP(DenseMLP):
    """``DenseMLP`` with each projection an ``einsum`` batched over the experts."""

    def forward(self, x):
        h = x.reshape(-1, self.hidden)
        scores = torch.sigmoid(self.router(h))
        routed = h.unsqueeze(0).expand(self.experts, -1, -1)
        gate, up = torch.einsum("eth,ehi->eti", routed, self.gate_up).chunk(2, dim=-1)
        y = torch.einsum("eti,eih->eth", up * F.silu(gate), self.down)
        return x + torch.einsum("eth,te->th", y, scores).view_as(x)


def test_an_einsum_batched_over_the_experts_is_a_seed_and_one_not_batched_over_them_is_not():
    _, params, regions, problems = _regions(EinsumMLP().eval())
    assert problems == []
    (region,) = regions
    assert sorted(params[p] for p in region.seeds.values()) == ["down", "gate_up"]

    class Contracted(EinsumMLP):  # the experts summed inside the einsum: no row per expert
        def forward(self, x):
            h = x.reshape(-1, self.hidden)
            return torch.einsum("th,ehi->ti", h, self.gate_up).sum()

    _, _, regions, problems = _regions(Contracted().eval())
    assert regions == [] and problems == []


def test_routed_experts_beside_stacked_shared_experts_are_two_regions_summed_before_their_add():
    class WithShared(RoutedMLP):  # shared experts stacked and run on every token by a bmm (Inkling's)
        def __init__(self):
            super().__init__()
            self.shared_up = nn.Parameter(torch.randn(2, 8, 16) / 8 ** 0.5)

        def forward(self, x):
            h = x.reshape(-1, self.hidden)
            weights, idx = torch.topk(self.router(h).softmax(-1), self.k)
            flat = idx.reshape(-1)
            pairs = h.repeat_interleave(self.k, 0)
            a = F.gelu(torch.bmm(self.up[flat], pairs.unsqueeze(-1)).squeeze(-1) + self.up_bias[flat])
            y = torch.bmm(self.down[flat], a.unsqueeze(-1)).squeeze(-1) * weights.reshape(-1, 1)
            routed = y.view(-1, self.k, self.hidden).sum(1)
            stacked = h.unsqueeze(0).expand(2, -1, -1)
            shared = torch.bmm(F.gelu(torch.bmm(stacked, self.shared_up)), self.shared_up.transpose(1, 2)).sum(0)
            return x + (routed + shared).view_as(x)  # the two regions' partial sums meet in one add

    gm, params, regions, problems = _regions(WithShared().eval())
    assert problems == []
    assert sorted(sorted({params[p] for p in r.seeds.values()}) for r in regions) == [["down", "up", "up_bias"],
                                                                                     ["shared_up"]]
    (mixed,) = [n for n in gm.graph.nodes if n.target == aten.add.Tensor
                and {a for a in n.all_input_nodes if any(a in r.outputs for r in regions)} == set(n.all_input_nodes)]
    assert all(mixed not in r.state for r in regions)  # outside both: each region's sum is taken first


def test_a_bias_per_expert_added_by_broadcasting_is_split_with_the_experts_unless_read_elsewhere():
    class Biased(DenseMLP):
        def __init__(self, elsewhere=False):
            super().__init__()
            self.elsewhere = elsewhere
            self.bias = nn.Parameter(torch.randn(self.experts, 2 * 16) / 10)

        def forward(self, x):
            h = x.reshape(-1, self.hidden)
            routed = h.unsqueeze(0).expand(self.experts, -1, -1)
            gate, up = (torch.bmm(routed, self.gate_up) + self.bias[:, None, :]).chunk(2, dim=-1)
            y = torch.bmm(up * F.silu(gate), self.down).sum(0)
            return (x + y.view_as(x)).sum() + (self.bias.sum() if self.elsewhere else 0)

    _, params, (region,), problems = _regions(Biased().eval())
    assert problems == [] and [params[p] for p in region.padded] == ["bias"]
    _, params, (region,), problems = _regions(Biased(elsewhere=True).eval())
    assert problems == [] and region.padded == []
