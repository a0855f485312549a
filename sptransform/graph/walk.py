"""The walk that finds a tensor-parallel block: back from a row-parallel linear's input, asking
each op how its inputs must be split (``graph.rules``), to the column-parallel linears whose
output features carry the split. Several rows may be walked together (experts on the chunks of
one split; a linear that contracts the block's split tensor midway, Mamba's ``x_proj``), and the
blocks found are made disjoint. ``graph.analysis`` calls it for every linear."""

from __future__ import annotations

from collections import defaultdict
from typing import Container, Sequence

import torch
import torch.fx as fx

from sptransform.graph.findings import LinearMatch, Region
from sptransform.graph.nodes import MOVES_ONLY, describe, packet, routes, shape_of, unbacked_dims
from sptransform.graph.placement import DimShard, whole
from sptransform.graph.rules import (
    CUT, ShardingError, input_specs_for_output, is_getitem, is_split, reduces_into_alike_outputs, slice_bounds,
    slices_input_spec, split_input_spec,
)
from sptransform.graph.rules.forward import READS_METADATA_ONLY

aten = torch.ops.aten


_ATTENTION = (aten.scaled_dot_product_attention, aten.softmax, aten._softmax)


def trace_region(
    graph: fx.Graph, row: LinearMatch | Sequence[LinearMatch], linears: dict[fx.Node, LinearMatch],
    derived: set[fx.Node], tp: int, exits: Container[fx.Node] = (),
) -> Region:
    """Walk back from ``row``'s input asking each op how its inputs must be split; raise
    ``ShardingError`` if no column-parallel linear is reached.

    ``row`` may be several row-parallel linears walked together: experts run one after another
    on the chunks of one ``split`` of a shared tensor (JetMoE's ``inputs.split(expert_size)``)
    each read one chunk, so no single walk can carry a split past the ``split``, which needs
    every chunk's; together they can, and they form one block.

    Where a required split cannot be carried further back (a reshape that would split fewer
    K/V heads than tp, a norm over the split features, a parameter used per head), the walk
    stops there and records a cut: that tensor is computed whole and the placement
    propagation cuts it to the split its readers need. The region keeps the linears it did
    reach; the ones behind a cut run replicated. ``exits``: outputs that may read the region's
    split tensors (returned split: a KV cache's keys and values)."""
    rows = [row] if isinstance(row, LinearMatch) else list(row)
    row = rows[0]
    row_nodes = {r.node for r in rows}
    order = list(graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    pending: dict[fx.Node, DimShard] = {}
    chunk_pending: dict[fx.Node, dict[int, DimShard]] = defaultdict(dict)
    specs: dict[fx.Node, object] = {}
    columns: dict[fx.Node, DimShard] = {}
    cuts: list[tuple[fx.Node, DimShard]] = []

    def check(node: fx.Node, spec: DimShard) -> None:
        for _, length in spec.segments:
            if length % tp:
                raise ShardingError(f"{describe(node)}: a span of {length} along dim {spec.dim} cannot be split over tp={tp}")
        if node in pending and pending[node] != spec:
            raise ShardingError(f"{describe(node)} is needed split in two different ways")

    slice_pending: dict[fx.Node, list[tuple[fx.Node, DimShard]]] = defaultdict(list)
    for r in rows:
        x = r.input
        in_dim = r.input_dim % len(shape_of(x))
        start = whole(in_dim, shape_of(x)[in_dim])
        check(x, start)
        pending[x] = start
    last = max(position[r.input] for r in rows)
    for node in reversed(order[: last + 1]):
        if node in slice_pending:  # a fused output taken apart with slices: they are its segments
            pieces = slice_pending.pop(node)
            d = pieces[0][1].dim
            spec = slices_input_spec(shape_of(node)[d], d, [(slice_bounds(s)[1], sp) for s, sp in pieces], tp)
            sliced = {s for s, _ in pieces}
            try:
                if spec is None:
                    raise ShardingError(f"{describe(node)}: its slices cannot be split over tp={tp}")
                if any(u not in sliced and packet(u) not in READS_METADATA_ONLY for u in node.users):
                    # Read whole elsewhere too (Falcon's one K/V head taken by an index beside the
                    # query heads' slice): computed whole, the slices cut from it.
                    raise ShardingError(f"{describe(node)} is read whole beside its slices")
                check(node, spec)
                pending[node] = spec
            except ShardingError:
                cuts.extend((s, sp) for s, sp in pieces)
                for s, _ in pieces:
                    specs.pop(s, None)
        if is_split(node) and node in chunk_pending:
            try:
                spec = split_input_spec(node, chunk_pending.pop(node))
                if spec is not None:
                    check(node.args[0], spec)
            except ShardingError:
                cuts.append((node, None))
                continue
            specs[node] = spec
            if spec is not None:
                pending[node.args[0]] = spec
            continue
        if node not in pending:
            continue
        spec = pending.pop(node)
        if routes(node) or spec.dim in unbacked_dims(node):
            raise ShardingError(f"{describe(node)}: its shape depends on the data (token routing); it runs whole")
        if node in linears and node not in row_nodes:
            lm = linears[node]
            if spec.dim == lm.output_dim % len(shape_of(node)):
                columns[node] = spec
                specs[node] = spec
            elif (batch := _batch_dim(lm, spec.dim)) is not None:
                # Needed split along a dim the linear maps row by row (the heads of a per-head
                # projection, ``states [b, s, heads, d] @ W [d, r]``): it runs on its input's
                # rows split alike, its weight whole (its gradient summed over the ranks).
                try:
                    check(lm.input, DimShard(batch, spec.segments))
                except ShardingError:
                    cuts.append((node, spec))
                    continue
                specs[node] = spec
                pending[lm.input] = DimShard(batch, spec.segments)
            else:
                cuts.append((node, spec))  # needed split along a token dim: computed whole, cut
            continue
        if node not in derived:
            cuts.append((node, spec))
            continue
        if is_getitem(node):
            parent = node.args[0]
            if is_split(parent):
                chunk_pending[parent][node.args[1]] = spec
                specs[node] = spec
            elif reduces_into_alike_outputs(parent):
                try:  # max.dim's values: its outputs are split alike, so the op runs split
                    check(parent, spec)
                except ShardingError:
                    cuts.append((node, spec))
                    continue
                specs[node] = spec
                pending[parent] = spec
            else:
                cuts.append((node, spec))
            continue
        if packet(node) is aten.slice and spec.dim == slice_bounds(node)[0] and slice_bounds(node)[3] == 1:
            specs[node] = spec
            slice_pending[node.args[0]].append((node, spec))
            continue
        try:
            wanted = input_specs_for_output(node, spec, tp)
        except ShardingError:
            cuts.append((node, spec))  # the op cannot produce this split: computed whole, cut
            continue
        specs[node] = spec
        for arg, arg_spec in wanted:
            if arg_spec is None:
                continue
            if arg_spec is CUT:
                cuts.append((arg, None))  # e.g. fewer K/V heads than tp: those run whole, cut later
                continue
            try:
                check(arg, arg_spec)
            except ShardingError:
                cuts.append((arg, arg_spec))
                continue
            pending[arg] = arg_spec
    if pending:
        raise ShardingError(f"{describe(next(iter(pending)))} could not be reached walking back")
    if not columns and not any(packet(n) in _ATTENTION for n in specs):
        raise ShardingError(f"{describe(row.node)}: no column-parallel linear feeds it (the walk stopped at {[c.name for c, _ in cuts]})")
    # A split tensor that something outside the region reads whole (the statistics of a norm
    # over the features, a residual stream) means the walk crossed a block boundary.
    inside = set(specs) | row_nodes
    contracting: list[LinearMatch] = []
    outside: ShardingError | None = None
    attention = any(packet(n) in _ATTENTION for n in specs) or any(packet(n) in _ATTENTION for n, _ in cuts)
    crossed = False
    for node in specs:
        for user in node.users:
            if isinstance(specs[node], DimShard) and _statistic(node, user, specs[node].dim):
                # sum(x * x) over the split features (a norm over the whole query projection, a
                # gated norm over a mixer's channels): a partial sum, reduced where it is read.
                # A walk from the head crosses the residual stream's norms the same way, into
                # every layer: such a block outside attention is kept only where it takes no
                # other block's linears (``non_overlapping_regions``)
                crossed = crossed or not attention
                continue
            if user not in inside and user not in exits and packet(user) not in READS_METADATA_ONLY:  # new_empty: dtype and device
                err = ShardingError(f"{describe(node)} is used outside the tensor-parallel region by {describe(user)}")
                lm = _linear_reading(node, user, linears)
                if lm is not None and isinstance(specs[node], DimShard):
                    # It may sum over the split features: a row of this block too (the walk
                    # again from its input checks that the split reaches it on its features).
                    contracting.append(lm)
                    outside = outside or err
                    continue
                raise err
    if contracting:
        raise ReadOnItsFeatures(str(outside), contracting)
    kind = "attention" if attention else "mlp"
    return Region(
        row=row, columns=columns, specs=specs, cuts=cuts, kind=kind,
        column_linears={n: linears[n] for n in columns}, more_rows=tuple(rows[1:]), crossed_statistic=crossed,
    )


_STATISTIC_STEPS = frozenset({aten.pow, aten.mul, aten.square, aten.abs, aten.to, aten._to_copy})
_STATISTIC_ENDS = frozenset({aten.sum, aten.mean})


def _statistic(node: fx.Node, user: fx.Node, dim: int) -> bool:
    """``user`` starts a statistic of ``node`` over its split ``dim``: elementwise steps on ``node``
    alone (a cast, ``pow(x, 2)``, ``x * x``) ending in a ``sum``/``mean`` that reduces ``dim`` (the
    mean square of an RMSNorm over the whole projection, OLMo-2's query and key norms). Its local
    value is a partial sum (``graph.rules.forward.reduction_forward``), reduced where it is read:
    the statistic is all that leaves the block, not the split tensor."""
    for _ in range(4):
        p = packet(user)
        if p in _STATISTIC_ENDS:
            n = len(shape_of(user.args[0]))
            dims = user.args[1] if len(user.args) > 1 and user.args[1] is not None else list(range(n))
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
            return dim in {d % n for d in dims}
        if p not in _STATISTIC_STEPS or any(a is not node for a in user.all_input_nodes) or len(user.users) != 1:
            return False
        if shape_of(user) != shape_of(node):
            return False
        node, user = user, next(iter(user.users))
    return False


def _linear_reading(node: fx.Node, user: fx.Node, linears: dict[fx.Node, LinearMatch]) -> LinearMatch | None:
    """The linear that reads ``node`` as its activation, directly or through views and moves
    that read nothing else (``params_proj(u.transpose(1, 2))``), if ``user`` leads to one."""
    while user not in linears:
        if packet(user) not in MOVES_ONLY or len(user.users) != 1 or user.args[0] is not node:
            return None
        node, user = user, next(iter(user.users))
    lm = linears[user]
    return lm if lm.weight_piece is None and lm.input is node else None


class ReadOnItsFeatures(ShardingError):
    """The block's split tensor is read by linears that contract over the split features (Mamba's
    ``x_proj`` reads the convolved channels that ``out_proj`` also reads): walked again with them
    as rows of the block, their outputs partial sums reduced where they are read."""

    def __init__(self, message: str, linears: list[LinearMatch]):
        super().__init__(message)
        self.linears = linears


def walk_with_inner_rows(graph: fx.Graph, lm: LinearMatch, err: ShardingError, linears: dict[fx.Node, LinearMatch],
                          derived: set[fx.Node], tp: int, exits: Container[fx.Node]) -> Region | None:
    """The block of ``lm`` with the linears that read its split tensor on their input features
    as more rows (``err`` names them), or None if no such block walks at tp=1 and ``tp``."""
    rows = [lm]
    for _ in range(8):  # each retry adds at least one row; a block has few
        if not isinstance(err, ReadOnItsFeatures):
            return None
        rows += [r for r in err.linears if r not in rows]
        try:
            trace_region(graph, rows, linears, derived, 1, exits)
        except ShardingError as again:
            err = again
            continue
        try:
            return trace_region(graph, rows, linears, derived, tp, exits)
        except ShardingError:
            return None
    return None


def walks(graph: fx.Graph, lm: LinearMatch, linears: dict[fx.Node, LinearMatch], derived: set[fx.Node],
           tp: int) -> bool:
    """Whether the region walk back from ``lm`` succeeds at ``tp``."""
    try:
        trace_region(graph, lm, linears, derived, tp)
    except ShardingError:
        return False
    return True


def rows_on_one_split(graph: fx.Graph, failed: list[LinearMatch]) -> list[list[LinearMatch]]:
    """Linears whose walks failed and that read chunks of one ``split`` (the same tensor cut
    into per-expert row groups): candidates for one block walked from all of them."""
    groups: dict[fx.Node, list[LinearMatch]] = defaultdict(list)
    for lm in failed:
        if lm.weight_piece is None and is_getitem(lm.input) and is_split(lm.input.args[0]):
            groups[lm.input.args[0]].append(lm)
    return [group for group in groups.values() if len(group) > 1]


def non_overlapping_regions(regions: list[Region], failures: dict[fx.Node, ShardingError]) -> list[Region]:
    """A linear is either a block's row-parallel end or a column of another block, not both: a
    low-rank gate ``g_b(g_a(x))`` pairs into a block of its own while ``g_b`` also feeds the
    attention whose walk back from its output projection reached it; an attention's output
    projection is also a "column" of the head when the walk back from the head crosses the
    residual; a per-head projection by a matrix all heads share (``states @ bank``, run split
    along the heads inside an attention block) also pairs with the linear making ``states``.
    Blocks are kept greedily, the one with most column linears first (ties: in graph order),
    those whose walk crossed a norm's statistic outside attention last (a walk from the head
    crosses every layer's): a block whose row linear is a kept block's column, or whose column
    is a kept block's row or column, is dropped (its linears run as the kept block says, or whole),
    its reason recorded for ``explain()``."""
    kept: set[int] = set()
    rows: set[fx.Node] = set()
    columns: set[fx.Node] = set()
    for i in sorted(range(len(regions)), key=lambda i: (regions[i].crossed_statistic, -len(regions[i].columns))):
        region = regions[i]
        its_rows = {lm.node for lm in region.rows}
        if its_rows & columns or rows & set(region.columns) or columns & set(region.columns):
            for node in its_rows:
                failures[node] = ShardingError(
                    f"{describe(node)}: its block shares a linear with a larger block, which takes its split")
            continue
        kept.add(i)
        rows |= its_rows
        columns |= set(region.columns)
    return [r for i, r in enumerate(regions) if i in kept]


def _batch_dim(lm: LinearMatch, dim: int) -> int | None:
    """The input dim that output dim ``dim`` of the linear ``lm`` maps row by row, when it is
    not a token dim: the input and output have one rank, the dim is neither the contracted nor
    the produced one, its size is the same on both sides, and the input leads with at least two
    more dims (the tokens: batch and sequence, which stay whole in a region; a split along them
    is sequence parallelism's, computed whole here and cut)."""
    out, x = shape_of(lm.node), shape_of(lm.input)
    if lm.per_group or out is None or x is None or len(out) != len(x) or len(x) < 4:
        return None
    if dim in (lm.output_dim % len(out), lm.input_dim % len(x)) or dim < 2 or out[dim] != x[dim]:
        return None
    return dim
