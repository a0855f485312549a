"""Storing split a fused projection some of whose rows every rank reads whole.

A multi-query projection ``W = [q heads | k | v]`` (``passes.unfuse``) has its query rows split
by heads and its K/V rows read whole: in the graph each rank needs its query heads and all of
K/V. DTensor stores a tensor in one placement, and no placement holds "rows [0, 64) split, rows
[64, 80) whole", so such a parameter is cut from the whole in the graph
(``ParamPlacement.stored_whole``), stored in contiguous pieces and all-gathered whole where read
(``passes.shard_whole``): every rank stores 1/tp of it, but gathers all of it each step.

It can be stored split instead, in ``k`` equal segments each split over the ranks
(``_StridedShard``), when the region reading it is split in finer segments to match:

    W [80, D], q = W[0:64] (8 heads of 8), K/V = W[64:80], tp = 2
    cut from whole: W gathered whole on each rank;     q split as one segment (heads 0-3 | 4-7)
    stored strided: 5 segments of 16, rank r holds rows 8r..8r+8 of each (40 rows);
                    q split as 4 segments of 16 (rank 0: heads 0, 2, 4, 6), the row-parallel
                    linear reading the heads' output split alike; K/V = all-gather of the ranks'
                    8 rows of the last segment (its backward a reduce-scatter of the gradient)

Every split of the region (its column weights' output features, its row weights' input
features) is refined by the same factor, so a rank's heads, keys and values stay together; the
placement propagation then checks that nothing else moves (``transform``). What this module
gives is the refined placements (``strided_placements``) and the graph form that gathers only
the rows read whole (``whole_runs``).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from sptransform.graph.findings import ModelAnalysis
from sptransform.graph.nodes import packet, shape_of
from sptransform.graph.placement import DimShard, ParamPlacement

aten = torch.ops.aten


def refine(spec: DimShard, m: int, tp: int) -> DimShard | None:
    """``spec`` with every segment cut into ``m`` equal segments (each still split over ``tp``), or
    None if some segment does not divide into ``m`` pieces that ``tp`` divides."""
    out = []
    for a, n in spec.segments:
        if n % (m * tp):
            return None
        out.extend((a + i * (n // m), n // m) for i in range(m))
    return DimShard(spec.dim, tuple(out))


def strided_placements(analysis: ModelAnalysis, placements: dict[str, ParamPlacement],
                       tp: int) -> dict[str, ParamPlacement] | None:
    """``placements`` with every parameter of ``analysis.read_whole_rows`` stored in equal segments
    (``_StridedShard``) and the regions reading it refined to match, or None when some cannot be:
    segments whose lengths differ, a length ``tp`` does not divide, a region whose other splits
    do not divide finer."""
    if not analysis.read_whole_rows:
        return None
    out = dict(placements)
    refined_regions: dict[int, int] = {}
    for name, whole_runs in analysis.read_whole_rows.items():
        spec = analysis.fused.get(name)
        if spec is None:
            return None
        lengths = {n for _, n in spec.segments}
        if len(lengths) != 1:
            return None
        (n,) = lengths
        g = math.gcd(n, *(length for _, length in whole_runs))
        length = next((d for d in range(g, 0, -1) if g % d == 0 and d % tp == 0), None)
        if length is None:
            return None
        m = n // length
        for index, region in enumerate(analysis.regions):
            if any(region.column_linears[c].weight_name == name or region.column_linears[c].bias_name == name
                   for c in region.columns):
                if refined_regions.setdefault(index, m) != m:
                    return None  # two parameters of one region asking different refinements
        size = sum(k for _, k in spec.segments) + sum(k for _, k in whole_runs)
        out[name] = ParamPlacement(DimShard(spec.dim, tuple((a, length) for a in range(0, size, length))),
                                   placements[name].role)
    for index, m in refined_regions.items():
        if m == 1:
            continue
        region = analysis.regions[index]
        names = {region.column_linears[c].weight_name for c in region.columns
                 if region.column_linears[c].weight_piece is None}
        names |= {region.column_linears[c].bias_name for c in region.columns
                  if region.column_linears[c].bias_name and region.column_linears[c].bias_piece is None}
        names |= {row.weight_name for row in region.rows}
        for name in names:
            old = out.get(name)
            if old is None or old.spec is None:
                continue
            spec = refine(old.spec, m, tp)
            if spec is None:
                return None
            out[name] = ParamPlacement(spec, old.role, old.padded_rows, stored_whole=False)
    return out


def whole_runs(gm: fx.GraphModule, params: dict[fx.Node, str], analysis: ModelAnalysis) -> int:
    """Read each run of a parameter's rows read whole through one slice of the run, so that with
    the parameter stored in segments only the run's are gathered, not all of it:

        before:  k = slice(W, 0, 64, 72); v = slice(W, 0, 72, 80)
        after:   r = slice(W, 0, 64, 80); k = slice(r, 0, 0, 8); v = slice(r, 0, 8, 16)

    Returns how many slices changed."""
    by_name = {name: node for node, name in params.items()}
    changed = 0
    for name, runs in analysis.read_whole_rows.items():
        placeholder, spec = by_name.get(name), analysis.fused.get(name)
        if placeholder is None or spec is None:
            continue
        readers = [u for u in placeholder.users if packet(u) is aten.slice and u.args[1] % len(shape_of(placeholder)) == spec.dim
                   and (len(u.args) < 5 or u.args[4] == 1)]
        for start, length in runs:
            inside = [u for u in readers if start <= _bounds(u)[0] and _bounds(u)[1] <= start + length]
            if not inside or (len(inside) == 1 and _bounds(inside[0]) == (start, start + length)):
                continue
            with gm.graph.inserting_before(min(inside, key=lambda u: list(gm.graph.nodes).index(u))):
                run = gm.graph.call_function(aten.slice.Tensor, (placeholder, spec.dim, start, start + length))
                run.meta["val"] = placeholder.meta["val"].narrow(spec.dim, start, length)
            for u in inside:
                a, b = _bounds(u)
                u.args = (run, spec.dim, a - start, b - start)
                changed += 1
    if changed:
        gm.recompile()
    return changed


def _bounds(node: fx.Node) -> tuple[int, int]:
    size = shape_of(node.args[0])[node.args[1]]
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else size
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    return max(0, min(start, size)), max(0, min(end, size))
