"""Parameters that every reader cuts to one split: stored that split instead of whole.

A parameter that no linear splits is seeded replicated; where a block reads it per channel or per
head (Mamba's decay ``A_log`` and skip ``D`` read by the channels of this rank, a depthwise
convolution's weight, a column linear's bias added apart, attention sinks per head) the
propagation cuts it to this rank's part at every read. Held whole, it costs every rank the whole
tensor and a gradient all-reduce for a gradient that is split anyway. Stored split (``Shard``), the
cut disappears and its gradient needs no reduction::

    before:  A_log (R) -> exp (R) -> neg (R) --cut S(0)--> mul(dt S(1), A)     grad: all-reduce
    after:   A_log (S(0)) -> exp (S(0)) -> neg (S(0)) -> mul(dt S(1), A)       grad: local

The split wanted at each read is carried back to the parameter through the ops computed from
parameters only (casts, ``exp``, views) with the same backward rules the block walk uses; every
reader must want the same even split. The propagation is then run again with these seeds, and a
parameter whose new split makes anything downstream gather (a reader that wanted it whole after
all) goes back to replicated.
"""

from __future__ import annotations

import torch.fx as fx

from sptransform.graph.placement import REPLICATED, DimShard
from sptransform.graph.propagate import Propagation, move_kind
from sptransform.graph.rules import CUT, ShardingError, input_specs_for_output
from sptransform.graph.nodes import shape_of

_DEPTH = 8  # ops between a parameter and its cut (a cast, exp, neg, views): a few


def wanted_split(node: fx.Node, prop: Propagation, constant: set[fx.Node], tp: int, depth: int = 0) -> DimShard | None:
    """The one split every reader of ``node`` reads it in, carried back through replicated ops
    computed from parameters only; None if some reader reads it whole, partial or otherwise."""
    wanted: set[DimShard] = set()
    for user in node.users:
        if user.op == "output":
            return None
        read = prop.reads.get(user, {}).get(node)
        if isinstance(read, DimShard):
            wanted.add(read)
            continue
        if read != REPLICATED or user not in constant or prop.placement.get(user) != REPLICATED or depth >= _DEPTH:
            return None
        after = wanted_split(user, prop, constant, tp, depth + 1)
        if after is None:
            return None
        try:
            specs = [spec for arg, spec in input_specs_for_output(user, after, tp) if arg is node]
        except ShardingError:
            return None
        if not specs or any(not isinstance(spec, DimShard) or spec is CUT for spec in specs):
            return None
        wanted.update(specs)
    if len(wanted) != 1:
        return None
    (spec,) = wanted
    size, lengths = shape_of(node)[spec.dim], {length for _, length in spec.segments}
    # one even split (Shard), or k equal segments tiling the dim (_StridedShard: a [q | k] filter bank)
    tiles = len(lengths) == 1 and [start for start, _ in spec.segments] == list(range(0, size, next(iter(lengths))))
    return spec if tiles and sum(lengths) * len(spec.segments) == size and size % (tp * len(spec.segments)) == 0 else None


def split_parameters(params: dict[fx.Node, str], prop: Propagation, constant: set[fx.Node],
                     tp: int) -> dict[fx.Node, DimShard]:
    """Each replicated parameter placeholder in ``params`` that every reader cuts to one even
    split -> that split."""
    found = {}
    for node in params:
        if prop.placement.get(node) != REPLICATED or node in prop.cut_seeds:
            continue
        spec = wanted_split(node, prop, constant, tp)
        if spec is not None:
            found[node] = spec
    return found


def gathering(prop: Propagation, seeds: dict[fx.Node, DimShard], constant: set[fx.Node]) -> set[fx.Node]:
    """The seeds whose split, in ``prop``, reaches a reader that gathers it (or anything computed
    from it alone) back to whole."""
    bad = set()
    for seed in seeds:
        closure, todo = {seed}, [seed]
        while todo:
            for user in todo.pop().users:
                if user in constant and user not in closure:
                    closure.add(user)
                    todo.append(user)
        for node, _, have, want in prop.changes():
            if node in closure and move_kind(have, want) not in ("none", "cut"):
                bad.add(seed)
                break
    return bad
