"""Our backward rules: how each tensor input of an op must be split for its output to be split
as asked (the region walk of ``graph.analysis`` asks this, walking back from a row-parallel
linear). Each is one ``BackwardRule`` of the registry; ``None`` from a rule means "no rule for
this call": DTensor's strategies are asked next.
"""

from __future__ import annotations

import torch.fx as fx

from sptransform.graph.nodes import describe, output_shape, shape_of
from sptransform.graph.placement import DimShard
from sptransform.graph.rules.base import CUT, LinksRule, ShardingError
from sptransform.graph.rules.geometry import cat_input_specs, cat_pieces, reshape_spec, strided_slice_input_spec


def view_backward(node: fx.Node, links: LinksRule | None, spec: DimShard, tp: int) -> list:
    """The input's dims that the split output dim's group came from (``reshape_spec`` reversed)."""
    x, out = node.args[0], shape_of(node)
    moved = reshape_spec(spec, out, shape_of(x), tp)
    if moved is None:
        raise ShardingError(f"{describe(node)}: reshape {out} cannot keep dim {spec.dim} split over tp={tp}")
    return [(x, moved)]


def linked_backward(node: fx.Node, links: LinksRule | None, spec: DimShard, tp: int) -> list | None:
    """Each input split along the dim linked to the split output dim (None: broadcast along it,
    read whole). An input dim ``k`` times smaller (grouped K/V heads) is split ``k`` times
    smaller, or, when tp does not divide it, is ``CUT``."""
    try:
        linked, forbidden = links(node)
    except KeyError:  # no links for this call (repeat_interleave by a tensor)
        return None
    out = output_shape(node)
    if spec.dim in forbidden:
        raise ShardingError(f"{describe(node)} reduces, normalizes or contracts dim {spec.dim}, which is split")
    result: list[tuple[fx.Node, object]] = []
    for arg, mapping in linked:
        d = mapping.get(spec.dim)
        if d is None:
            result.append((arg, None))
            continue
        if not -len(shape_of(arg)) <= d < len(shape_of(arg)):  # a rule that does not fit this call
            raise ShardingError(f"{describe(node)}: no dim of its input {arg.name} follows the split dim {spec.dim}")
        size = shape_of(arg)[d]
        if size == out[spec.dim]:
            result.append((arg, DimShard(d, spec.segments)))
        elif out[spec.dim] % size == 0:
            try:
                result.append((arg, _scaled(spec, out[spec.dim] // size, d, tp, node)))
            except ShardingError:
                result.append((arg, CUT))
        else:
            raise ShardingError(f"{describe(node)}: dim {d} of size {size} does not line up with {out[spec.dim]}")
    return result


def _scaled(spec: DimShard, ratio: int, dim: int, tp: int, node: fx.Node) -> DimShard:
    """A dim ``ratio`` times smaller than the output's (grouped K/V heads)."""
    segs = []
    for start, length in spec.segments:
        if start % ratio or length % ratio or (length // ratio) % tp:
            raise ShardingError(
                f"{describe(node)}: {length // max(ratio, 1)} grouped heads cannot be split over tp={tp}"
            )
        segs.append((start // ratio, length // ratio))
    return DimShard(dim, tuple(segs))


def slice_backward(node: fx.Node, links: LinksRule | None, spec: DimShard, tp: int) -> list | None:
    """A strided slice of the whole dim (``x[..., 1::2]``) split along it: ``x`` split in segments
    ``k`` times longer (``geometry.strided_slice_input_spec``); any other slice: by its links."""
    wanted = strided_slice_input_spec(node, spec, tp)
    if wanted is not None:
        return [(node.args[0], wanted)]
    return linked_backward(node, links, spec, tp)


def cat_backward(node: fx.Node, links: LinksRule | None, spec: DimShard, tp: int) -> list:
    """Split along the concatenated dim in segments that each lie inside one input: every input
    split in its own segments (``geometry.cat_input_specs``); any other dim: by its links."""
    if spec.dim == cat_pieces(node)[0]:
        return list(cat_input_specs(node, spec))
    return linked_backward(node, links, spec, tp)
