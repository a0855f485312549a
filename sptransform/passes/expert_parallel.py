"""Expert parallelism on the graph: each rank of an ``ep`` group stores ``E/ep`` of every routed
expert layer's experts and applies them to the tokens of all ``ep`` ranks (which train on
their own batches, as data-parallel replicas do): the static-shape dispatch, with no token
dropped and no shape that depends on the routing.

The regions come from ``graph.experts.find_expert_regions``; for each, every rank exchanges
the region's data inputs (all-gather: each rank's tokens, routing indices and weights), runs
the region once per source rank on that rank's data with its own experts (the pairs routed
elsewhere masked to zero), and the per-source results are reduce-scattered, so each rank gets
its own tokens' outputs summed over the ranks that hold their experts:

    before:  g = index(w, [idx]); h = bmm(g, x); ...; z = sum(view(y, [T, k, H]), [1])
             out = add(residual, z)
    after:   X = gather_seq(unsqueeze(x, 0), 0, ep)          # [ep, ...] every rank's x
             I = gather_seq(unsqueeze(idx, 0), 0, ep)        # (and every other data input)
             # for s in 0..ep-1, on source rank s's data:
             i_s = select(I, 0, s); m_s = (i_s >= lo) & (i_s < hi)
             g_s = index(w_local, [where(m_s, i_s - lo, 0)])  # this rank's experts only
             h_s = bmm(g_s, select(X, 0, s)); ...
             z_s = sum(view(where(m_s, y_s, 0), [T, k, H]), [1])
             z = squeeze(scatter_seq(stack([z_0, ..., z_{ep-1}]), 0, ep), 0)
             out = add(residual, z)

A grouped matmul of the experts, ``grouped_mm(x, w, offs)`` (rows sorted by expert, rows
``[offs[e-1], offs[e])`` through expert ``e``), runs this rank's experts on its own rows only:
the rows of ``[a, b) = [offs[lo-1], offs[hi-1])`` are turned to the front, and the local offsets
end at ``b - a`` (rows in no group are zeroed before and after, as a kernel may leave them
uninitialised):

    before:  y = grouped_mm(xs, w, offs)                       # w [E, K, N], xs [S, K]
    after:   r = arange(S); a, b = offs_s[lo-1], offs_s[hi-1]   # (a = 0 on the first rank: no turn)
             k = (r < b - a)[:, None]
             t = where(k, index(select(XS, 0, s), [(r + a) % S]), 0)
             y_s = index(where(k, grouped_mm(t, w_local, offs_s[lo:hi] - a), 0), [(r - a) % S])
             m_s = (r >= a) & (r < b)                           # the rows it owns

A matmul batched over the experts, ``bmm(x [E, T, K], w [E, K, N])`` (or its ``matmul`` or
``einsum("etk,ekn->etn")``; every expert on every token, Llama 4's experts), runs this rank's
experts' rows of ``x`` by its local experts; the result keeps its shape, the other rows zero
(masked like any owned rows after); a per-expert bias broadcast into those rows is padded back
to ``E`` rows where the graph starts:

    before:  y = bmm(x, w)                                      # x [E, T, K] from the tokens
    after:   y_s = constant_pad_nd(bmm(slice(x_s, 0, lo, hi), w_local), [0, 0, 0, 0, lo, E - hi])
             m_s = (arange(E) >= lo) & (arange(E) < hi)

Forward, a rank sends its data inputs to the other ``ep - 1`` ranks and receives theirs, and
reduce-scatters ``ep`` outputs; backward, the conjugates (``gather_seq``/``scatter_seq``) send
the gradients back the same way. The expert parameters' gradients are then this rank's
experts' gradients over every rank's tokens; the data-parallel pass averages them over the
ranks that hold the same experts (``DataParallelPlan.expert_group``). Edits ``gm`` in place;
new nodes carry ``val`` (a copy's is its original's: the same shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from sptransform.graph.experts import OWNED, SHAPE_ONLY, ExpertRegion, is_bmm_seed, region_args, seed_input
from sptransform.graph.nodes import is_grouped_mm, packet, shape_of, tensor_val
from sptransform.runtime.collectives import copy_to_tp, gather_seq, reduce_from_tp, scatter_seq
from sptransform.runtime.ops import take_local

aten = torch.ops.aten


@dataclass(frozen=True)
class ExpertGroups:
    """Where a rank's experts live: its expert-parallel group and the group of ranks holding the same experts."""

    group: str
    """The expert-parallel process group's name (``ep`` ranks, each with its own batch)."""
    rank: int
    """This rank's position in ``group``."""
    replicas: str
    """The process group of the ``dp / ep`` ranks that hold the same experts (their gradients' average)."""


