"""Placement propagation and gradient reductions on small hand-built graphs, one op family at a
time: the placements each rule gives, the redistributions they imply, and where gradients of
replicated tensors arrive partial."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sptransform.capture import FakeTemplate, capture
from sptransform.graph.analysis import constant_nodes
from sptransform.graph.gradients import gradient_plan
from sptransform.graph.placement import PARTIAL, REPLICATED, DimShard, whole
from sptransform.graph.propagate import SequenceSplit, move_kind, propagate
from sptransform.passes.canonicalize import remove_dead_code, split_bias


def _graph(module: nn.Module, *args):
    captured = capture(FakeTemplate(module, torch.device("cpu")), args, {})
    remove_dead_code(captured.gm)
    params = {node: name for node, name in zip(captured.state_placeholders, captured.state_names)}
    return captured, params


def _run(module, args, seeds: dict[str, object], *, tp=2, seq=None, split_biases=()):
    captured, params = _graph(module, *args)
    gm = captured.gm
    by_name = {name: node for node, name in params.items()}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and any(a in {by_name[n] for n in split_biases} for a in node.all_input_nodes):
            split_bias(gm, node)
    seeded = {by_name[name]: placement for name, placement in seeds.items()}
    constant = constant_nodes(gm, set(params))
    prop = propagate(gm, seeded, tp=tp, constant=constant, sequence=SequenceSplit(seq) if seq else None)
    grads = gradient_plan(gm, prop, params=set(params), constant=constant, inputs=set())
    return gm, prop, grads, by_name


def _node(gm, op):
    return next(n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "overloadpacket", None) is op)


def _moves(prop):
    return sorted((move_kind(have, want), node.name) for node, _, have, want in prop.changes())


class MLP(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=bias)
        self.down = nn.Linear(16, 8, bias=bias)

    def forward(self, x):  # x: [b, s, 8]
        return self.down(F.gelu(self.up(x)))


aten = torch.ops.aten


def test_column_then_row_linear_gives_split_features_then_a_partial_sum():
    gm, prop, _, _ = _run(MLP(), (torch.randn(2, 4, 8),), {"up.weight": whole(0, 16), "down.weight": whole(1, 16)})
    up, down = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.linear.default]
    assert prop.placement[up] == whole(2, 16)
    assert prop.placement[_node(gm, aten.gelu)] == whole(2, 16)
    assert prop.placement[down] == PARTIAL
    assert _moves(prop) == [("all_reduce", down.name)]  # the output is reduced for the user


def test_sequence_parallel_reduce_scatters_the_partial_sum_and_gathers_into_the_block():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.mlp = MLP()

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    gm, prop, grads, names = _run(Block(), (torch.randn(2, 4, 8),),
                                  {"mlp.up.weight": whole(0, 16), "mlp.down.weight": whole(1, 16)}, seq=4)
    norm = _node(gm, aten.layer_norm)
    add = _node(gm, aten.add)
    # the residual input is replicated (a user input); the partial sum is reduce-scattered and
    # the input cut to the same sequence split, so the stream stays split
    assert prop.placement[add] == whole(1, 4)
    moves = _moves(prop)
    assert ("reduce_scatter", prop.reads[add] and next(n.name for n in add.all_input_nodes if prop.placement[n] == PARTIAL)) in moves
    assert prop.placement[norm] == REPLICATED  # it reads the replicated input: no split to keep
    assert names["norm.weight"] not in grads.partial_params


def test_a_norm_weight_on_a_sequence_split_activation_gets_a_partial_gradient():
    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.mlp = MLP()

        def forward(self, x):  # mlp output (partial) -> reduce-scatter -> norm on the split
            return self.norm(x + self.mlp(x))

    gm, prop, grads, names = _run(Norm(), (torch.randn(2, 4, 8),),
                                  {"mlp.up.weight": whole(0, 16), "mlp.down.weight": whole(1, 16)}, seq=4)
    assert prop.placement[_node(gm, aten.layer_norm)] == whole(1, 4)
    assert {names["norm.weight"], names["norm.bias"]} <= set(grads.partial_params)


def test_a_weight_reaching_the_split_through_casts_and_adds_is_still_summed():
    """Gemma's ``x * (1 + w.float())``: the parameter meets the split activation only after an
    add and a cast, and its gradient is partial all the same."""

    class OnePlus(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8))
            self.mlp = MLP()

        def forward(self, x):
            h = x + self.mlp(x)
            return h * (1.0 + self.w.float()).to(h.dtype)

    gm, prop, grads, names = _run(OnePlus(), (torch.randn(2, 4, 8),),
                                  {"mlp.up.weight": whole(0, 16), "mlp.down.weight": whole(1, 16)}, seq=4)
    assert names["w"] in grads.partial_params


def test_a_weight_read_both_split_and_whole_gets_an_f_not_a_bucket():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))
            self.mlp = MLP()

        def forward(self, x):
            h = x + self.mlp(x)  # split along the sequence
            return (h * self.w).sum() + (x * self.w).sum()  # x is replicated: a full gradient

    gm, prop, grads, names = _run(Mixed(), (torch.randn(2, 4, 8),),
                                  {"mlp.up.weight": whole(0, 16), "mlp.down.weight": whole(1, 16)}, seq=4)
    w = names["w"]
    assert w not in grads.partial_params and w in grads.f_edges


def test_a_fused_weight_split_into_a_sequence_split_part_and_a_whole_part_sums_the_split_part():
    """``nn.MultiheadAttention`` as cross-attention: ``in_proj_weight.split([E, 2E])``, q read by the
    sequence-split stream (a partial gradient), kv by a whole memory (full). The partial part must
    be summed before it joins the full one (it was left unsummed: 0.5x the q rows' gradient)."""

    class FusedCross(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(24, 8))
            self.mlp = MLP()

        def forward(self, x, memory):
            h = x + self.mlp(x)  # split along the sequence
            w_q, w_kv = self.w.split([8, 16])
            return (h @ w_q.t()).sum() + (memory @ w_kv.t()).sum()

    gm, prop, grads, names = _run(FusedCross(), (torch.randn(2, 4, 8), torch.randn(2, 6, 8)),
                                  {"mlp.up.weight": whole(0, 16), "mlp.down.weight": whole(1, 16)}, seq=4)
    w = names["w"]
    assert w not in grads.partial_params  # not bucketed as a whole: the kv part is full
    split = next(n for n in gm.graph.nodes if n.op == "call_function" and w in n.all_input_nodes)
    q, kv = sorted((u for u in split.users), key=lambda u: u.args[1])
    assert q in grads.f_edges and kv not in grads.f_edges


def test_unbind_moves_a_split_below_the_removed_dim_down_by_one():
    """timm's attention: ``qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)`` with the
    heads split: the heads sit on dim 2 of the stacked tensor and on dim 1 of q, k and v (the rule
    kept dim 2, and the model was refused with a size mismatch)."""

    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(x).reshape(2, 4, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
            return q * k + v

    gm, prop, grads, names = _run(Fused(), (torch.randn(2, 4, 8),),
                                  {"qkv.weight": DimShard(0, ((0, 8), (8, 8), (16, 8)))})
    unbind = _node(gm, aten.unbind)
    assert prop.placement[unbind] == (DimShard(1, ((0, 2),)),) * 3
    assert prop.placement[_node(gm, aten.add)].dim == 1


def test_without_sequence_parallelism_the_block_input_gets_an_f():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.mlp = MLP()

        def forward(self, x):
            return self.mlp(self.norm(x))

    gm, prop, grads, _ = _run(Block(), (torch.randn(2, 4, 8, requires_grad=True),),
                              {"mlp.up.weight": whole(0, 16), "mlp.down.weight": whole(1, 16)})
    norm = _node(gm, aten.layer_norm)
    assert list(grads.f_edges) == [norm]  # Megatron's f: the column linear sends back a partial sum


def test_a_gather_whose_readers_all_send_partial_sums_reduce_scatters_in_backward():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = MLP(), MLP()
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            h = x + self.a(x)
            return self.b(self.norm(h))

    seeds = {"a.up.weight": whole(0, 16), "a.down.weight": whole(1, 16),
             "b.up.weight": whole(0, 16), "b.down.weight": whole(1, 16)}
    gm, prop, grads, _ = _run(Two(), (torch.randn(2, 4, 8),), seeds, seq=4)
    assert grads.gather_backward[_node(gm, aten.layer_norm)] == "reduce_scatter"


def test_partial_sums_ride_a_single_reader_view_and_are_reduced_once_at_the_source_otherwise():
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

        def forward(self, x):
            p = self.mlp(x)
            return (p.view(8, 8).float().exp(), p.exp())  # two readers: reduce p once

    gm, prop, _, _ = _run(Views(), (torch.randn(2, 4, 8),), {"mlp.up.weight": whole(0, 16), "mlp.down.weight": whole(1, 16)})
    down = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.linear.default][-1]
    assert prop.placement[_node(gm, aten.view)] == REPLICATED
    reduced = [(kind, name) for kind, name in _moves(prop) if kind == "all_reduce"]
    assert {name for _, name in reduced} == {down.name}


def test_summing_or_averaging_over_the_split_dim_is_a_partial_sum_and_a_max_runs_whole():
    class Sums(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16, bias=False)

        def forward(self, x):
            h = self.up(x)
            return h.sum(-1), h.mean(-1), h.amax(-1)

    gm, prop, _, _ = _run(Sums(), (torch.randn(2, 4, 8),), {"up.weight": whole(0, 16)})
    assert prop.placement[_node(gm, aten.sum)] == PARTIAL
    assert prop.placement[_node(gm, aten.mean)] == PARTIAL  # each rank's mean over tp (the rewrite scales it)
    assert prop.placement[_node(gm, aten.amax)] == REPLICATED
    assert ("all_gather", next(n.name for n in gm.graph.nodes if n.target is aten.linear.default)) in _moves(prop)


def test_an_op_without_any_rule_gathers_its_inputs_and_runs_whole():
    class Cumsum(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16, bias=False)

        def forward(self, x):
            return torch.cumsum(self.up(x), dim=-1)  # over the split features

    gm, prop, _, _ = _run(Cumsum(), (torch.randn(2, 4, 8),), {"up.weight": whole(0, 16)})
    cumsum = _node(gm, aten.cumsum)
    assert prop.placement[cumsum] == REPLICATED
    assert prop.reads[cumsum][cumsum.args[0]] == REPLICATED


def test_dtensor_rules_cover_ops_we_have_none_for():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16, bias=False)

        def forward(self, x):
            h = self.up(x)
            return torch.stack([h, h * 2], dim=0).sum(0)  # stack along a new leading dim

    gm, prop, _, _ = _run(Stack(), (torch.randn(2, 4, 8),), {"up.weight": whole(0, 16)})
    stack = _node(gm, aten.stack)
    assert prop.source[stack] == "dtensor" and prop.placement[stack] == whole(3, 16)


