"""Data parallelism on the graph: every parameter's gradient averaged over the data-parallel
ranks, and with ZeRO (1 to 3) each parameter gathered from its 1/dp pieces where its layer uses it.

    zero=0:    before:  w = placeholder; y = linear(x, w)
               after:   w = placeholder; wd = average_grads(dp, n, w, ...)[0]; y = linear(x, wd)
    zero=1..3: before:  w = placeholder; y = linear(x, w)
               after:   w = placeholder                       # this rank's piece: 1/n along dim d
                        wf = gather_params(dp, n, [d, ...], [shape, ...], w, ...)[0]; y = linear(x, wf)

The graph is the same for stages 1 to 3; they differ in the gradient's collective
(``gather_params(..., whole_gradient=True)`` for ZeRO-1: all-reduced whole, this rank's piece
kept; reduce-scattered for 2 and 3) and at run time, where ZeRO-3's saved-tensor hooks gather
a parameter again for backward instead of keeping it (``runtime.zero``).

Parameters are bucketed by layer, as the tensor-parallel gradient buckets are (the layer of
the first row-parallel linear after a parameter's first use; the last bucket holds what comes
after the last one; at ``tp=1`` the layers of the captured graph's analysis), or, where the
analysis finds no layers, in first-use order into buckets of about ``BUCKET_BYTES``; each bucket is inserted just before its first reader: ZeRO gathers a
layer's parameters when that layer starts. With ZeRO a parameter with no dim to split
evenly over the data-parallel ranks (``DataParallelPlan.dims[name] is None``) stays whole and
has its gradient averaged instead.

Runs after the tensor-parallel rewrite: the buckets sit between the parameters and everything
that reads them (the tensor-parallel gradient buckets, pads, cuts). Edits ``gm`` in place;
the nodes it makes carry the parameter's ``val`` (global shapes, as every node's).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx as fx

from sptransform.passes.base import insert_bucket
from sptransform.runtime.collectives import average_grads
from sptransform.runtime.zero import gather_params


@dataclass(frozen=True)
class DataParallelPlan:
    group: str
    """The data-parallel process group's name."""
    size: int
    zero: int
    """0: parameters replicated over the data-parallel ranks; 1 to 3: split into 1/size pieces
    (1: the gradient all-reduced whole, this rank's piece kept; 2 and 3: reduce-scattered)."""
    dims: dict[str, int | None] = field(default_factory=dict)
    """ZeRO 1 to 3: parameter FQN -> the dim its pieces split (None: kept whole)."""
    local_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Parameter FQN -> its tensor-parallel-local shape (what a gathered bucket rebuilds)."""
    overlap: bool = True
    """Gradients waited on when the backward ends (the rest of the backward runs meanwhile)."""
    experts: frozenset[str] = frozenset()
    """Expert parameters split over the expert-parallel ranks (``passes.expert_parallel``): their
    gradients, already summed over the ep ranks' tokens, are averaged over ``expert_group``."""
    expert_group: str | None = None
    """The ranks holding the same experts (``dp / ep`` of them); the average still divides by ``size``."""
    ep: int = 1


def data_parallel(gm: fx.GraphModule, params: dict[fx.Node, str], plan: DataParallelPlan,
                  layer_rows: list[tuple[fx.Node, int]], *, bucket_bytes: int | None = None) -> fx.GraphModule:
    """Insert the data-parallel buckets (see the module docstring); ``params``: trainable
    parameter placeholders -> FQN; ``layer_rows``: (row-parallel linear, layer), empty without
    layers; ``bucket_bytes``: the size of a bucket then (default ``BUCKET_BYTES``)."""
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    used = {p: name for p, name in params.items() if p.users}
    if not used:
        return gm
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    rows = sorted((position[r], layer) for r, layer in layer_rows if r in position)
    ordered = sorted(used, key=lambda p: min(position[u] for u in p.users))  # by first use
    groups = dict(zip(ordered, by_layer(ordered, rows, position) if rows else _by_size(ordered, bucket_bytes)))
    buckets: dict[tuple[int, bool, bool], list[fx.Node]] = defaultdict(list)
    for param in sorted(used, key=position.__getitem__):  # a bucket's members in parameter order
        gathered = plan.zero >= 1 and plan.dims.get(used[param]) is not None
        buckets[(groups[param], gathered, used[param] in plan.experts)].append(param)
    for (layer, gathered, experts), members in sorted(buckets.items()):
        first_user = min((u for p in members for u in p.users), key=position.__getitem__)
        readers = {p: list(p.users) for p in members}
        with gm.graph.inserting_before(first_user):
            if gathered:
                names = [used[p] for p in members]
                group, size = (plan.expert_group, plan.size // plan.ep) if experts else (plan.group, plan.size)
                insert_bucket(gm, gather_params, (group, size, [plan.dims[n] for n in names],
                                                  [list(plan.local_shapes[n]) for n in names], *members),
                              {"overlap": plan.overlap, "whole_gradient": plan.zero == 1, "divisor": plan.size},
                              members, readers)
            else:
                group = plan.expert_group if experts else plan.group
                insert_bucket(gm, average_grads, (group, plan.size, *members), {"overlap": plan.overlap},
                              members, readers)
    gm.graph.lint()
    gm.recompile()
    return gm


BUCKET_BYTES = 25 * 2**20
"""Without layer boundaries (``tp=1``: no analysis), parameters in first-use order are cut into
buckets of about this many bytes, as DDP's ``bucket_cap_mb`` does, so that a bucket can travel
while the backward of the parameters used before it runs."""


def by_layer(ordered: list[fx.Node], rows: list[tuple[int, int]], position: dict) -> list[int]:
    """Each parameter's layer: that of the first row-parallel linear at or after its first use (the
    last layer's number + 1 after the last one)."""
    groups = []
    for param in ordered:
        first_use = min(position[u] for u in param.users)
        groups.append(next((layer for pos, layer in rows if pos >= first_use), rows[-1][1] + 1))
    return groups


def _by_size(ordered: list[fx.Node], cap: int) -> list[int]:
    """Consecutive runs of parameters of at most ``cap`` bytes (a larger one alone)."""
    groups, group, filled = [], 0, 0
    for param in ordered:
        val = param.meta.get("val")
        size = val.numel() * val.element_size() if val is not None else 0
        if filled and filled + size > cap:
            group, filled = group + 1, 0
        groups.append(group)
        filled += size
    return groups


def zero_dim(local_shape: tuple[int, ...], taken: tuple[int, ...], size: int) -> int | None:
    """The dim a parameter's ZeRO pieces split: the largest dim, other than those already split
    (``taken``: the tensor-parallel dim, an expert tensor's expert dim), that ``size`` divides;
    None when there is none (the parameter is kept whole on every data-parallel rank)."""
    candidates = [d for d in range(len(local_shape)) if d not in taken and local_shape[d] % size == 0]
    return max(candidates, key=lambda d: (local_shape[d], -d)) if candidates else None