@dataclass(frozen=True)
class ExpertParallelPlan:
    group: str
    """The expert-parallel process group's name (ranks that split one set of experts)."""
    size: int
    rank: int
    """This rank's position in the group: it holds experts ``[rank * E/size, (rank + 1) * E/size)``."""
    experts: dict[str, int]
    """Expert parameter FQN -> the number of experts (its dim 0, whole)."""


def tensor_parallel_dims(node: fx.Node) -> tuple[int, ...] | None:
    """For ``graph.experts.find_expert_regions(emitted=)``: the tensor-parallel calls an expert
    region may hold when ``tp > 1`` splits the experts' hidden dims too. Each is linear in its first
    argument and keeps its rows, and the ranks of a tensor-parallel group run the same copies of a
    region in the same order (one ep group per tensor-parallel index, every member's tokens the
    same on its tp peers), so an all-reduce inside a copy pairs the same rows on every peer."""
    if node.op != "call_function":
        return None
    if node.target is copy_to_tp or node.target is reduce_from_tp:
        return ()
    if node.target is take_local:
        value = tensor_val(node.args[0])
        return (node.args[1] % value.ndim,) if value is not None else None
    return None


def _with_val(node: fx.Node, value) -> fx.Node:
    if value is not None:
        node.meta["val"] = value
    return node


def _fake(fn, *values):
    try:
        return fn(*values) if all(v is not None for v in values) else None
    except Exception:  # a value we cannot work out leaves the node without one (as capture may)
        return None


def expert_parallel(gm: fx.GraphModule, regions: list[ExpertRegion], params: dict[fx.Node, str],
                    plan: ExpertParallelPlan) -> fx.GraphModule:
    """Rewrite each region as the module docstring shows; ``params``: parameter placeholders -> FQN."""
    for region in regions:
        _rewrite(gm, region, params, plan)
    gm.graph.lint()
    gm.recompile()
    return gm