def test_fused_segments_follow_a_split_of_the_fused_output():
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(x).split(8, dim=-1)
            return q * k + v

    spec = DimShard(0, ((0, 8), (8, 8), (16, 8)))
    gm, prop, _, _ = _run(Fused(), (torch.randn(2, 4, 8),), {"qkv.weight": spec})
    split = _node(gm, aten.split)
    assert prop.placement[split] == (whole(2, 8),) * 3
    assert prop.placement[_node(gm, aten.linear)] == DimShard(2, spec.segments)


def test_vocabulary_split_embedding_is_a_partial_sum_and_the_loss_is_replicated():
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10, bias=False)

        def forward(self, ids, targets):
            return F.cross_entropy(self.head(self.emb(ids)).view(-1, 10), targets.view(-1))

    ids = torch.randint(0, 10, (2, 4))
    vocab = whole(0, 10)
    gm, prop, _, _ = _run(LM(), (ids, ids), {"emb.weight": vocab, "head.weight": vocab})
    assert prop.placement[_node(gm, aten.embedding)] == PARTIAL
    loss = _node(gm, aten.cross_entropy_loss)
    assert prop.placement[loss] == REPLICATED and isinstance(prop.reads[loss][loss.args[0]], DimShard)


def test_grouped_kv_heads_split_by_groups_when_tp_divides_them():
    class GQA(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    q, kv = torch.randn(1, 8, 4, 2), torch.randn(1, 4, 4, 2)
    captured, _ = _graph(GQA(), q, kv, kv.clone())
    gm = captured.gm
    q_node, k_node, v_node = captured.user_placeholders
    prop = propagate(gm, {q_node: whole(1, 8)}, tp=2, constant=set(), sequence=None)
    sdpa = _node(gm, aten.scaled_dot_product_attention)
    assert prop.reads[sdpa][k_node] == whole(1, 4) and prop.placement[sdpa] == whole(1, 8)


def test_a_wrong_foreign_rule_is_caught_by_running_it(monkeypatch):
    """torch 2.13's DTensor accepts ``cumsum(dim=-1)`` on a tensor split along its last dim as still
    split (it compares -1 with 2). Dims are made non-negative before asking; and with that
    normalization switched off, running the op whole and per rank rejects the rule."""
    import sptransform.graph.dtensor_rules.args as dtensor_args
    import sptransform.graph.dtensor_rules.propagate as dtensor_propagate
    from sptransform.graph.rules.dtensor import dtensor_forward

    class Cumsum(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=-1)

    captured, _ = _graph(Cumsum(), torch.randn(2, 4, 16))
    node = _node(captured.gm, aten.cumsum)
    x = node.args[0]
    assert dtensor_forward(node, {x: whole(2, 16)}, 2).output == REPLICATED
    monkeypatch.setattr(dtensor_args, "_nonnegative_dims", lambda node, op, args, kwargs: (args, kwargs))
    monkeypatch.setattr(dtensor_propagate, "_PROPAGATE_CACHE", {})
    assert dtensor_forward(node, {x: whole(2, 16)}, 2) is None


class MaskRouted(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8, bias=False)

    def forward(self, x):  # x: [16, 8], split by rows (tokens)
        h = self.w(x)
        kept = h[h[:, 0] > 0]  # [u0, 8]: how many rows depends on the data
        return kept.sum(0)


def test_data_dependent_ops_run_whole_on_gathered_tokens():
    captured, _ = _graph(MaskRouted(), torch.randn(16, 8))
    gm = captured.gm
    (x,) = captured.user_placeholders
    prop = propagate(gm, {x: whole(0, 16)}, tp=2, constant=set(), sequence=None)
    routed = _node(gm, aten.index)
    assert prop.source[routed] == "routing" and routed in prop.routing_ops()
    assert prop.placement[routed] == REPLICATED
    assert set(prop.reads[routed].values()) == {REPLICATED}  # both the rows and the mask whole
    linear = _node(gm, aten.linear)
    assert prop.placement[linear] == whole(0, 16)  # before the routing the tokens stay split
    assert ("all_gather", linear.name) in _moves(prop)
    # every op that reads the unbacked size (the sum over the kept rows) runs whole too
    assert prop.placement[_node(gm, aten.sum)] == REPLICATED


class ExpertRows(nn.Module):
    """Mixtral's reference loop over per-expert ``nn.Linear`` MLPs: each expert's rows picked by
    ``torch.where`` (a count known only at run time), its MLP run on them, ``index_add_`` back."""

    def __init__(self, experts: int = 2):
        super().__init__()
        self.gate = nn.Linear(8, experts, bias=False)
        self.up = nn.ModuleList(nn.Linear(8, 16, bias=False) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(16, 8, bias=False) for _ in range(experts))

    def forward(self, x):  # x: [16, 8]
        choice = self.gate(x).argmax(-1)
        y = torch.zeros_like(x)
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            idx = torch.where(choice == e)[0]
            y = y.index_add(0, idx, down(F.gelu(up(x[idx]))))
        return y


def test_ops_on_routed_rows_are_split_along_static_dims_and_the_routing_runs_whole():
    """What decides the routing (``nonzero``, the sizes and assertions on its count) runs whole;
    what only reads the routed rows is split like any MLP, along the features, never the rows."""
    from sptransform.graph.nodes import routes, unbacked_dims

    seeds = {f"up.{e}.weight": whole(0, 16) for e in range(2)} | {f"down.{e}.weight": whole(1, 16) for e in range(2)}
    gm, prop, _, _ = _run(ExpertRows(), (torch.randn(16, 8),), seeds)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    deciding = [n for n in nodes if routes(n)]
    assert deciding and all(prop.source[n] == "routing" for n in deciding)
    assert all(p in (None, REPLICATED) or set(p) == {REPLICATED} for p in (prop.placement[n] for n in deciding))
    ups = [n for n in nodes if n.target is aten.linear.default and n.meta["val"].shape[-1] == 16]
    downs = [n for n in nodes if n.target is aten.linear.default and n.meta["val"].shape[-1] == 8]
    assert len(ups) == 2 and all(unbacked_dims(u) == {0} and prop.placement[u] == whole(1, 16) for u in ups)
    assert len(downs) == 2 and all(prop.placement[d] == PARTIAL for d in downs)  # row-parallel: partial sums
    rows = [n for n in nodes if n.target is aten.index.Tensor]
    assert all(prop.placement[r] == REPLICATED for r in rows)  # the rows themselves whole, as the tokens
    for node in nodes:  # no split along a run-time size, read or made
        for a, p in [*prop.reads[node].items(), (node, prop.placement[node])]:
            assert not isinstance(p, DimShard) or p.dim not in unbacked_dims(a), (node, a, p)
    # each expert's partial sum is added into zeros by index_add, a partial sum too (linear in it):
    # one reduction after the loop, where the output is read, and nothing else moves
    adds = [n for n in nodes if n.target is aten.index_add.default]
    assert len(adds) == 2 and all(prop.placement[a] == PARTIAL for a in adds)
    by_name = {n.name: n for n in nodes}
    assert [(kind, by_name[name]) for kind, name in _moves(prop)] == [("all_reduce", adds[-1])]


class ExpertGroups(nn.Module):
    """Experts run one after another on the groups of rows of one ``split`` (JetMoE's loop), the
    groups' outputs joined by ``cat``."""

    def __init__(self, experts: int = 3):
        super().__init__()
        self.gate = nn.Linear(8, experts, bias=False)
        self.up = nn.ModuleList(nn.Linear(8, 16, bias=False) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(16, 8, bias=False) for _ in range(experts))
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):  # x: [16, 8]
        x = x * self.scale  # so that the rows need a gradient
        choice = self.gate(x).argmax(-1)
        order = choice.argsort(stable=True)
        counts = F.one_hot(choice, len(self.up)).sum(0).tolist()
        a = torch.cat([up(g) for up, g in zip(self.up, x[order].split(counts))])
        a = F.gelu(a)
        y = torch.cat([down(g) for down, g in zip(self.down, a.split(counts))])
        return torch.zeros_like(x).index_add(0, order, y)


