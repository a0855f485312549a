"""The tensor-parallel pass on small hand-built graphs: the finders (which local rewrite a
placement asks for, which redistributions readers need) apart from the rewrite, then the
rewrite itself (collectives inserted, size arguments made local, the shape safety net)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sptransform.capture import FakeTemplate, capture
from sptransform.graph.analysis import constant_nodes
from sptransform.graph.gradients import gradient_plan
from sptransform.graph.plan import ParallelPlan
from sptransform.graph.propagate import SequenceSplit, propagate
from sptransform.graph.placement import DimShard, whole
from sptransform.graph.rules import ShardingError
from sptransform.passes.canonicalize import remove_dead_code
from sptransform.passes.tensor_parallel import (
    add_rank_input, apply_placements, check_local_shapes, find_local_rewrite, find_redistributions,
)
from sptransform.runtime.collectives import reduce_from_tp, scatter_seq

aten = torch.ops.aten
COLUMN_ROW = {"up.weight": whole(0, 16), "down.weight": whole(1, 16)}


def _placed(module: nn.Module, args: tuple, seeds: dict[str, object], *, seq: int | None = None):
    """``module`` captured and its placements propagated from ``seeds`` (FQN -> split) at tp=2."""
    captured = capture(FakeTemplate(module, torch.device("cpu")), args, {})
    remove_dead_code(captured.gm)
    params = dict(zip(captured.state_placeholders, captured.state_names))
    by_name = {name: node for node, name in params.items()}
    constant = constant_nodes(captured.gm, set(params))
    prop = propagate(captured.gm, {by_name[k]: v for k, v in seeds.items()}, tp=2, constant=constant,
                     sequence=SequenceSplit(seq) if seq else None)
    return captured, params, constant, prop


def _ops(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


class MLP(nn.Module):
    def __init__(self, heads_view: bool = False):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)
        self.heads_view = heads_view

    def forward(self, x):  # x: [2, 4, 8]
        h = self.up(x)
        if self.heads_view:  # [2, 4, 16] -> [2, 4, 2, 8]: a size argument that must go local
            h = h.view(2, 4, 2, 8).relu().view(2, 4, 16)
        return self.down(F.gelu(h))


class TwoReaders(MLP):
    def forward(self, x):
        y = super().forward(x)
        return y.sin(), y.cos()


class Residual(MLP):
    def forward(self, x):
        return x + super().forward(x)


class FusedPieces(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)  # [a|b] side by side
        self.down = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        h = self.up(x)
        return self.down(h[..., :8] * h[..., 8:].sigmoid())


class VocabLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10, bias=False)

    def forward(self, ids):
        return F.cross_entropy(self.head(self.tok(ids)).view(-1, 10), ids.view(-1))


X = (torch.randn(2, 4, 8),)


# ---------------------------------------------------------------------------
# finding


def test_a_column_then_row_mlp_needs_one_all_reduce_of_its_partial_sum():
    captured, _, _, prop = _placed(MLP(), X, COLUMN_ROW)
    (r,) = find_redistributions(prop)
    assert r.kind == "all_reduce" and r.node.target is aten.linear.default and r.want != r.have
    assert [u.op for u in r.readers] == ["output"]


def test_readers_wanting_the_same_placement_share_one_redistribution():
    _, _, _, prop = _placed(TwoReaders(), X, COLUMN_ROW)
    (r,) = find_redistributions(prop)
    assert {u.target for u in r.readers} == {aten.sin.default, aten.cos.default}


def test_sequence_parallel_reduce_scatters_the_partial_sum_of_a_residual_block():
    _, _, _, prop = _placed(Residual(), X, COLUMN_ROW, seq=4)
    kinds = sorted(r.kind for r in find_redistributions(prop))
    assert "reduce_scatter" in kinds and "all_reduce" not in kinds


def test_split_outputs_get_local_sizes_and_replicated_ones_nothing():
    captured, _, _, prop = _placed(MLP(heads_view=True), X, COLUMN_ROW)
    kinds = {n.target: find_local_rewrite(n, prop) for n in captured.gm.graph.nodes if n.op == "call_function"}
    assert kinds[aten.view.default] == "local_sizes" and kinds[aten.gelu.default] == "local_sizes"
    down = _ops(captured.gm, aten.linear.default)[-1]
    assert find_local_rewrite(down, prop) is None  # a partial sum: nothing to make local


def test_a_slice_along_the_split_dim_of_a_fused_output_is_a_fused_slice():
    seeds = {"up.weight": DimShard(0, ((0, 8), (8, 8))), "down.weight": whole(1, 8)}
    captured, _, _, prop = _placed(FusedPieces(), X, seeds)
    slices = _ops(captured.gm, aten.slice.Tensor)
    assert slices and all(find_local_rewrite(n, prop) == "fused_slice" for n in slices)


def test_a_split_vocabulary_makes_a_vocab_parallel_embedding_and_loss():
    ids = (torch.randint(0, 10, (2, 4)),)
    captured, _, _, prop = _placed(VocabLM(), ids, {"tok.weight": whole(0, 10), "head.weight": whole(0, 10)})
    (embedding,) = _ops(captured.gm, aten.embedding.default)
    (loss,) = _ops(captured.gm, aten.cross_entropy_loss.default)
    assert find_local_rewrite(embedding, prop) == "vocab_embedding"
    assert find_local_rewrite(loss, prop) == "vocab_loss"


# ---------------------------------------------------------------------------
# rewriting


def _rewritten(module, seeds, *, seq=None, sp=False):
    captured, params, constant, prop = _placed(module, X, seeds, seq=seq)
    gm = captured.gm
    grads = gradient_plan(gm, prop, params=set(params), constant=constant, inputs=set())
    plan = ParallelPlan(tp=2, sp=sp, group="tp", rank=add_rank_input(gm), static_rank=0, seq_len=seq, overlap=False)
    return apply_placements(gm, prop, grads, plan, params=params, layer_rows=[]), plan


def test_the_rank_input_is_the_last_placeholder():
    captured = capture(FakeTemplate(MLP(), torch.device("cpu")), X, {})
    rank = add_rank_input(captured.gm)
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[-1] is rank and rank.meta["val"] is None


def test_the_rewrite_reduces_the_partial_sum_once_and_marks_split_nodes():
    gm, _ = _rewritten(TwoReaders(), COLUMN_ROW)
    (reduce,) = _ops(gm, reduce_from_tp)
    assert {u.target for u in reduce.users} == {aten.sin.default, aten.cos.default}
    split = [n for n in gm.graph.nodes if isinstance(n.meta.get("sptransform_spec"), DimShard)]
    assert split  # the rank-local view sizes were written with their split


def test_the_rewrite_makes_view_sizes_local():
    gm, _ = _rewritten(MLP(heads_view=True), COLUMN_ROW)
    sizes = [list(n.args[1]) for n in _ops(gm, aten.view.default)]
    assert sizes == [[2, 4, 1, 8], [2, 4, 8]]  # 2 heads over 2 ranks; 16 features over 2 ranks


def test_sequence_parallel_rewrite_reduce_scatters_along_the_sequence_dim():
    gm, _ = _rewritten(Residual(), COLUMN_ROW, seq=4, sp=True)
    (scatter,) = _ops(gm, scatter_seq)
    assert scatter.args[1] == 1


def test_the_shape_check_names_an_op_left_with_global_sizes():
    captured, params, _, prop = _placed(MLP(heads_view=True), X, COLUMN_ROW)
    gm = captured.gm
    plan = ParallelPlan(tp=2, sp=False, group="tp", rank=add_rank_input(gm))
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    with pytest.raises(ShardingError, match="view"):
        check_local_shapes(gm, prop, ops, plan)  # nothing was localized


def test_bucketed_parameter_gradients_read_through_getitem():
    class Normed(MLP):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(x + super().forward(x))

    gm, plan = _rewritten(Normed(), COLUMN_ROW, seq=4, sp=True)
    assert set(plan.sync_params) == {"norm.weight", "norm.bias"}
    assert _ops(gm, operator.getitem)


class RoutedRows(MLP):
    """One expert of Mixtral's reference loop: the rows ``torch.where`` picks (a count known only
    at run time, ``u0``), an MLP on them with a heads-like view, ``index_add`` back."""

    def __init__(self):
        super().__init__(heads_view=True)
        self.gate = nn.Linear(8, 4, bias=False)

    def forward(self, x):  # x: [8, 8]
        idx = torch.where(self.gate(x).argmax(-1) == 0)[0]
        h = self.up(x[idx])
        h = h.view(-1, 2, 8).relu().view(-1, 16)  # the view's rows are the run-time count
        return torch.zeros_like(x).index_add(0, idx, self.down(h))


def test_the_shape_check_covers_ops_on_rows_known_only_at_run_time():
    """Split along their static dims, ops on routed rows get the same safety net as the others:
    run on stand-in sizes for the run-time count, a view left with its global sizes is named."""
    from sptransform.graph.nodes import routes, unbacked_dims

    captured, _, _, prop = _placed(RoutedRows(), (torch.randn(8, 8),), COLUMN_ROW)
    gm = captured.gm
    views = _ops(gm, aten.view.default)
    assert views and all(unbacked_dims(v) == {0} and not routes(v) for v in views)
    assert all(prop.placement[v].dim == 1 for v in views)  # the heads dim, never the rows
    plan = ParallelPlan(tp=2, sp=False, group="tp", rank=add_rank_input(gm))
    with pytest.raises(ShardingError, match="view"):
        check_local_shapes(gm, prop, [n for n in gm.graph.nodes if n.op == "call_function"], plan)
