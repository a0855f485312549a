"""Parameters tensor parallelism uses whole, stored split over the tensor-parallel ranks.

The tensor-parallel rewrite leaves some parameters whole on every rank: norms and routers
(small), but also weights no rule can split — a fused multi-query projection whose one K/V head
every query head reads, experts applied by data-dependent routing, a mixer read whole. Each rank
then stores, and its optimizer updates, the whole of them. With ``ParallelOptions.shard_whole``
each such parameter is stored in 1/tp pieces along a dim tp divides, and every layer's are
all-gathered where the layer starts (ZeRO-3 over the tensor-parallel ranks, for these
parameters only): weights, gradients and optimizer state are split; the computation that reads
them stays as the tensor-parallel rewrite made it (whole on every rank).

    before:  w = placeholder                     # whole on every rank
             ws = sync_grads(tp, w)[0]           # when the rewrite sums w's partial gradient
             y = op(x, ws)
    after:   w = placeholder                     # this rank's piece: 1/tp along dim d
             wf = gather_whole(tp, n, [d], [shape], tp_rank, w)[0]
             ws = sync_grads(tp, wf)[0]
             y = op(x, ws)

The gather sits between the parameter and everything the rewrite put after it, so the gradient
reaching its backward is whole and equal on every rank (the rewrite's reductions ran first):
the backward keeps this rank's piece and communicates nothing (``runtime.zero.gather_whole``).

A parameter split in the graph in segments no DTensor placement holds
(``ParamPlacement.stored_whole``: a fused weight of unequal segments) is stored so whatever the
option says (``whole_parameters(computed_whole=False)``: the pass runs whenever ``tp > 1``). It
is read through ``copy_to_tp``, whose backward all-reduces the
gradient pieces the ranks computed; all-reducing, then keeping a piece, is a reduce-scatter.
Such parameters are gathered by ``runtime.zero.gather_summed`` (backward: the gradient
reduce-scattered, summed), and their ``copy_to_tp`` removed: the all-gather forward and the
reduce-scatter backward move the bytes the all-reduce alone moved, and each rank stores 1/tp.
Rows such a parameter also gives whole to every rank (a Mamba-2 mixer's one B/C group) have a
gradient equal on every rank, which the sum would count ``tp`` times: those readers read it
through ``counted_once`` (backward: divided by tp):

    before:  w = placeholder                     # whole on every rank
             wc = copy_to_tp(w, tp)              # backward: all-reduce
             y = linear(x, take_local(wc, ...))
    after:   w = placeholder                     # this rank's piece
             wf = gather_summed(tp, n, [d], [shape], w)[0]              # backward: reduce-scatter
             y = linear(x, take_local(wf, ...))
Runs after the tensor-parallel rewrite and expert parallelism (expert tensors are split over
``ep`` already), before data parallelism, whose buckets then sit in front of these gathers
(a ZeRO piece of a tp piece). Edits ``gm`` in place.
"""

from __future__ import annotations

from collections import defaultdict

import torch.fx as fx

from sptransform.graph.placement import ParamPlacement, whole
from sptransform.passes.base import insert_bucket
from sptransform.passes.data_parallel import by_layer, zero_dim
from sptransform.runtime.collectives import copy_to_tp
from sptransform.runtime.zero import counted_once, gather_summed, gather_whole


def whole_parameters(params: dict[fx.Node, str], placements: dict[str, ParamPlacement], tp: int,
                     skip: frozenset[str] = frozenset(), computed_whole: bool = True) -> dict[fx.Node, int]:
    """The trainable parameters the rewrite stores whole on every rank (no placement, or split in
    the graph but stored whole; only the latter without ``computed_whole``) and a dim of theirs
    that ``tp`` divides (the largest: the pieces are then the longest runs); ``skip``: names
    split another way (experts over ``ep``). A
    parameter with no such dim stays whole, and so does one this graph does not read: a tied
    weight's other name (the module stores a tied parameter as planned under the name the graph
    reads)."""
    found = {}
    for node, name in params.items():
        val = node.meta.get("val")
        placement = placements.get(name)
        if name in skip or val is None or not val.requires_grad or not node.users:
            continue
        if placement is not None and placement.storage is not None:
            continue
        if not computed_whole and (placement is None or not placement.stored_whole):
            continue
        dim = zero_dim(tuple(val.shape), (), tp)
        if dim is not None and val.shape[dim] >= tp:  # tp divides an empty dim too: nothing to split
            found[node] = dim
    return found


