"""Tensor-parallel pass: split the linears of every region found by the analysis,
and the vocabulary of the embedding, head and loss.

    before:  h = layer_norm(x); qkv = addmm(b, h, W_qkv); ... ; y = addmm(b_o, a, W_o)
    after:   h = layer_norm(x); qkv = addmm(b_r, h, W_qkv_r); ...(local heads)...
             y_partial = mm(a_r, W_o_r)                      # exit: collective + b_o later

    before:  e = embedding(W_tok, ids)          logits = linear(h, W_head); loss = cross_entropy_loss(logits, t)
    after:   e_partial = vocab_parallel_embedding(W_tok_r, ids, rank)
             logits_r = linear(h, W_head_r); loss = vocab_parallel_cross_entropy(logits_r, t, rank, ...)

It edits ``gm`` in place and fills a ``ParallelPlan``: parameter placements, the
activations that enter regions (``plan.entries``) and the partial sums that leave
them (``plan.exits``). It inserts no collective: the tensor-parallel or
sequence-parallel placement pass decides between f/f̄ and g/ḡ. Reads
``node.meta["val"]``; writes ``node.meta["sptransform_spec"]`` on every node whose
output is split.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from sptransform.graph.analysis import LinearMatch, ModelAnalysis, Region
from sptransform.runtime.ops import narrow_vocab, pad_last, pad_rows, take_local, vocab_parallel_cross_entropy, vocab_parallel_embedding
from sptransform.graph.plan import Exit, ParallelPlan, ParamPlacement
from sptransform.graph.sharding import DimShard, ShardingError, describe, is_getitem, is_split, packet, shape_of, whole
from sptransform.passes.localize import index_table, localize, localize_split

aten = torch.ops.aten

_VOCAB_PASSTHROUGH = {aten.to, aten._to_copy, aten.contiguous, aten.clone, aten.alias, aten.detach,
                      aten.mul, aten.div, aten.tanh, aten.slice}


def add_rank_input(gm: fx.GraphModule) -> fx.Node:
    """A 0-dim int64 placeholder ``tp_rank``, after the last placeholder."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        rank = gm.graph.placeholder("tp_rank")
    rank.meta["val"] = None
    return rank


def shard_linears(
    gm: fx.GraphModule, analysis: ModelAnalysis, *, tp: int, sp: bool, group: str, static_rank: int | None
) -> ParallelPlan:
    """``static_rank``: this process's rank when the graph serves one rank only (None when it
    serves simulated ranks); only a rank-dependent output width is specialized on it."""
    rank = add_rank_input(gm)
    plan = ParallelPlan(tp=tp, sp=sp, group=group, rank=rank, static_rank=static_rank)
    for region in analysis.regions:
        _shard_region(gm, region, plan)
    if analysis.head is not None:
        _shard_vocab(gm, analysis, plan)
    gm.graph.lint()
    gm.recompile()
    return plan


# ---------------------------------------------------------------------------
# regions


def _shard_region(gm: fx.GraphModule, region: Region, plan: ParallelPlan) -> None:
    tp = plan.tp
    for column, spec in region.columns.items():
        lm = region.column_linears[column]
        plan.place(lm.weight_name, ParamPlacement(spec.with_dim(lm.out_dim), "column-parallel weight"))
        if lm.bias_name:
            plan.place(lm.bias_name, ParamPlacement(spec.with_dim(0), "column-parallel bias"))
        plan.entries.setdefault(lm.input, []).append(column)
        column.meta["sptransform_spec"] = spec
    row = region.row
    plan.place(row.weight_name, ParamPlacement(whole(1 - row.out_dim, row.in_features), "row-parallel weight"))
    if row.bias_name:
        plan.place(row.bias_name, ParamPlacement(None, "row-parallel bias (added after the reduction)"))
    for node, spec in region.specs.items():
        if node in region.columns or spec is None:
            continue
        if is_split(node):
            localize_split(node, spec, tp)
        elif not is_getitem(node):
            localize(node, spec, tp)
        else:
            node.meta["sptransform_spec"] = spec
    for node, spec in region.cuts:
        cut_for_users(gm, node, spec, plan, users=[u for u in node.users if u in region.specs or u is row.node])
    partial = _drop_bias(gm, row)
    plan.exits.append(Exit(partial=partial, bias=row.bias, layer=region.layer))