def test_experts_on_the_groups_of_a_split_reduce_once_and_sum_their_input_gradients_once():
    """The joined partial sums of the down projections stay one partial sum (``cat`` of partial
    sums only, then ``index_add`` into zeros), reduced once where the output is read; the
    chunks' partial input gradients meet at the split's input, summed by one f there, not one
    per expert."""
    seeds = {f"up.{e}.weight": whole(0, 16) for e in range(3)} | {f"down.{e}.weight": whole(1, 16) for e in range(3)}
    gm, prop, grads, _ = _run(ExpertGroups(), (torch.randn(16, 8),), seeds)
    cat_up, cat_down = [n for n in gm.graph.nodes if n.target is aten.cat.default]
    assert prop.placement[cat_up] == whole(1, 16) and prop.placement[cat_down] == PARTIAL
    by_name = {n.name: n for n in gm.graph.nodes}
    assert [(kind, by_name[name].target) for kind, name in _moves(prop)] == [("all_reduce", aten.index_add.default)]
    split = next(n for n in gm.graph.nodes if n.target is aten.split_with_sizes.default)
    rows = split.args[0]  # x[order]: deferred further, to x (the index's input), where the gate reads it too
    assert rows.target is aten.index.Tensor and list(grads.f_edges) == [rows.args[0]], list(grads.f_edges)


