"""Shared rewriting helpers: give a node the local shape of its split output.

    before:  v = view(h, [2, 4, 2, 8])                  # h split along dim 2 over tp=2
    after:   v = view(h, [2, 4, 1, 8])                  # meta["sptransform_spec"]: the split

    before:  y = conv1d(x, w, b, 1, [3], 1, 8)         # depthwise: groups = channels = 8, split over tp=2
    after:   y = conv1d(x, w, b, 1, [3], 1, 4)         # x, w, b: this rank's 4 channels
                                                        # (grouped: 16 channels in 8 groups -> 4 groups)

    before:  a, b = split(h, 8, 2)                      # h: [q|k], each piece split over tp=2
    after:   a, b = split_with_sizes(h, [4, 4], 2)

Edit the node in place and write ``node.meta["sptransform_spec"]``; ``index_table`` adds a
buffer of each rank's indices along a split dim, read by a ``get_attr``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from sptransform.graph.placement import DimShard
from sptransform.graph.nodes import packet, shape_of
from sptransform.graph.rules import GROUPS_ARG, split_dim, split_output_specs
from sptransform.graph.rules.links import group_size

aten = torch.ops.aten

_SIZE_ARG = {aten.view: 1, aten.reshape: 1, aten._unsafe_view: 1, aten.expand: 1, aten.broadcast_to: 1}
_FACTORY_SIZE_ARG = {aten.new_zeros: 1, aten.new_ones: 1, aten.new_empty: 1, aten.new_full: 1,
                     aten.zeros: 0, aten.ones: 0, aten.empty: 0, aten.full: 0}


def local_shape(node: fx.Node, spec: DimShard, tp: int) -> list[int]:
    shape = list(shape_of(node))
    shape[spec.dim] = spec.local_size(tp)
    return shape


def localize(node: fx.Node, spec: DimShard | None, tp: int) -> None:
    """Rewrite the size arguments of ``node`` so it produces its local shard.

    Ops without size arguments (pointwise, matmul, norms, transposes) need nothing:
    they follow their inputs' local shapes."""
    if spec is None:
        return
    p = packet(node)
    node.meta["sptransform_spec"] = spec
    if p in _SIZE_ARG or p in _FACTORY_SIZE_ARG:
        index = _SIZE_ARG.get(p, _FACTORY_SIZE_ARG.get(p))
        args = list(node.args)
        args[index] = local_shape(node, spec, tp)
        node.args = tuple(args)
    elif p in GROUPS_ARG and spec.dim == 1 and group_size(node) is not None:  # the local channels' groups
        # a grouped conv names its groups, by position or keyword
        index, groups = GROUPS_ARG[p], spec.local_size(tp) // group_size(node)
        if len(node.args) > index:
            node.args = (*node.args[:index], groups, *node.args[index + 1:])
        else:
            node.kwargs = {**node.kwargs, "groups": groups}
    elif p is aten.unflatten:
        x, dim, sizes = node.args[:3]
        dim = dim % len(shape_of(x))
        shape = local_shape(node, spec, tp)
        node.args = (x, dim, shape[dim : dim + len(sizes)])


def localize_split(node: fx.Node, input_spec: DimShard, tp: int) -> list[DimShard]:
    """Rewrite a ``split`` on a split dim to local chunk sizes; returns each chunk's split."""
    chunk_specs = split_output_specs(node, input_spec)
    d = split_dim(node)
    if input_spec.dim == d:
        sizes = [s.local_size(tp) for s in chunk_specs]
        node.target = aten.split_with_sizes.default
        node.args = (node.args[0], sizes, d)
        node.kwargs = {}
    node.meta["sptransform_spec"] = input_spec
    return chunk_specs


def index_table(gm: fx.GraphModule, anchor: fx.Node, spec: DimShard, tp: int) -> fx.Node:
    """A ``[tp, n_local]`` buffer of each rank's indices along the split dim, read by a
    ``get_attr`` placed after ``anchor``."""
    table = torch.tensor([spec.indices(r, tp) for r in range(tp)], dtype=torch.long)
    name = f"_sptransform_index_{sum(1 for n in gm.graph.nodes if n.op == 'get_attr')}"
    while hasattr(gm, name):
        name += "_"
    gm.register_buffer(name, table, persistent=False)
    if anchor.op == "placeholder":
        # A user input cut to this rank's part (a float input joining the sequence-split
        # stream): what reads the table also reads the rank, the last placeholder, so the
        # table goes after every placeholder.
        anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(anchor):
        return gm.graph.get_attr(name)