def _rewrite(gm: fx.GraphModule, region: ExpertRegion, params: dict[fx.Node, str], plan: ExpertParallelPlan) -> None:
    graph, ep = gm.graph, plan.size
    inside = set(region.state)
    env: list[dict[fx.Node, fx.Node]] = [{} for _ in range(ep)]
    gathered: dict[fx.Node, fx.Node] = {}
    selected: dict[tuple[fx.Node, int], fx.Node] = {}
    masks: list[fx.Node | None] = [None] * ep
    owners: list[fx.Node | None] = [None] * ep  # the expert of each row, by the first seed (checked against the others)
    masked: dict[tuple[fx.Node, int], fx.Node] = {}
    local: dict[tuple, object] = {}  # (copy's indices or offsets, E[, rows]) -> local indices or rows: once each

    def call(target, args, value=None) -> fx.Node:
        return _with_val(graph.call_function(target, tuple(args)), value)

    def mask_of(a: fx.Node, s: int) -> fx.Node:
        """Copy ``s``'s value of the owned node ``a`` with the rows of other ranks' experts zeroed."""
        if (a, s) not in masked:
            value = tensor_val(a)
            shape = list(shape_of(masks[s]) or ()) + [1] * (value.ndim - region.rows)
            cond = call(aten.view.default, (masks[s], shape))
            masked[(a, s)] = call(aten.where.ScalarOther, (cond, env[s][a], 0.0), value)
        return masked[(a, s)]

    def source(a: fx.Node, s: int, consumer_owned: bool) -> fx.Node:
        if a in inside:
            return env[s][a] if consumer_owned or region.state[a] != OWNED else mask_of(a, s)
        if a in gathered:
            if (a, s) not in selected:
                selected[(a, s)] = call(aten.select.int, (gathered[a], 0, s), tensor_val(a))
            return selected[(a, s)]
        return a  # the same on every rank

    if region.padded:
        _pad_broadcast_params(graph, region.padded, params, plan, call)
    for node in region.nodes:
        with graph.inserting_before(node):
            for a in region_args(node):
                if a in region.inputs and a not in gathered:
                    value = tensor_val(a)
                    up = call(aten.unsqueeze.default, (a, 0), _fake(lambda v: v.unsqueeze(0), value))
                    stacked = _fake(lambda v: v.unsqueeze(0).expand(ep, *v.shape).contiguous(), value)
                    gathered[a] = call(gather_seq, (up, 0, plan.group), stacked)
            owned = region.state[node] == OWNED
            for s in range(ep):
                if node in region.seeds and is_grouped_mm(node):
                    param = region.seeds[node]
                    x, offs = node.args[0], node.args[2]
                    rows_of, experts, count = source(offs, s, True), plan.experts[params[param]], shape_of(x)[0]
                    if (rows_of, experts, count) not in local:
                        own = local[(rows_of, experts, count)] = _local_offsets(rows_of, count, experts, plan,
                                                                                params[param], call)
                        masks[s] = own.mask if masks[s] is None else masks[s]
                        owners[s] = _same_rows(owners[s], own.owner, call)
                    env[s][node] = _own_rows_matmul(graph, node, source(x, s, True), local[(rows_of, experts, count)],
                                                    lambda a, s=s: source(a, s, True), call)
                elif node in region.seeds and is_bmm_seed(node):
                    param = region.seeds[node]
                    experts, x = plan.experts[params[param]], seed_input(node, param)
                    if ("bmm", experts) not in local:
                        local[("bmm", experts)] = _expert_rows(experts, x, plan, call)
                    mask, owner = local[("bmm", experts)]
                    masks[s] = mask if masks[s] is None else masks[s]
                    owners[s] = _same_rows(owners[s], owner, call)
                    env[s][node] = _own_experts_bmm(graph, node, x, source(x, s, True), experts, plan,
                                                    lambda a, s=s: source(a, s, True), call)
                elif node in region.seeds:
                    param = region.seeds[node]
                    idx, experts = source(node.args[1][0], s, True), plan.experts[params[param]]
                    if (idx, experts) not in local:
                        local[(idx, experts)], mask, owner = _local_indices(idx, experts, plan, params[param], call)
                        masks[s] = mask if masks[s] is None else masks[s]
                        owners[s] = _same_rows(owners[s], owner, call)
                    env[s][node] = call(aten.index.Tensor, (param, [local[(idx, experts)]]), tensor_val(node))
                elif packet(node) in SHAPE_ONLY:  # the shape as a list: the shape's tensor is not exchanged
                    env[s][node] = call(SHAPE_ONLY[packet(node)], (source(node.args[0], s, owned),
                                                                   list(shape_of(node.args[1]))), tensor_val(node))
                else:
                    copy = graph.node_copy(node, lambda a, s=s: source(a, s, owned))
                    copy.meta = dict(node.meta)
                    env[s][node] = copy
    position = {n: i for i, n in enumerate(graph.nodes)}
    for out in region.outputs:
        users = [u for u in out.users if u not in inside]
        first = min(users, key=position.__getitem__)
        with graph.inserting_before(first):
            value = tensor_val(out)
            pieces = [mask_of(out, s) if region.state[out] == OWNED else env[s][out] for s in range(ep)]
            stacked = call(aten.stack.default, (pieces, 0), _fake(lambda v: v.unsqueeze(0).expand(ep, *v.shape), value))
            reduced = call(scatter_seq, (stacked, 0, plan.group), _fake(lambda v: v.unsqueeze(0), value))
            result = call(aten.squeeze.dim, (reduced, 0), value)
        for user in users:
            user.replace_input_with(out, result)
    for node in reversed(region.nodes):
        graph.erase_node(node)