def test_a_cat_of_partial_sums_and_a_replicated_piece_is_reduced_first():
    """A replicated piece beside partial ones would be counted tp times: the join reads them reduced."""
    from sptransform.graph.rules.registry import forward_rule
    from sptransform.graph.rules import RuleContext

    class Join(nn.Module):
        def forward(self, a, b):
            return torch.cat([a * 2, b * 3])

    captured, _ = _graph(Join(), torch.randn(4, 8), torch.randn(4, 8))
    cat = _node(captured.gm, aten.cat)
    a, b = cat.args[0]
    ctx = RuleContext(tp=2, is_constant=lambda n: False)
    assert forward_rule(cat, {a: PARTIAL, b: PARTIAL}.get, ctx).output == PARTIAL
    assert forward_rule(cat, {a: PARTIAL, b: REPLICATED}.get, ctx) is None  # the caller reduces first


def test_ops_linear_in_a_partial_sum_keep_it_only_where_that_is_exact_and_no_larger():
    """``y * w``, ``y / w`` and ``index_add`` into zeros or into a partial sum keep a partial ``y``
    partial; ``index_add`` into a replicated tensor that is not zeros would add it ``tp`` times,
    ``w / y`` is not linear in ``y``, and a broadcast to a larger output would reduce more bytes:
    those read ``y`` reduced (the rule returns None, the caller picks the reduction)."""
    from sptransform.graph.rules import RuleContext
    from sptransform.graph.rules.registry import forward_rule

    class Ops(nn.Module):
        def forward(self, y, w, big, base, ids):
            return (y * w, y / w, w / y, y * big, torch.zeros_like(base).index_add(0, ids, y * 1),
                    base.index_add(0, ids, y * 1))

    captured, _ = _graph(Ops(), torch.randn(4, 8), torch.randn(4, 1), torch.randn(3, 4, 8), torch.randn(6, 8),
                         torch.tensor([0, 2, 2, 5]))
    y, w, big, base, ids = captured.user_placeholders
    ctx = RuleContext(tp=2, is_constant=lambda n: False)
    nodes = [n for n in captured.gm.graph.nodes if n.op == "call_function"]

    def output(node, placements):
        decision = forward_rule(node, lambda n: placements.get(n, REPLICATED), ctx)
        return None if decision is None else decision.output

    mul, div, rdiv, mul_big = [n for n in nodes if n.target in (aten.mul.Tensor, aten.div.Tensor)][:4]
    # each op's partial input is read by that op alone in this check: a fresh reader count
    for node, partial_input, want in ((mul, y, PARTIAL), (div, y, PARTIAL), (rdiv, y, None), (mul_big, y, None)):
        users = dict(partial_input.users)
        partial_input.users.clear()
        partial_input.users[node] = None
        try:
            assert output(node, {partial_input: PARTIAL}) == want, node
        finally:
            partial_input.users.clear()
            partial_input.users.update(users)
    into_zeros, into_base = [n for n in nodes if n.target is aten.index_add.default]
    source = into_zeros.args[3]
    assert output(into_zeros, {source: PARTIAL}) == PARTIAL
    assert output(into_base, {into_base.args[3]: PARTIAL}) is None  # base is not zeros
    assert output(into_base, {into_base.args[3]: PARTIAL, base: PARTIAL}) is None  # base read twice: reduce once


