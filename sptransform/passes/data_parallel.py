"""Data parallelism on the graph: every parameter's gradient averaged over the data-parallel
ranks, and with ZeRO-3 each parameter gathered from its 1/dp pieces where its layer uses it.

    zero=0:  before:  w = placeholder; y = linear(x, w)
             after:   w = placeholder; wd = average_grads(dp, n, w, ...)[0]; y = linear(x, wd)
    zero=3:  before:  w = placeholder; y = linear(x, w)
             after:   w = placeholder                       # this rank's piece: 1/n along dim d
                      wf = gather_params(dp, n, [d, ...], [shape, ...], w, ...)[0]; y = linear(x, wf)

Parameters are bucketed by layer, as the tensor-parallel gradient buckets are (the layer of
the first row-parallel linear after a parameter's first use; the last bucket holds what comes
after the last one), and each bucket is inserted just before its first reader: ZeRO-3 gathers
a layer's parameters when that layer starts. With ZeRO-3 a parameter with no dim to split
evenly over the data-parallel ranks (``DataParallelPlan.dims[name] is None``) stays whole and
has its gradient averaged instead.

Runs after the tensor-parallel rewrite: the buckets sit between the parameters and everything
that reads them (the tensor-parallel gradient buckets, pads, cuts). Edits ``gm`` in place;
the nodes it makes carry the parameter's ``val`` (global shapes, as every node's).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx as fx

from sptransform.runtime.collectives import average_grads
from sptransform.runtime.zero import gather_params


@dataclass(frozen=True)
class DataParallelPlan:
    group: str
    """The data-parallel process group's name."""
    size: int
    zero: int
    """0: parameters replicated over the data-parallel ranks; 3: split into 1/size pieces."""
    dims: dict[str, int | None] = field(default_factory=dict)
    """ZeRO-3: parameter FQN -> the dim its pieces split (None: kept whole)."""
    local_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Parameter FQN -> its tensor-parallel-local shape (what a gathered bucket rebuilds)."""
    overlap: bool = True
    """Gradients waited on where first read (the rest of the backward runs meanwhile)."""


def data_parallel(gm: fx.GraphModule, params: dict[fx.Node, str], plan: DataParallelPlan,
                  layer_rows: list[tuple[fx.Node, int]]) -> fx.GraphModule:
    """Insert the data-parallel buckets (see the module docstring); ``params``: trainable
    parameter placeholders -> FQN; ``layer_rows``: (row-parallel linear, layer)."""
    used = {p: name for p, name in params.items() if p.users}
    if not used:
        return gm
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    rows = sorted((position[r], layer) for r, layer in layer_rows if r in position)
    buckets: dict[tuple[int, bool], list[fx.Node]] = defaultdict(list)
    for param in sorted(used, key=position.__getitem__):
        first_use = min(position[u] for u in param.users)
        layer = next((layer for pos, layer in rows if pos > first_use), rows[-1][1] + 1 if rows else 0)
        gathered = plan.zero == 3 and plan.dims.get(used[param]) is not None
        buckets[(layer, gathered)].append(param)
    for (layer, gathered), members in sorted(buckets.items()):
        first_user = min((u for p in members for u in p.users), key=position.__getitem__)
        readers = {p: list(p.users) for p in members}
        with gm.graph.inserting_before(first_user):
            if gathered:
                names = [used[p] for p in members]
                bucket = gm.graph.call_function(gather_params, (
                    plan.group, plan.size, [plan.dims[n] for n in names],
                    [list(plan.local_shapes[n]) for n in names], *members), {"overlap": plan.overlap})
            else:
                bucket = gm.graph.call_function(average_grads, (plan.group, plan.size, *members),
                                                {"overlap": plan.overlap})
            outs = []
            for i, p in enumerate(members):
                out = gm.graph.call_function(operator.getitem, (bucket, i))
                out.meta["val"] = p.meta.get("val")
                for key in ("sptransform_param",):
                    if key in p.meta:
                        out.meta[key] = p.meta[key]
                outs.append(out)
        for p, out in zip(members, outs):
            for reader in readers[p]:
                reader.replace_input_with(p, out)
    gm.graph.lint()
    gm.recompile()
    return gm


def zero_dim(local_shape: tuple[int, ...], tp_dim: int | None, size: int) -> int | None:
    """The dim a parameter's ZeRO-3 pieces split: the largest dim, other than the one tensor
    parallelism splits, that ``size`` divides; None when there is none (the parameter is kept
    whole on every data-parallel rank)."""
    candidates = [d for d in range(len(local_shape)) if d != tp_dim and local_shape[d] % size == 0]
    return max(candidates, key=lambda d: (local_shape[d], -d)) if candidates else None