def shard_whole(gm: fx.GraphModule, found: dict[fx.Node, int], *, group: str, tp: int, rank: fx.Node,
                layer_rows: list[tuple[fx.Node, int]]) -> fx.GraphModule:
    """Insert one ``gather_whole`` per layer for the parameters of ``found`` (placeholder -> its
    dim), in front of their first reader (see the module docstring). A parameter's layer is that
    of the first row-parallel linear at or after its first use, as the data-parallel buckets'."""
    if not found:
        return gm
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    rows = sorted((position[r], layer) for r, layer in layer_rows if r in position)
    ordered = sorted(found, key=position.__getitem__)
    layers = by_layer(ordered, rows, position) if rows else [0] * len(ordered)  # no row linear: one bucket
    buckets: dict[int, list[fx.Node]] = defaultdict(list)
    for param, layer in zip(ordered, layers):
        buckets[layer].append(param)
    for _, members in sorted(buckets.items()):
        first_user = min((u for p in members for u in p.users), key=position.__getitem__)
        summed = [p for p in members if _split_in_graph(p)]
        kept = [p for p in members if p not in summed]
        with gm.graph.inserting_before(first_user):
            if kept:
                insert_bucket(gm, gather_whole, (group, tp, [found[p] for p in kept], _shapes(kept), rank, *kept), {},
                              kept, {p: list(p.users) for p in kept})
            if summed:
                readers = {p: _summed_readers(gm, p, tp, position) for p in summed}
                insert_bucket(gm, gather_summed, (group, tp, [found[p] for p in summed], _shapes(summed), *summed),
                              {}, summed, readers)
                for p in summed:  # the copy_to_tp now read the gathered value: their sum is the gather's
                    for c in readers[p]:
                        if c.target is copy_to_tp:
                            c.replace_all_uses_with(c.args[0])
                            gm.graph.erase_node(c)
    gm.graph.lint()
    gm.recompile()
    return gm


def _shapes(members: list[fx.Node]) -> list[list[int]]:
    return [list(p.meta["val"].shape) for p in members]


def _entered(node: fx.Node, param: fx.Node) -> bool:
    return node.op == "call_function" and node.target is copy_to_tp and node.args[0] is param


def _split_in_graph(param: fx.Node) -> bool:
    """Read by ``copy_to_tp`` (a parameter split in the graph, stored whole): the sum its
    backward makes is the gather's reduce-scatter."""
    return any(_entered(u, param) for u in param.users)


def _summed_readers(gm: fx.GraphModule, param: fx.Node, tp: int, position: dict[fx.Node, int]) -> list[fx.Node]:
    """The nodes that will read the gathered ``param``, for ``insert_bucket``: its ``copy_to_tp``
    (removed after), and one ``counted_once`` put in front of its other readers (rows read whole,
    whose gradient is equal on every rank)."""
    readers = [u for u in param.users if _entered(u, param)]
    others = [u for u in param.users if not _entered(u, param)]
    if others:
        with gm.graph.inserting_before(min(others, key=position.__getitem__)):
            once = gm.graph.call_function(counted_once, (param, tp))
        once.meta["val"] = param.meta.get("val")
        for u in others:
            u.replace_input_with(param, once)
        readers.append(once)
    return readers


def stored_split(placement: ParamPlacement | None, dim: int, size: int) -> ParamPlacement:
    """``placement`` (None: replicated) with its storage split evenly along ``dim`` of ``size``."""
    if placement is None:
        placement = ParamPlacement(None, "replicated")
    return ParamPlacement(placement.spec, placement.role, placement.padded_rows, placement.stored_whole,
                          gathered=whole(dim, size))