def test_a_partial_sum_times_a_split_operand_or_itself_is_reduced_first():
    """``y * g`` with ``g`` split (a sequence-split gate beside a partial expert output) is not
    linear with the same coefficients on every rank, nor is ``g * g`` linear in ``g``: the rule
    leaves the reduction to the caller."""
    from sptransform.graph.rules import RuleContext
    from sptransform.graph.rules.registry import forward_rule

    class Gate(nn.Module):
        def forward(self, y, g, z):
            return y * g, z * z

    captured, _ = _graph(Gate(), torch.randn(16, 8), torch.randn(16, 1), torch.randn(16, 8))
    y, g, z = captured.user_placeholders
    mul = _node(captured.gm, aten.mul)
    ctx = RuleContext(tp=2, is_constant=lambda n: False)
    assert forward_rule(mul, {y: PARTIAL, g: REPLICATED}.get, ctx).output == PARTIAL
    assert forward_rule(mul, {y: PARTIAL, g: whole(0, 16)}.get, ctx) is None
    square = [n for n in captured.gm.graph.nodes if n.target is aten.mul.Tensor][1]
    assert forward_rule(square, {z: PARTIAL}.get, ctx) is None  # z * z is not linear in z


class PickedSteps(nn.Module):
    """A column linear's split features scaled, step by step, by rows picked from a replicated
    tensor ``c`` (a scan reading its output matrix one time step at a time)."""

    def __init__(self, steps: int):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.mix = nn.Linear(8, 1, bias=False)
        self.down = nn.Linear(16, 8, bias=False)
        self.steps = steps

    def forward(self, x):  # x: [b, t, 8]
        h = self.up(x)                                     # [b, t, 16] split on features
        c = self.mix(x)                                    # [b, t, 1] replicated
        ys = [h[:, i] * c[:, i] for i in range(self.steps)]
        return self.down(torch.stack(ys, 1))


def test_partial_gradients_of_picked_steps_meet_where_the_picks_cover_their_source():
    """Every step picked: one f on ``c`` instead of one per step. Only the last step picked
    (``c[:, -1]``, a quarter of ``c``): the f stays on the pick, moving a quarter of the bytes."""
    seeds = {"up.weight": whole(0, 16), "down.weight": whole(1, 16)}
    gm, prop, grads, _ = _run(PickedSteps(4), (torch.randn(2, 4, 8),), seeds)
    mix = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.linear.default][1]
    assert list(grads.f_edges) == [mix], grads.f_edges

    class LastStep(PickedSteps):
        def forward(self, x):
            h = self.up(x)
            return self.down(h[:, -1] * self.mix(x)[:, -1])

    gm, prop, grads, _ = _run(LastStep(1), (torch.randn(2, 4, 8),), seeds)
    (f_at,) = grads.f_edges
    assert f_at.target is aten.select.int, f_at
