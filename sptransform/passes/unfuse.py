"""A projection taken apart after it ran becomes one linear per piece, on the weight rows it reads.

Multi-query attention fuses the query heads with the one K/V head in a single projection
(Falcon's ``query_key_value``, GPT-BigCode's ``c_attn``) and takes its output apart:

    before:  y = linear(x, W)                      # W [(H + 2) * d, D]
             v = view(y, [b, s, H + 2, d])
             q = slice(v, 2, 0, -2); k = index(v, [.., .., [-2]]); v1 = index(v, [.., .., [-1]])
    after:   q = view(linear(x, slice(W, 0, 0, H * d)), [b, s, H, d])
             k = view(linear(x, slice(W, 0, H * d, (H + 1) * d)), [b, s, 1, d])
             v1 = view(linear(x, slice(W, 0, (H + 1) * d, (H + 2) * d)), [b, s, 1, d])

Each piece is then a linear of its own, reading rows of ``W``: the query heads' can be
column-parallel while the K/V head, which every query head reads and no split divides, runs
whole (``graph.analysis`` splits a parameter read in pieces, some pieces whole). Every output
element is the same dot product of the same operands as before.

The output may pass through ops that keep each feature apart (an ``unsqueeze``, a ``view`` that
splits the features into groups of ``d``, casts, elementwise ops of it alone, transposes, a slice
along another dim, a depthwise convolution with the features as channels) before it is taken
apart along the features (or groups) by ``slice``, ``split``/``split_with_sizes`` or ``index``
with a constant run of indices, and a piece may be taken apart again the same way; the pieces
must tile the rows. Those ops are replayed on each piece, a convolution with its channels'
filters and one group per channel. A Mamba-2 mixer:

    before:  g, xbc, dt = split(linear(u, W), [I, C, H]); c = conv1d(xbc.T, F, b, groups=C).T
             x, B, C_ = split(c, [I, N, N])
    after:   g = linear(u, W[0:I]); dt = linear(u, W[I+C:])
             x = conv1d(linear(u, W[I:2I]).T, F[0:I], b[0:I], groups=I).T     # B, C_ alike

Matching (``projection_pieces``) is separate from the rewrite (``unfuse``). ``unfused_analysis``
asks for it only for projections the analysis left whole, on a copy of the graph it keeps only
when the next analysis splits a piece.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from sptransform.graph.analysis import analyze
from sptransform.graph.nodes import forward_closure, packet, shape_of
from sptransform.graph.rules import ShardingError

aten = torch.ops.aten

_WEIGHT_VIEWS = {aten.t, aten.transpose, aten.permute, aten.alias, aten.detach, aten.numpy_T, aten.mT}
_RESHAPES = {aten.view, aten.reshape, aten._unsafe_view}


@dataclass(frozen=True)
class Step:
    """One op between the projection and a piece, replayed on the piece: ``node``; ``dim``, the dim
    of its output that carries the features, ``rows`` weight rows per element of it; ``base``, the
    weight row its input's first feature comes from (a convolution's channels are counted from it)."""

    node: fx.Node
    dim: int
    rows: int
    base: int = 0


@dataclass(frozen=True)
class Pieces:
    """A projection (``node``: ``linear``/``matmul``/``mm`` of an activation by a weight read through
    ``weight_views`` from ``weight``, rows along ``out_dim``) and how its output is taken apart:
    ``readers`` -> ``(start, end, steps)``, the weight rows each reads and the ops between
    (views, casts, elementwise ops, a depthwise convolution) that its piece goes through."""

    node: fx.Node
    weight: fx.Node
    weight_arg: int
    weight_views: tuple[fx.Node, ...]
    out_dim: int
    bias_arg: int | None
    readers: tuple[tuple[fx.Node, int, int, tuple[Step, ...]], ...]


def projection_pieces(node: fx.Node, weight: fx.Node, out_dim: int, constants: dict[fx.Node, torch.Tensor]) -> Pieces | None:
    """How the output of the linear ``node`` (weight parameter ``weight``, output features along its
    ``out_dim``, and along the output's last dim) is taken apart, or None if it is not (see the module
    docstring). ``constants``: placeholder -> real value, for constant indices."""
    p = packet(node)
    if p is aten.linear:
        weight_arg, bias_arg = 1, (2 if len(node.args) > 2 and node.args[2] is not None else None)
    elif p in (aten.matmul, aten.mm):
        weight_arg, bias_arg = 1, None
    else:
        return None
    views: list[fx.Node] = []
    w = node.args[weight_arg]
    while isinstance(w, fx.Node) and packet(w) in _WEIGHT_VIEWS:
        views.append(w)
        w = w.args[0]
    if w is not weight or len(shape_of(weight) or ()) != 2 or any(len(v.users) != 1 for v in views):
        return None
    if bias_arg is not None and not _is_placeholder_vector(node.args[bias_arg], shape_of(weight)[out_dim]):
        return None
    out = shape_of(node)
    rows = shape_of(weight)[out_dim]
    if out is None or out[-1] != rows:
        return None
    readers = _pieces_of(node, len(out) - 1, 1, 0, (), constants, depth=0)
    if readers is None:
        return None
    bounds = sorted((a, b) for _, a, b, _ in readers)
    if len(bounds) < 2 or bounds[0][0] != 0 or bounds[-1][1] != rows or any(
            b0 != a1 for (_, b0), (a1, _) in zip(bounds, bounds[1:])) or any(a >= b for a, b in bounds):
        return None  # the pieces must tile the rows, each taken once
    return Pieces(node, weight, weight_arg, tuple(reversed(views)), out_dim, bias_arg, tuple(readers))


def _pieces_of(cur: fx.Node, dim: int, per: int, base: int, steps: tuple[Step, ...], constants,
               depth: int) -> list[tuple[fx.Node, int, int, tuple[Step, ...]]] | None:
    """The pieces ``cur`` (features along ``dim``, ``per`` weight rows each, the first from row
    ``base``) is taken apart into, through the ops that keep its features apart, each piece taken
    apart again where it is; None if ``cur`` is not taken apart."""
    while len(cur.users) == 1:
        (user,) = cur.users
        found = _step(user, dim, per, base)
        if found is None:
            break
        steps = (*steps, found)
        cur, dim, per = user, found.dim, found.rows
    if not cur.users or depth > 3:
        return None
    size = shape_of(cur)[dim]
    out: list[tuple[fx.Node, int, int, tuple[Step, ...]]] = []
    for user in cur.users:
        taken = _taken(user, cur, dim, size, constants)
        if taken is None:
            return None
        for reader, a, b in taken:
            start, end = base + a * per, base + b * per
            inner = _pieces_of(reader, dim, per, start, steps, constants, depth + 1)
            out.extend(inner if inner is not None else [(reader, start, end, steps)])
    return out


def _step(user: fx.Node, dim: int, per: int, base: int) -> Step | None:
    """``user`` as an op that keeps each feature apart (a view, a cast, an elementwise op of it
    alone, a transpose, a slice along another dim, a depthwise convolution over the features as
    channels); None if it is anything else."""
    p = packet(user)
    x = user.args[0] if user.args else None
    if not isinstance(x, fx.Node) or shape_of(user) is None:
        return None
    ndim = len(shape_of(x))
    if p in (aten.transpose,):
        d0, d1 = (d % ndim for d in user.args[1:3])
        return Step(user, d1 if dim == d0 else d0 if dim == d1 else dim, per, base)
    if p is aten.permute:
        order = [d % ndim for d in user.args[1]]
        return Step(user, order.index(dim), per, base)
    if p is aten.slice:
        d = (user.args[1] if len(user.args) > 1 else 0) % ndim
        return Step(user, dim, per, base) if d != dim else None
    if p in _ELEMENTWISE or p in (aten.to, aten._to_copy, aten.contiguous, aten.clone, aten.alias):
        others = [a for a in user.all_input_nodes if a is not x]
        return Step(user, dim, per, base) if not others and shape_of(user) == shape_of(x) else None
    if p in (aten.conv1d, aten.conv2d) and dim == 1 and _depthwise(user):
        return Step(user, dim, per, base)
    found = _view_step(user, dim, per)
    return Step(found.node, found.dim, found.rows, base) if found is not None else None


_ELEMENTWISE = frozenset({aten.silu, aten.gelu, aten.relu, aten.sigmoid, aten.tanh, aten.neg, aten.exp,
                          aten.softplus, aten.mish, aten.hardswish, aten.square, aten.abs})


def _depthwise(node: fx.Node) -> bool:
    """A convolution of ``node.args[0]`` with one filter per channel (``groups`` = channels), its
    weight (maybe through views) and bias parameters."""
    x, w = node.args[0], node.args[1]
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    channels = shape_of(x)[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return (groups == channels and _param_of(w) is not None and shape_of(w)[0] == channels
            and (bias is None or _is_placeholder_vector(bias, channels)))


def _param_of(node) -> fx.Node | None:
    """The parameter placeholder ``node`` views (``squeeze``/``unsqueeze``/``view`` of it), if any."""
    while isinstance(node, fx.Node) and packet(node) in (aten.squeeze, aten.unsqueeze, aten.view, aten.reshape, aten.alias):
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr") else None


def _is_placeholder_vector(node, size: int) -> bool:
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr") and list(shape_of(node) or ()) == [size]


def _view_step(user: fx.Node, dim: int, per: int) -> Step | None:
    """``user`` as a view that keeps every dim but the features' (``dim``), which it may split
    into ``[groups, d]``; None if it is anything else."""
    p = packet(user)
    shape_in = shape_of(user.args[0])
    shape_out = shape_of(user)
    if shape_in is None or shape_out is None:
        return None
    if p is aten.unsqueeze:
        d = user.args[1] % len(shape_out)
        return Step(user, dim + 1 if d <= dim else dim, per)
    if p not in _RESHAPES:
        return None
    if list(shape_out) == list(shape_in):
        return Step(user, dim, per)
    before, after = list(shape_in[:dim]), list(shape_in[dim + 1:])
    extra = len(shape_out) - len(shape_in) - 1  # size-1 dims in front of [groups, d]: Falcon's one K/V group
    if extra < 0 or list(shape_out[:dim]) != before or list(shape_out[dim + extra + 2:]) != after \
            or any(n != 1 for n in shape_out[dim:dim + extra]):
        return None
    groups, d = shape_out[dim + extra], shape_out[dim + extra + 1]
    if groups * d != shape_in[dim]:
        return None
    requested = list(user.args[1])
    if any(v == -1 for i, v in enumerate(requested) if not dim <= i <= dim + extra):
        return None  # an inferred size elsewhere would change meaning when the groups change (a size-1 one would not)
    return Step(user, dim + extra, per * d)


def _taken(user: fx.Node, x: fx.Node, dim: int, size: int, constants) -> list[tuple[fx.Node, int, int]] | None:
    """The pieces of ``x`` (``(reader, start, end)`` along ``dim``) that ``user`` takes, or None."""
    p = packet(user)
    ndim = len(shape_of(x))
    if p is aten.slice and user.args[0] is x:
        d = user.args[1] if len(user.args) > 1 else 0
        start = user.args[2] if len(user.args) > 2 else 0
        end = user.args[3] if len(user.args) > 3 else None
        step = user.args[4] if len(user.args) > 4 else 1
        if d % ndim != dim or step != 1:
            return None
        start = 0 if start is None else (start + size if start < 0 else start)
        end = size if end is None else (end + size if end < 0 else end)
        start, end = max(0, min(start, size)), max(0, min(end, size))
        return [(user, start, end)]
    if p in (aten.split, aten.split_with_sizes) and user.args[0] is x:
        d = user.args[2] if len(user.args) > 2 else 0
        if d % ndim != dim:
            return None
        sizes = user.args[1]
        if isinstance(sizes, int):
            sizes = [min(sizes, size - a) for a in range(0, size, sizes)]
        out, at = [], 0
        by_index = {item.args[1]: item for item in user.users if item.target is operator.getitem}
        if len(by_index) != len(user.users):
            return None
        for i, n in enumerate(sizes):
            if i in by_index:
                out.append((by_index[i], at, at + n))
            at += n
        return out
    if p is aten.index and user.args[0] is x:
        indices = list(user.args[1])
        if len(indices) != dim + 1 or any(i is not None for i in indices[:dim]):
            return None
        value = _constant(indices[dim], constants)
        if value is None or value.dim() != 1 or value.numel() == 0 or value.is_floating_point():
            return None
        values = [int(v) + size if int(v) < 0 else int(v) for v in value.tolist()]
        if values != list(range(values[0], values[0] + len(values))) or not 0 <= values[0] < values[-1] + 1 <= size:
            return None
        return [(user, values[0], values[-1] + 1)]
    return None


def _constant(node, constants) -> torch.Tensor | None:
    while isinstance(node, fx.Node) and packet(node) in (aten.lift_fresh_copy, aten.clone, aten.detach, aten.alias):
        node = node.args[0]
    return constants.get(node) if isinstance(node, fx.Node) else None


def unfuse(gm: fx.GraphModule, pieces: Pieces) -> None:
    """Rewrite ``pieces``' projection as one linear per piece (see the module docstring); the ops
    between are replayed on each piece (a convolution on its channels' filters), and what the
    whole projection's output fed is erased."""
    graph = gm.graph
    node = pieces.node
    downstream = set(forward_closure([node]))
    for reader, start, end, steps in pieces.readers:
        with graph.inserting_before(node):
            w = _op(graph, aten.slice.Tensor, (pieces.weight, pieces.out_dim, start, end), like=node)
            for view in pieces.weight_views:
                w = _op(graph, view.target, (w, *view.args[1:]), view.kwargs, like=view)
            args = list(node.args)
            args[pieces.weight_arg] = w
            if pieces.bias_arg is not None:
                args[pieces.bias_arg] = _op(graph, aten.slice.Tensor, (node.args[pieces.bias_arg], 0, start, end), like=node)
            y = _op(graph, node.target, tuple(args), node.kwargs, like=node)
            for step in steps:
                y = _replay(graph, step, y, start, end)
        y.meta = {**reader.meta, "val": y.meta["val"]}
        reader.replace_all_uses_with(y)
    # the whole projection and the ops that took it apart, and the views of its weight and of
    # convolution filters that only they read
    inputs: list[fx.Node] = []
    for dead in reversed(list(graph.nodes)):
        if dead in downstream and not dead.users and dead.op == "call_function" and not dead.is_impure():
            inputs.extend(a for a in dead.all_input_nodes if a not in downstream)
            graph.erase_node(dead)
    erased: set[fx.Node] = set()
    while inputs:
        w = inputs.pop()
        if w not in erased and w.op == "call_function" and not w.users:
            inputs.extend(w.all_input_nodes)
            graph.erase_node(w)
            erased.add(w)


def _replay(graph: fx.Graph, step: Step, y: fx.Node, start: int, end: int) -> fx.Node:
    """``step``'s op on the piece ``y`` of weight rows ``[start, end)``."""
    args = list(step.node.args)
    args[0] = y
    p = packet(step.node)
    if p in _RESHAPES:
        shape = list(args[1])
        if shape[step.dim] != -1:
            shape[step.dim] = (end - start) // step.rows
        args[1] = shape
    elif p in (aten.conv1d, aten.conv2d):  # this piece's channels' filters, one group each
        lo, hi = (start - step.base) // step.rows, (end - step.base) // step.rows
        args[1] = _sliced(graph, args[1], lo, hi, step.node)
        if len(args) > 2 and args[2] is not None:
            args[2] = _op(graph, aten.slice.Tensor, (args[2], 0, lo, hi), like=step.node)
        while len(args) < 7:
            args.append([None, None, [1], [0], [1], 1][len(args) - 1])
        args[6] = hi - lo
    return _op(graph, step.node.target, tuple(args), step.node.kwargs, like=step.node)


def _sliced(graph: fx.Graph, w: fx.Node, lo: int, hi: int, like: fx.Node) -> fx.Node:
    """The views from a parameter to ``w`` replayed on its rows ``[lo, hi)``."""
    chain = []
    while w.op == "call_function":
        chain.append(w)
        w = w.args[0]
    out = _op(graph, aten.slice.Tensor, (w, 0, lo, hi), like=like)
    for view in reversed(chain):
        args = list(view.args)
        args[0] = out
        if packet(view) in _RESHAPES:
            shape = list(args[1])
            shape[0] = hi - lo
            args[1] = shape
        out = _op(graph, view.target, tuple(args), view.kwargs, like=view)
    return out


def _op(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, *, like: fx.Node) -> fx.Node:
    """A new node with its fake value computed from its inputs' (and ``like``'s source line)."""
    kwargs = dict(kwargs or {})
    new = graph.call_function(target, args, kwargs)
    values = fx.node.map_arg(args, lambda n: n.meta["val"])
    new.meta["val"] = target(*values, **kwargs)
    if "stack_trace" in like.meta:
        new.meta["stack_trace"] = like.meta["stack_trace"]
    return new


def unfused_analysis(captured, analysis, tp: int, exits=()):
    """``(graph, analysis)``: the captured graph with ``unfuse`` applied to every projection
    ``analysis`` left whole (no region, not the head) whose output is taken apart, and its
    analysis, when that splits one of their pieces (the query heads of a multi-query projection
    column-parallel, its one K/V head whole); None, ``captured.gm`` as it was, when there is none,
    it splits none, or the new analysis refuses (a piece's block that tp does not divide)."""
    original = captured.gm
    copied, node_of = fx.Graph(), {}
    output = original.graph.find_nodes(op="output")[0]
    copied.output(copied.graph_copy(original.graph, node_of), type_expr=output.type).meta = dict(output.meta)
    captured.gm = fx.GraphModule(original, copied)
    try:
        if _unfuse_whole_projections(captured, analysis, node_of):
            trial = analyze(captured, tp, exits)
            if any(lm.weight_piece is not None and lm.weight_name in trial.read_whole_rows
                   for r in trial.regions for lm in r.column_linears.values()):
                return captured.gm, trial
    except ShardingError:
        pass
    captured.gm = original
    return None


def _unfuse_whole_projections(captured, analysis, node_of: dict[fx.Node, fx.Node]) -> int:
    """``unfuse`` on ``captured.gm`` for every projection ``analysis`` (of the graph whose nodes
    ``node_of`` maps to it) left whole whose output is taken apart."""
    placed = {lm.node for r in analysis.regions for lm in r.rows} | {c for r in analysis.regions for c in r.columns}
    if analysis.head is not None:
        placed.add(analysis.head.node)
    constants = {node: captured.constants[name] for node, name in zip(captured.state_placeholders, captured.state_names)
                 if name in captured.constants}
    found = []
    for node, lm in analysis.linears.items():
        if node in placed or lm.weight_piece is not None or lm.per_group or lm.bias_piece is not None:
            continue
        pieces = projection_pieces(node_of[node], node_of[lm.weight], lm.out_dim, constants)
        if pieces is not None:
            found.append(pieces)
    for pieces in found:
        unfuse(captured.gm, pieces)
    if found:
        captured.gm.graph.lint()
        captured.gm.recompile()
    return len(found)