def _drop_bias(gm: fx.GraphModule, row: LinearMatch) -> fx.Node:
    """``linear(x, W, b)`` -> ``linear(x, W)``; ``addmm(b, x, W)`` -> ``mm(x, W)``: the bias
    is added once, after the partial sums are reduced."""
    node = row.node
    if row.bias is None:
        return node
    if packet(node) is aten.linear:
        node.args = node.args[:2]
    elif packet(node) is aten.addmm:
        node.target = aten.mm.default
        node.args = (node.args[1], node.args[2])
        node.kwargs = {}
    return node


def cut_for_users(gm, node: fx.Node, spec: DimShard, plan: ParallelPlan, users) -> fx.Node:
    """Insert ``take_local(node)`` and make ``users`` read it."""
    table_node = index_table(gm, node, spec, plan.tp)
    with gm.graph.inserting_after(table_node):
        local = gm.graph.call_function(take_local, (node, spec.dim, table_node, plan.rank))
    local.meta["val"] = node.meta.get("val")
    local.meta["sptransform_spec"] = spec
    local.meta["sptransform_cut_of"] = node
    for user in users:
        user.replace_input_with(node, local)
    return local


# ---------------------------------------------------------------------------
# vocabulary: embedding, head, loss


def _shard_vocab(gm: fx.GraphModule, analysis: ModelAnalysis, plan: ParallelPlan) -> None:
    head = analysis.head
    tp = plan.tp
    vocab = head.out_features
    per_rank = math.ceil(vocab / tp)
    plan.vocab, plan.vocab_per_rank = vocab, per_rank
    padded = per_rank if vocab % tp else None
    plan.place(head.weight_name, ParamPlacement(whole(head.out_dim, vocab), "vocab-parallel head", padded))
    if head.bias_name:
        plan.place(head.bias_name, ParamPlacement(whole(0, vocab), "vocab-parallel head bias", padded))
    for emb in analysis.vocab_embeddings:
        plan.place(emb.weight_name, ParamPlacement(whole(0, vocab), "vocab-parallel embedding", padded))
    if padded:
        _pad_weight_uses(gm, head.weight, head.out_dim, per_rank)
        if head.bias is not None:
            _pad_weight_uses(gm, head.bias, 0, per_rank)
        for emb in analysis.vocab_embeddings:
            if emb.weight is not head.weight:
                _pad_weight_uses(gm, emb.weight, 0, per_rank)
    for emb in analysis.vocab_embeddings:
        node = emb.node
        node.target = vocab_parallel_embedding
        node.args = (node.args[0], node.args[1], plan.rank, per_rank)
        node.kwargs = {}
        plan.exits.append(Exit(partial=node, bias=None, layer=0))
    plan.entries.setdefault(head.input, []).append(head.node)
    spec = DimShard(len(shape_of(head.node)) - 1, ((0, per_rank * tp),))
    head.node.meta["sptransform_spec"] = spec
    _follow_logits(gm, head.node, spec, plan)


def _pad_weight_uses(gm, weight: fx.Node, dim: int, rows: int) -> None:
    users = list(weight.users)
    with gm.graph.inserting_after(weight):
        padded = gm.graph.call_function(pad_rows if dim == 0 else pad_last, (weight, rows))
    for user in users:
        user.replace_input_with(weight, padded)


def _follow_logits(gm, start: fx.Node, spec: DimShard, plan: ParallelPlan) -> None:
    """Carry the vocab split from the head to the loss and the outputs."""
    stack = [(start, spec)]
    while stack:
        node, spec = stack.pop()
        for user in list(node.users):
            p = packet(user)
            if user.op == "output":
                _mark_output(user, node, spec, plan)
            elif p is aten.cross_entropy_loss and user.args[0] is node:
                _vocab_parallel_loss(user, plan)
            elif p in _VOCAB_PASSTHROUGH and all(not isinstance(a, fx.Node) for a in user.args[1:]):
                if p is aten.slice and user.args[1] % len(shape_of(node)) == spec.dim:
                    raise ShardingError(f"{describe(user)} slices the vocab dim of split logits")
                user.meta["sptransform_spec"] = spec
                stack.append((user, spec))
            elif p in (aten.view, aten.reshape, aten._unsafe_view) and shape_of(user)[-1] == shape_of(node)[spec.dim]:
                new = DimShard(len(shape_of(user)) - 1, spec.segments)
                localize(user, new, plan.tp)
                stack.append((user, new))
            else:
                raise ShardingError(
                    f"{describe(user)} reads vocab-split logits; sptransform handles casts, reshapes, "
                    "scaling and aten.cross_entropy_loss on them"
                )


