"""Sequence-parallel pass: outside the tensor-parallel regions, activations are
split along the sequence, and the region boundaries become g / ḡ.

    before:  y = mm(a_r, Wo_r)  [partial];  r = add(x, dropout(add(y, b_o)));  h = layer_norm(r); q = linear(h, Wq_r)
    after:   y = scatter_seq(mm(a_r, Wo_r), dim=seq)        # ḡ: reduce-scatter
             r = add(x_s, dropout(add(y, b_o)))               # local sequence shard
             h = layer_norm(r); q = linear(gather_seq(h, dim=seq), Wq_r)   # g: all-gather

The embedding's partial output enters by ḡ too; a replicated tensor that joins
the sharded stream (learned positions) is cut to the local rows with
``take_local``; outputs leave by ``gather_output``. The sequence dim is the token
dim whose size is the attention's query length. Runs after ``shard_linears`` on
the same ``ParallelPlan``; edits in place; writes ``node.meta["sptransform_spec"]``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from sptransform.runtime.collectives import gather_output, gather_seq, scatter_seq
from sptransform.graph.plan import ParallelPlan
from sptransform.graph.sharding import DimShard, ShardingError, describe, output_spec_for_inputs, packet, shape_of, whole
from sptransform.passes.localize import localize
from sptransform.passes.tensor_parallel import cut_for_users, finish_exit

aten = torch.ops.aten

_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.alias}


def sequence_parallel(gm: fx.GraphModule, plan: ParallelPlan, *, seq_len: int) -> fx.GraphModule:
    tp = plan.tp
    if seq_len % tp:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by tp={tp}; sequence parallelism splits "
            f"the sequence evenly: use a length that is a multiple of {tp}, or sp=False"
        )
    plan.seq_len = seq_len
    specs: dict[fx.Node, DimShard] = {}
    for exit_ in plan.exits:
        at = _seq_separated(exit_.partial, seq_len)
        dim = _seq_dim(at, seq_len)
        reduced = finish_exit(gm, exit_, at, lambda n, d=dim: gm.graph.call_function(scatter_seq, (n, d, plan.group)))
        specs[reduced] = whole(dim, seq_len)
    entry_of = {c: a for a, consumers in plan.entries.items() for c in consumers}
    gathered: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node in specs or node.op == "placeholder":
            continue
        inputs = {a: specs[a] for a in node.all_input_nodes if a in specs}
        if not inputs:
            continue
        if node.op == "output":
            _gather_outputs(gm, node, inputs, specs, plan)
            continue
        activation = entry_of.get(node)
        if activation is not None and activation in inputs:
            if activation not in gathered:
                gathered[activation] = _gather(gm, activation, specs, plan, gather_seq)
            node.replace_input_with(activation, gathered[activation])
            continue
        try:
            spec, cuts = output_spec_for_inputs(node, inputs, tp)
        except ShardingError as err:
            raise ShardingError(f"{err}; it cannot run sequence-parallel: pass sp=False") from None
        for replicated, cut_spec in cuts:
            cut_for_users(gm, replicated, cut_spec, plan, users=[node])
        localize(node, spec, tp)
        if spec is not None:
            specs[node] = spec
    gm.graph.lint()
    gm.recompile()
    return gm


def _seq_dim(node: fx.Node, seq_len: int) -> int:
    shape = shape_of(node)
    dims = [d for d in range(len(shape) - 1) if shape[d] == seq_len]
    if not dims:
        raise ShardingError(f"{describe(node)} has no dim of the sequence length {seq_len}")
    return dims[-1]


def _seq_separated(node: fx.Node, seq_len: int) -> fx.Node:
    """Follow a chain of views from a partial sum until the sequence is a dim of its own
    (``addmm`` works on ``[b*s, h]``; its output is viewed back to ``[b, s, h]``)."""
    while not any(s == seq_len for s in shape_of(node)[:-1]):
        users = list(node.users)
        if len(users) != 1 or packet(users[0]) not in _VIEWS:
            raise ShardingError(f"{describe(node)}: its sequence dim never appears separately")
        node = users[0]
    return node


def _whole_ancestor(node: fx.Node, specs) -> fx.Node:
    """The nearest view-ancestor whose split is one whole segment (a gather there is in order)."""
    while not _is_whole(node, specs[node]):
        if packet(node) not in _VIEWS:
            raise ShardingError(f"{describe(node)}: cannot gather a tensor split in several segments")
        node = node.args[0]
    return node


def _is_whole(node: fx.Node, spec: DimShard) -> bool:
    return spec.covers_whole(shape_of(node)[spec.dim])


def _gather(gm, activation: fx.Node, specs, plan: ParallelPlan, how) -> fx.Node:
    source = _whole_ancestor(activation, specs)
    spec = specs[source]
    with gm.graph.inserting_after(activation):
        if how is gather_output:
            full = gm.graph.call_function(how, (source, spec.dim, plan.rank, plan.group))
        else:
            full = gm.graph.call_function(how, (source, spec.dim, plan.group))
    full.meta["val"] = source.meta.get("val")
    if source is activation:
        return full
    with gm.graph.inserting_after(full):
        view = gm.graph.call_function(aten.reshape.default, (full, list(shape_of(activation))))
    view.meta["val"] = activation.meta.get("val")
    return view


def _gather_outputs(gm, output: fx.Node, inputs, specs, plan: ParallelPlan) -> None:
    flat = list(output.args[0])
    for i, value in enumerate(flat):
        if value in inputs:
            flat[i] = _gather(gm, value, specs, plan, gather_output)
    output.args = (tuple(flat),)