def _pad_broadcast_params(graph: fx.Graph, padded: list[fx.Node], params: dict[fx.Node, str],
                          plan: ExpertParallelPlan, call) -> None:
    """Each parameter of ``region.padded`` (this rank's ``E/ep`` rows stored) read as ``E`` rows:
    its rows padded back with zeros where the graph starts, so the views and broadcasts that read
    it keep their shapes (the other ranks' rows only reach rows the region masks)."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for param in padded:
        experts = plan.experts[params[param]]
        per_rank = experts // plan.size
        lo = plan.rank * per_rank
        value = tensor_val(param)
        with graph.inserting_before(first):
            pad = [0, 0] * ((value.ndim if value is not None else 1) - 1) + [lo, experts - lo - per_rank]
            whole = call(aten.constant_pad_nd.default, (param, pad, 0.0), value)
        param.replace_all_uses_with(whole, delete_user_cb=lambda user, whole=whole: user is not whole)


def _same_rows(owner: fx.Node | None, other: fx.Node, call) -> fx.Node:
    """The expert of each row of a region, by its first seed. A later seed whose rows are routed
    another way (the biases gathered by sorted expert ids beside a grouped matmul by offsets) must
    route them to the same experts, checked as it runs: the analysis cannot prove from dataflow that
    offsets count those ids. Every rank checks every source rank's rows against all the experts,
    so every rank of the group stops at the same check (none is left waiting in a collective)."""
    if owner is None or other is owner:
        return other if owner is None else owner
    flags = _fake(lambda v: v >= 0, tensor_val(owner))
    same = call(aten.all.default, (call(aten.eq.Tensor, (owner, other), flags),))
    call(aten._assert_async.msg, (same, "expert parallelism: two reads of one expert layer's weights route its rows to "
                                  "different experts (a grouped matmul's offsets do not count the expert ids its other "
                                  "expert tensors are gathered by); this model cannot be split by ep: use ep=1"))
    return owner


@dataclass(frozen=True)
class _OwnRows:
    """How one source rank's rows of a grouped matmul run through this rank's experts."""

    offsets: fx.Node
    """The local experts' offsets, counted from this rank's first row (``offs[lo:hi] - offs[lo-1]``)."""
    mask: fx.Node
    """Rows (in the matmul's order) routed to this rank's experts: ``offs[lo-1] <= r < offs[hi-1]``."""
    owner: fx.Node
    """Each row's expert (``E`` past the last group)."""
    turned: fx.Node
    """Rows in the order this rank computes them (``kept`` first), as a row index: ``(r + offs[lo-1]) % S``."""
    back: fx.Node
    """The inverse order: ``(r - offs[lo-1]) % S``."""
    kept: fx.Node
    """In the turned order, the rows this rank computes: ``r < offs[hi-1] - offs[lo-1]``."""


def _local_offsets(offs: fx.Node, rows: int, experts: int, plan: ExpertParallelPlan, name: str, call) -> _OwnRows:
    """This rank's experts ``[lo, hi)`` of ``name`` for a grouped matmul of ``rows`` rows (sorted by
    expert: its own rows are one contiguous range). The rows are turned so that its range comes
    first, and the local offsets end where it ends: the kernel computes only this rank's rows (the
    others are in no group; the rewrite zeroes them before and after, since a kernel may leave
    rows in no group uninitialised, in its output and in its input's gradient)."""
    per_rank = experts // plan.size
    lo = plan.rank * per_rank
    hi = lo + per_rank
    value = tensor_val(offs)
    kind = {"dtype": value.dtype if value is not None else torch.int32,
            "device": value.device if value is not None else None}
    flags = _fake(lambda v: v >= 0, value)
    # one device's grouped matmul: offsets nondecreasing within [0, rows] (else its groups overlap)
    bounded = call(aten.logical_and.default, (call(aten.ge.Scalar, (offs, 0), flags),
                                              call(aten.le.Scalar, (offs, rows), flags)), flags)
    steps = _fake(lambda v: v[1:] >= 0, value)
    rising = call(aten.ge.Tensor, (call(aten.slice.Tensor, (offs, 0, 1, experts)),
                                   call(aten.slice.Tensor, (offs, 0, 0, experts - 1))), steps)
    valid = call(aten.logical_and.default, (call(aten.all.default, (bounded,)), call(aten.all.default, (rising,))))
    call(aten._assert_async.msg, (valid, f"grouped matmul offsets of {name} are not nondecreasing within [0, {rows}]"))
    row_flags = _fake(lambda v: v.new_empty(rows, dtype=torch.bool), value)
    row_values = _fake(lambda v: v.new_empty(rows), value)
    index = call(aten.arange.start_step, (0, rows), row_values)
    index.kwargs = dict(kind)
    owner = call(aten.searchsorted.Tensor, (offs, index), _fake(lambda v: v.new_empty(rows, dtype=torch.int64), value))
    owner.kwargs = {"right": True}
    scalar = _fake(lambda v: v[0], value)
    end = call(aten.select.int, (offs, 0, hi - 1), scalar)
    mask = call(aten.lt.Tensor, (index, end), row_flags)
    local = call(aten.slice.Tensor, (offs, 0, lo, hi), _fake(lambda v: v[lo:hi], value))
    if lo == 0:  # this rank's rows come first already
        return _OwnRows(local, mask, owner, index, index, mask)
    start = call(aten.select.int, (offs, 0, lo - 1), scalar)
    mask = call(aten.logical_and.default, (call(aten.ge.Tensor, (index, start), row_flags), mask), row_flags)
    local = call(aten.sub.Tensor, (local, start), tensor_val(local))
    turned = call(aten.remainder.Scalar, (call(aten.add.Tensor, (index, start), row_values), rows), row_values)
    back = call(aten.remainder.Scalar, (call(aten.sub.Tensor, (index, start), row_values), rows), row_values)
    kept = call(aten.lt.Tensor, (index, call(aten.sub.Tensor, (end, start), scalar)), row_flags)
    return _OwnRows(local, mask, owner, turned, back, kept)


def _own_rows_matmul(graph: fx.Graph, node: fx.Node, x: fx.Node, own: _OwnRows, args, call) -> fx.Node:
    """``node`` (a grouped matmul) on this rank's rows of ``x`` only, its result in ``x``'s row order
    with every other row zero."""
    def rows(t: fx.Node, order: fx.Node) -> fx.Node:  # (the first rank's rows are not turned)
        return t if own.turned is own.back else call(aten.index.Tensor, (t, [order]), tensor_val(t))

    def zero_others(t: fx.Node) -> fx.Node:
        value = tensor_val(t)
        kept = call(aten.unsqueeze.default, (own.kept, -1), _fake(lambda v: v.unsqueeze(-1), tensor_val(own.kept)))
        return call(aten.where.ScalarOther, (kept, t, 0.0), value)

    mine = zero_others(rows(x, own.turned))  # zero: the gradient of a row in no group may be garbage
    copy = graph.node_copy(node, lambda a: mine if a is node.args[0] else own.offsets if a is node.args[2] else args(a))
    copy.meta = dict(node.meta)
    return rows(zero_others(copy), own.back)


def _expert_rows(experts: int, x: fx.Node, plan: ExpertParallelPlan, call) -> tuple[fx.Node, fx.Node]:
    """For a batched matmul over the experts (row ``e`` through expert ``e``): the mask of this
    rank's rows ``[lo, hi)`` and each row's expert."""
    per_rank = experts // plan.size
    lo = plan.rank * per_rank
    value = tensor_val(x)
    owner = call(aten.arange.start_step, (0, experts), _fake(lambda v: torch.arange(experts, device=v.device), value))
    owner.kwargs = {"dtype": torch.int64, "device": value.device if value is not None else None}
    flags = _fake(lambda v: v >= 0, tensor_val(owner))
    mask = call(aten.logical_and.default, (call(aten.ge.Scalar, (owner, lo), flags),
                                           call(aten.lt.Scalar, (owner, lo + per_rank), flags)), flags)
    return mask, owner


def _own_experts_bmm(graph: fx.Graph, node: fx.Node, x: fx.Node, mine: fx.Node, experts: int,
                     plan: ExpertParallelPlan, args, call) -> fx.Node:
    """``node`` (a matmul batched over the experts, ``x`` its rows) on this rank's experts' rows
    ``[lo, hi)`` of ``mine`` only, by the local experts; the other rows of the result zero (the
    same shape)."""
    per_rank = experts // plan.size
    lo = plan.rank * per_rank
    hi = lo + per_rank
    value = tensor_val(node)
    sliced = call(aten.slice.Tensor, (mine, 0, lo, hi), _fake(lambda v: v[lo:hi], tensor_val(mine)))
    copy = graph.node_copy(node, lambda a: sliced if a is x else args(a))
    copy.meta = dict(node.meta)
    if value is not None:
        copy.meta["val"] = _fake(lambda v: v[lo:hi], value)
    pad = [0, 0] * ((value.ndim if value is not None else 3) - 1) + [lo, experts - hi]  # (last dim first)
    return call(aten.constant_pad_nd.default, (copy, pad, 0.0), value)


def _local_indices(idx: fx.Node, experts: int, plan: ExpertParallelPlan, name: str,
                   call) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Indices into this rank's experts ``[lo, hi)`` of ``name`` (0 where another rank's expert is
    chosen), the mask of the pairs this rank's experts own, and each pair's expert in ``[0, E)``."""
    per_rank = experts // plan.size
    lo = plan.rank * per_rank
    value = tensor_val(idx)
    flags = _fake(lambda v: v >= 0, value)  # a bool tensor of idx's shape
    # w[idx] of one device: an index in [-E, E) (negative ones count from the end), else IndexError
    inside = call(aten.logical_and.default, (call(aten.ge.Scalar, (idx, -experts), flags),
                                             call(aten.lt.Scalar, (idx, experts), flags)), flags)
    call(aten._assert_async.msg, (call(aten.all.default, (inside,)), f"index out of range: the routing chose an expert "
                                  f"outside [-{experts}, {experts}) of {name}"))
    idx = call(aten.remainder.Scalar, (idx, experts), value)
    mask = call(aten.logical_and.default, (call(aten.ge.Scalar, (idx, lo), flags),
                                           call(aten.lt.Scalar, (idx, lo + per_rank), flags)), flags)
    shifted = call(aten.sub.Tensor, (idx, lo), value)
    return call(aten.where.ScalarOther, (mask, shifted, 0), value), mask, idx