def _mark_output(output: fx.Node, node: fx.Node, spec: DimShard, plan: ParallelPlan) -> None:
    flat = list(output.args[0])
    with output.graph.inserting_before(output):
        narrowed = output.graph.call_function(narrow_vocab, (node, plan.vocab_per_rank, plan.vocab, plan.static_rank))
    for i, value in enumerate(flat):
        if value is node:
            flat[i] = narrowed
            plan.output_specs[i] = (spec, plan.vocab)
    output.args = (tuple(flat),)


def _vocab_parallel_loss(loss: fx.Node, plan: ParallelPlan) -> None:
    args = list(loss.args) + [None] * (6 - len(loss.args))
    logits, target, weight, reduction, ignore_index, smoothing = args[:6]
    weight = loss.kwargs.get("weight", weight)
    reduction = loss.kwargs.get("reduction", 1 if reduction is None else reduction)
    ignore_index = loss.kwargs.get("ignore_index", -100 if ignore_index is None else ignore_index)
    smoothing = loss.kwargs.get("label_smoothing", 0.0 if smoothing is None else smoothing)
    if weight is not None or smoothing:
        raise ShardingError(f"{describe(loss)}: class weights and label smoothing are not supported on split logits")
    loss.target = vocab_parallel_cross_entropy
    loss.args = (logits, target, plan.rank, plan.vocab_per_rank, plan.vocab, ignore_index, reduction, plan.group)
    loss.kwargs = {}


# ---------------------------------------------------------------------------
# f / f̄ (tensor parallelism without sequence parallelism)


def insert_tp_collectives(gm: fx.GraphModule, plan: ParallelPlan) -> fx.GraphModule:
    """Place the conjugate pair around every region:

        before:  h = layer_norm(x); q = linear(h, Wq_r) ... ; y = mm(a_r, Wo_r); z = add(y, b_o)
        after:   h = layer_norm(x); h_f = copy_to_tp(h)      # f
                 q = linear(h_f, Wq_r) ... ; y = reduce_from_tp(mm(a_r, Wo_r)); z = add(add(y, b_o))  # f̄

    One f per activation, however many column-parallel linears read it."""
    from sptransform.runtime.collectives import copy_to_tp, reduce_from_tp

    for activation, consumers in plan.entries.items():
        with gm.graph.inserting_after(activation):
            entered = gm.graph.call_function(copy_to_tp, (activation, plan.group))
        entered.meta["val"] = activation.meta.get("val")
        for consumer in consumers:
            consumer.replace_input_with(activation, entered)
    for exit_ in plan.exits:
        finish_exit(gm, exit_, exit_.partial, lambda node: gm.graph.call_function(reduce_from_tp, (node, plan.group)))
    gm.graph.lint()
    gm.recompile()
    return gm


def finish_exit(gm: fx.GraphModule, exit_: Exit, at: fx.Node, make_collective) -> fx.Node:
    """Reduce the partial sum ``at`` with ``make_collective``, add the bias, and make every
    other reader of ``at`` read the result."""
    readers = list(at.users)
    with gm.graph.inserting_after(at):
        reduced = make_collective(at)
    reduced.meta["val"] = at.meta.get("val")
    result = reduced
    if exit_.bias is not None:
        with gm.graph.inserting_after(reduced):
            result = gm.graph.call_function(aten.add.Tensor, (reduced, exit_.bias))
        result.meta["val"] = at.meta.get("val")
    for reader in readers:
        reader.replace_input_with(at, result)
    return reduced
