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
from sptransform.runtime.zero import gather_whole


def whole_parameters(params: dict[fx.Node, str], placements: dict[str, ParamPlacement], tp: int,
                     skip: frozenset[str] = frozenset()) -> dict[fx.Node, int]:
    """The trainable parameters the rewrite stores whole on every rank (no placement, or split in
    the graph but stored whole) and a dim of theirs that ``tp`` divides (the largest: the pieces
    are then the longest runs); ``skip``: names split another way (experts over ``ep``). A
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
        readers = {p: list(p.users) for p in members}
        shapes = [list(p.meta["val"].shape) for p in members]
        with gm.graph.inserting_before(first_user):
            insert_bucket(gm, gather_whole, (group, tp, [found[p] for p in members], shapes, rank, *members), {},
                          members, readers)
    gm.graph.lint()
    gm.recompile()
    return gm


def stored_split(placement: ParamPlacement | None, dim: int, size: int) -> ParamPlacement:
    """``placement`` (None: replicated) with its storage split evenly along ``dim`` of ``size``."""
    if placement is None:
        placement = ParamPlacement(None, "replicated")
    return ParamPlacement(placement.spec, placement.role, placement.padded_rows, placement.stored_whole,
                          gathered=whole(dim, size))
