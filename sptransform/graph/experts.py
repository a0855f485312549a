"""Expert regions: the part of a graph that applies routed experts, found from dataflow, for
expert parallelism (``passes.expert_parallel``). Matching only; nothing here edits a graph.

A *seed* reads an expert parameter (``E`` experts along dim 0) that nothing else reads, in one
of three ways:

* a gather by routing indices, ``w[idx]`` (``aten.index.Tensor(w, [idx])``, transformers'
  ``batched_mm`` experts): its rows are the pairs of ``idx``;
* a grouped matmul, ``grouped_mm(x [S, K], w [E, K, N], offs [E])`` (``w`` possibly a transpose
  of the parameter's last two dims; transformers' default ``grouped_mm`` experts): rows
  ``[offs[e-1], offs[e])`` of ``x`` go through expert ``e``, so its rows are ``x``'s rows;
* a matmul batched over the experts, ``bmm(x [E, T, K], w [E, K, N])`` (or a ``matmul`` of two
  3-D tensors, or an ``einsum("etk,ekn->etn", x, w)`` whose operands and output lead with its
  batch letter; either operand the parameter, possibly through transposes or permutes that keep
  dim 0; Llama 4's experts, every expert on every token): row ``e`` of ``x`` goes through expert ``e``.

With the experts split over ``ep`` ranks, a rank computes its own experts' rows exactly and
anything for the other rows (expert 0 of its own, say); every tensor computed from a seed is
then in one of two states:

* **owned**: its leading ``rows`` dims are the pairs of ``idx`` (one row per pair); the rows of
  pairs routed to this rank's experts are exact, the others garbage. Ops that compute each
  row from that row alone keep this (pointwise ops, the per-pair ``bmm``, a linear applied to
  each row, views, reductions and norms over the other dims).
* **partial**: the true value is the sum over the ``ep`` ranks. An owned tensor read by any
  other op is first masked (its garbage rows zeroed), which makes it partial; ops linear in
  it (scaling by a routing weight, views, sums over the pairs, ``index_add`` into zeros,
  a matmul by something whole) keep it partial.

A partial tensor read by anything else (the residual add, a norm, the graph output) leaves the
region: the rewrite sums it over the ranks there. Region nodes that need none of these states
(``plain``) are the cheap, data-only ops pulled in so that fewer bytes are exchanged (a token
``repeat_interleave``'d per chosen expert: its tokens are exchanged, not the copies).

    w = placeholder                    # [E, 2I, H]                        (seed)
    g = index(w, [idx])                # [P, 2I, H]   owned
    h = bmm(g, x_pairs)                # owned
    a = mul(silu(h0), h1)              # owned (pointwise)
    d = bmm(index(w2, [idx]), a)       # owned
    y = mul(d, weights)                # owned (pointwise, weights whole)
    z = sum(view(y, [T, k, H]), [1])   # view changes the pair dims: y is masked -> partial
    out = add(residual, z)             # not linear in z: z is the region's output

What a rank gives the region from outside is either the same on every rank (parameters,
constants: ``shared``) or its own data (``inputs``: each rank's tokens and routing, exchanged
by the rewrite)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from sptransform.graph.nodes import (data_dependent, describe, is_grouped_mm, is_multi_output, is_random, packet,
                                     shape_of, tensor_val)
from sptransform.torch_internals import OpOverload, op_schema

aten = torch.ops.aten

OWNED, PARTIAL, PLAIN = "owned", "partial", "plain"


@dataclass(eq=False)
class ExpertRegion:
    seeds: dict[fx.Node, fx.Node]
    """Each seed (an expert gather ``index(w, [idx])`` or a grouped matmul) -> the parameter
    placeholder it reads."""
    index: fx.Node
    """What says the first seed's rows: its routing indices (a gather) or offsets (a grouped matmul)."""
    rows: int
    """Leading dims of an owned tensor that are the token-expert pairs (``index``'s ndim)."""
    state: dict[fx.Node, str] = field(default_factory=dict)
    """Region node -> ``OWNED``, ``PARTIAL`` or ``PLAIN``."""
    nodes: list[fx.Node] = field(default_factory=list)
    """The region's nodes in graph order."""
    inputs: list[fx.Node] = field(default_factory=list)
    """Outside tensors computed from the data: each rank's own, exchanged."""
    shared: list[fx.Node] = field(default_factory=list)
    """Outside values the same on every rank (parameters, buffers, constants)."""
    masked: set[fx.Node] = field(default_factory=set)
    """Owned nodes read where a partial value is wanted (a region node, or outside)."""
    outputs: list[fx.Node] = field(default_factory=list)
    """Owned or partial nodes read outside the region (summed over the ranks there)."""
    padded: list[fx.Node] = field(default_factory=list)
    """Parameters of ``E`` rows (per-expert biases) broadcast into owned rows of a region whose
    seeds are matmuls batched over the experts: split like the experts, each rank's rows padded
    back to ``E`` with zeros where the graph reads them (``broadcast_expert_params``)."""


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _dims(value, ndim: int) -> list[int] | None:
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_norm(int(d), ndim) for d in items]


def _arg(node: fx.Node, position: int, name: str, default=None):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _ndim(node) -> int | None:
    shape = shape_of(node)
    return None if shape is None else len(shape)


def _inplace(node: fx.Node) -> bool:
    if not isinstance(node.target, OpOverload):
        return False
    schema = op_schema(node.target)
    return schema.name.endswith("_") and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


_VIEWS_SAME_ROWS = {aten.view, aten.reshape, aten._unsafe_view}
_COPIES = {aten.clone, aten.contiguous, aten.alias, aten.detach, aten._to_copy, aten.to, aten.type_as,
           aten.lift_fresh_copy}
_DIM_AT_1 = {aten.slice, aten.select, aten.narrow, aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax,
             aten.cumsum, aten.unbind}
_DIM_AT_2 = {aten.split, aten.split_with_sizes, aten.chunk, aten.unsafe_split}
_REDUCTIONS = {aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.argmax, aten.argmin, aten.var,
               aten.std, aten.logsumexp, aten.var_mean, aten.norm, aten.linalg_vector_norm, aten.prod, aten.all,
               aten.any}
_NORMS = {aten.native_layer_norm, aten.layer_norm, aten.rms_norm, aten._fused_rms_norm}


def rowwise(node: fx.Node, owned: set[fx.Node], rows: int) -> bool:
    """Whether ``node`` computes each of its output's first ``rows`` dims' rows from the same rows
    of its ``owned`` inputs alone (and keeps those dims first): an owned result stays owned."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return node.args[0] in owned
    if not isinstance(node.target, OpOverload):
        return False
    op, args = packet(node), node.args
    out, first = shape_of(node), args[0] if args else None
    in_shape = shape_of(first) if isinstance(first, fx.Node) else None
    lead = lambda s: None if s is None else tuple(s[:rows])  # noqa: E731
    if op in _COPIES or (op in _DROPOUTS and not _draws(node)):  # (a dropout that draws is refused)
        return first in owned
    if op in _VIEWS_SAME_ROWS:
        return first in owned and out is not None and in_shape is not None and lead(out) == lead(in_shape)
    if op is aten.unsqueeze:
        return first in owned and out is not None and _norm(args[1], len(out)) >= rows
    if op is aten.squeeze:
        if in_shape is None or first not in owned:
            return False
        dims = _dims(_arg(node, 1, "dim"), len(in_shape))
        return min(dims) >= rows if dims else all(s != 1 for s in in_shape[:rows])
    if op is aten.permute:
        return first in owned and in_shape is not None and _dims(args[1], len(in_shape))[:rows] == list(range(rows))
    if op is aten.transpose:
        return first in owned and in_shape is not None and min(_dims(args[1:3], len(in_shape))) >= rows
    if op is aten.expand:
        return first in owned and out is not None and in_shape is not None and len(out) == len(in_shape) \
            and lead(out) == lead(in_shape)
    if op in _DIM_AT_1 or op in _DIM_AT_2:
        position = 1 if op in _DIM_AT_1 else 2
        dim = _arg(node, position, "dim", 0)
        return first in owned and in_shape is not None and _norm(dim, len(in_shape)) >= rows \
            and not any(a in owned for a in node.all_input_nodes if a is not first)
    if op in _REDUCTIONS:
        dims = _dims(_arg(node, 1, "dim"), len(in_shape)) if in_shape is not None else None
        return first in owned and bool(dims) and min(dims) >= rows
    if op in _NORMS:
        normalized = args[1]
        return first in owned and in_shape is not None and len(normalized) <= len(in_shape) - rows \
            and not any(a in owned for a in node.all_input_nodes if a is not first)
    if op in (aten.cat, aten.stack):
        pieces = [t for t in args[0] if isinstance(t, fx.Node)]
        ndim = (len(out) if op is aten.stack else len(in_shape or ())) if out is not None else 0
        dim = _arg(node, 1, "dim", 0)
        reference = shape_of(pieces[0]) if pieces else None
        return out is not None and _norm(dim, ndim) >= rows and all(
            shape_of(t) is not None and lead(shape_of(t)) == lead(reference) for t in pieces)
    if op in (aten.bmm, aten.baddbmm):
        return rows == 1
    if op in (aten.mm, aten.addmm, aten.linear, aten.matmul):
        x, w = (args[1], args[2]) if op is aten.addmm else (args[0], args[1])
        if x not in owned or _ndim(x) is None or _ndim(x) <= rows:
            return False
        if w not in owned:
            return _ndim(w) is not None and _ndim(w) <= 2 and not any(
                a in owned for a in node.all_input_nodes if a is not x)
        return op is aten.matmul and _ndim(w) == _ndim(x) and _ndim(x) >= rows + 2
    if torch.Tag.pointwise in node.target.tags:
        return out is not None and all(_ndim(a) == len(out) and lead(shape_of(a)) == lead(out)
                                       for a in node.all_input_nodes if a in owned)
    return False


_LINEAR_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.view_as, aten.reshape_as, aten.expand_as, aten.permute, aten.transpose, aten.t, aten.unsqueeze,
                 aten.squeeze, aten.expand, aten.slice, aten.select, aten.narrow, aten.split, aten.split_with_sizes,
                 aten.chunk, aten.unbind, aten.clone, aten.contiguous, aten.alias, aten.flatten, aten.unflatten,
                 aten.movedim, aten.repeat, aten.repeat_interleave, aten.index, aten.index_select, aten.gather,
                 aten.neg, aten.sum, aten.mean, aten.cumsum, aten._to_copy, aten.to, aten.type_as, aten.detach}
_ZERO_MAKERS = {aten.zeros, aten.zeros_like, aten.new_zeros}
_FULL_MAKERS = {aten.full, aten.new_full, aten.full_like}


def is_zero(node) -> bool:
    """A tensor made of zeros (a sum's empty start): adding a partial tensor into it stays partial."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    op = packet(node)
    if op in _ZERO_MAKERS:
        return True
    if op in _FULL_MAKERS:
        fill = node.args[2] if op is aten.new_full else node.args[1]
        return isinstance(fill, (int, float)) and fill == 0
    return False


def linear_in_partial(node: fx.Node, partial: set[fx.Node]) -> bool:
    """Whether ``node``'s result is the sum over ranks of its results on each rank's ``partial``
    inputs (its other inputs the same on every rank): a partial result."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return node.args[0] in partial
    if not isinstance(node.target, OpOverload):
        return False
    op, args = packet(node), node.args
    inputs = node.all_input_nodes
    mine = [a for a in inputs if a in partial]
    if op in _LINEAR_VIEWS:
        value = tensor_val(node)
        if value is not None and not (value.is_floating_point() or value.is_complex()):
            return False
        return args[0] in partial and mine == [args[0]] * len(mine)
    if op is aten.mul or op is aten.div:
        tensors = [a for a in args[:2] if isinstance(a, fx.Node)]
        if op is aten.div:
            return args[0] in partial and not (isinstance(args[1], fx.Node) and args[1] in partial)
        return sum(t in partial for t in tensors) == 1
    if op in (aten.add, aten.sub):
        return all(isinstance(a, fx.Node) and (a in partial or is_zero(a)) for a in args[:2])
    if op in (aten.mm, aten.bmm, aten.matmul, aten.einsum) or (op is aten.linear and _arg(node, 2, "bias") is None):
        tensors = args[1] if op is aten.einsum else args[:2]
        return sum(isinstance(t, fx.Node) and t in partial for t in tensors) == 1
    if op in (aten.cat, aten.stack):
        return all(t in partial or is_zero(t) for t in args[0] if isinstance(t, fx.Node))
    if op in (aten.index_add, aten.scatter_add):
        source = args[3]
        return (args[0] in partial or is_zero(args[0])) and source in partial and args[2] not in partial
    if op is aten.index_put:
        accumulate = _arg(node, 3, "accumulate", False)
        return bool(accumulate) and (args[0] in partial or is_zero(args[0])) and args[2] in partial
    return False


def _index_root(node: fx.Node):
    """Routing indices compared through reshapes: two reshapes of one tensor to one shape are one mask."""
    start = node
    while node.op == "call_function" and packet(node) in _VIEWS_SAME_ROWS | {aten.clone, aten.contiguous, aten.alias}:
        node = node.args[0]
    return node, shape_of(start)


def expert_seeds(gm: fx.GraphModule, params: dict[fx.Node, str]) -> dict[fx.Node, list[fx.Node]]:
    """Parameters read only by routing gathers ``index(w, [idx])`` (a 1-element index list on dim 0,
    integer indices), only by grouped matmuls as their weight (``grouped_weight_reads``), or only
    by batched matmuls over their experts (``bmm_weight_reads``) -> those reads."""
    seeds = {}
    for param in params:
        value = tensor_val(param)
        if value is None or value.ndim < 2 or not param.users:
            continue
        gathers = [u for u in param.users
                   if u.op == "call_function" and u.target is aten.index.Tensor and u.args[0] is param
                   and len(u.args[1]) == 1 and isinstance(u.args[1][0], fx.Node)
                   and tensor_val(u.args[1][0]) is not None and not tensor_val(u.args[1][0]).is_floating_point()
                   and tensor_val(u.args[1][0]).dtype != torch.bool]
        if len(gathers) == len(param.users):
            seeds[param] = gathers
        elif (reads := grouped_weight_reads(param) or bmm_weight_reads(param)):
            seeds[param] = reads
    return seeds


def _keeps_experts(node: fx.Node) -> bool:
    """A transpose or permute of a 3-D tensor that keeps dim 0 (the experts) first."""
    if node.op != "call_function" or packet(node) not in (aten.transpose, aten.permute) or _ndim(node.args[0]) != 3:
        return False
    dims = _dims(list(node.args[1:3]), 3) if packet(node) is aten.transpose else _dims(node.args[1], 3)
    return 0 not in dims if packet(node) is aten.transpose else dims[0] == 0


def _weight_reads(param: fx.Node, is_read: Callable[[fx.Node, fx.Node], bool]) -> list[fx.Node] | None:
    """The ops ``is_read(op, node)`` that read the 3-D ``param`` as their expert weight, directly or
    through transposes/permutes that keep its experts on dim 0, when nothing else reads it."""
    if _ndim(param) != 3:
        return None
    reads, frontier = [], [param]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if is_read(user, node):
                reads.append(user)
            elif _keeps_experts(user) and user.args[0] is node:
                frontier.append(user)
            else:
                return None
    return reads


def grouped_weight_reads(param: fx.Node) -> list[fx.Node] | None:
    """The grouped matmuls that read the 3-D ``param`` as their weight (``_weight_reads``)."""
    return _weight_reads(param, lambda user, node: is_grouped_mm(user) and user.args[1] is node
                         and node not in (user.args[0], user.args[2]))


def bmm_weight_reads(param: fx.Node) -> list[fx.Node] | None:
    """The batched matmuls over the experts that read the 3-D ``param`` as one of their two
    operands (``_weight_reads``, ``is_batched_over_experts``): its experts are the batch."""
    return _weight_reads(param, lambda user, node: is_batched_over_experts(user)
                         and (_operands(user)[0] is node) != (_operands(user)[1] is node))


def _einsum_batch(node: fx.Node) -> bool:
    """``einsum("e..,e..->e..", a, b)``: two operands and the output all lead with one letter that
    appears nowhere else in them (each output row ``e`` from rows ``e`` of the operands alone)."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or len(operands) != 2 or "..." in equation or "->" not in equation:
        return False
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != 2 or not all(terms) or not output:
        return False
    letter = output[0]
    return all(t[0] == letter and t.count(letter) == 1 for t in terms) and output.count(letter) == 1


def is_batched_over_experts(node: fx.Node) -> bool:
    """A matmul batched along dim 0 of two operands: ``bmm``, a ``matmul`` of two 3-D tensors, or
    an ``einsum`` whose operands and output lead with its one batch letter (``_einsum_batch``)."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return False
    op = packet(node)
    if op is aten.bmm:
        return True
    if op is aten.matmul:
        return _ndim(node.args[0]) == 3 and _ndim(node.args[1]) == 3
    if op is aten.einsum and _einsum_batch(node):
        return all(isinstance(a, fx.Node) for a in node.args[1])
    return False


def _operands(seed: fx.Node) -> tuple[fx.Node, fx.Node]:
    return tuple(seed.args[1]) if packet(seed) is aten.einsum else tuple(seed.args[:2])


def _weight_root(node: fx.Node) -> fx.Node:
    while _keeps_experts(node):
        node = node.args[0]
    return node


def is_bmm_seed(seed: fx.Node) -> bool:
    """A seed that is a matmul batched over the experts (``is_batched_over_experts``); its rows are
    its other operand's dim 0."""
    return is_batched_over_experts(seed)


def seed_input(seed: fx.Node, param: fx.Node) -> fx.Node | None:
    """What a seed applies the experts to, row by row: a grouped matmul's ``x``, a batched matmul's
    other operand (its rows along dim 0, one per expert); ``None`` for a gather."""
    if is_grouped_mm(seed):
        return seed.args[0]
    if is_bmm_seed(seed):
        a, b = _operands(seed)
        return b if _weight_root(a) is param else a
    return None


def _seed_rows(seed: fx.Node, param: fx.Node) -> tuple[fx.Node, int]:
    """What says which rows of ``seed`` go through which expert, and how many leading dims are rows."""
    if is_grouped_mm(seed):
        return seed.args[2], 1
    if is_bmm_seed(seed):
        return seed_input(seed, param), 1
    idx = seed.args[1][0]
    return idx, _ndim(idx) or 1


def _kind(seed: fx.Node) -> str:
    return "grouped" if is_grouped_mm(seed) else "bmm" if is_bmm_seed(seed) else "gather"


def find_expert_regions(gm: fx.GraphModule, params: dict[fx.Node, str], data: set[fx.Node],
                        emitted: Callable[[fx.Node], tuple[int, ...] | None] | None = None,
                        ) -> tuple[list[ExpertRegion], list[str]]:
    """The expert regions of ``gm`` (module docstring) and the problems that keep one from being
    split (each naming the node). ``params``: parameter placeholders -> FQN; ``data``: nodes
    computed from the user's inputs (the rest is the same on every rank). ``emitted`` describes
    calls an earlier pass put in the graph (tensor-parallel collectives and cuts) that this
    module cannot read from an op schema: for one linear in its first argument whose result keeps
    that argument's dims, the dims it works along (``()`` for an all-reduce over other ranks that
    hold the same rows); ``None`` for any other call."""
    seeds = expert_seeds(gm, params)
    regions: dict[tuple, ExpertRegion] = {}
    where: dict[fx.Node, ExpertRegion] = {}
    for param, reads in seeds.items():
        for seed in reads:
            idx, rows = _seed_rows(seed, param)
            key = (_kind(seed), *_index_root(idx))
            region = regions.setdefault(key, ExpertRegion(seeds={}, index=idx, rows=rows))
            region.seeds[seed] = param
            region.state[seed] = OWNED
            where[seed] = region
    problems: list[str] = []
    for region in regions.values():
        counts = {shape_of(param)[0] for param in region.seeds.values()}
        if len(counts) > 1:
            problems.append(f"the expert tensors {sorted(p.name for p in region.seeds.values())} gathered by one routing "
                            f"index have different numbers of experts {sorted(counts)}")
        dynamic = [g for g, w in region.seeds.items() if data_dependent(_seed_rows(g, w)[0]) or data_dependent(g)
                   or seed_input(g, w) is not None and data_dependent(seed_input(g, w))]
        if dynamic:
            problems.append(f"{describe(dynamic[0])} applies experts to rows whose number depends on the data; expert "
                            "parallelism exchanges tensors of static shapes")
        groups = [g for g in region.seeds if is_grouped_mm(g) and shape_of(g.args[2]) != shape_of(region.seeds[g])[:1]]
        problems += [f"{describe(g)} reads {shape_of(region.seeds[g])[0]} experts with offsets of shape "
                     f"{list(shape_of(g.args[2]) or [])}: expert parallelism needs one offset per expert" for g in groups]
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node in where:
            x = seed_input(node, where[node].seeds[node])
            if x in where and where[x] is not where[node]:
                if where[x].rows != where[node].rows:
                    problems.append(f"{describe(node)} mixes the outputs of two expert layers routed by different "
                                    "indices")
                    continue
                _merge(where[x], where[node], where, regions)  # its rows are x's: checked alike as it runs
            if x in where and where[x].state[x] != OWNED:  # a sum over ranks is no input of one rank's experts
                problems.append(f"{describe(node)} applies the experts to a sum over the experts' ranks ({describe(x)}); "
                                "expert parallelism cannot split that")
            continue
        mine = {where[a] for a in node.all_input_nodes if a in where}
        if not mine:
            continue
        if len(mine) > 1:
            owned_all = {a for a in node.all_input_nodes if a in where and where[a].state[a] == OWNED}
            rows = {r.rows for r in mine}
            if len(rows) == 1 and owned_all == {a for a in node.all_input_nodes if a in where} \
                    and rowwise(node, owned_all, rows.pop()):
                # one layer's experts read two ways (a grouped matmul, a gather of its biases by the
                # sorted expert ids): one region, whose seeds' masks the rewrite checks are equal
                first, *rest = mine
                for other in rest:
                    _merge(first, other, where, regions)
            else:  # outside every one of them: each region's value is summed over the ranks first
                if _inplace(node) and any(node.args[0] in r.state for r in mine):
                    problems.append(f"{describe(node)} writes in place into a tensor of the experts' computation; "
                                    "expert parallelism cannot split that (write it out of place)")
                for r in mine:
                    r.masked |= {a for a in node.all_input_nodes if r.state.get(a) == OWNED}
                continue
        (region,) = {where[a] for a in node.all_input_nodes if a in where}
        owned = {a for a in node.all_input_nodes if region.state.get(a) == OWNED}
        partial = {a for a in node.all_input_nodes if region.state.get(a) == PARTIAL}
        if _draws(node):
            problems.append(f"{describe(node)} draws random numbers inside the experts: every rank would compute "
                            "every rank's tokens with its own draws")
            continue
        state = None
        along = emitted(node) if emitted is not None and node.args else None
        if along is not None and all(d >= region.rows for d in along) and node.args[0] in owned | partial \
                and not any(a in owned | partial for a in node.all_input_nodes if a is not node.args[0]):
            state = OWNED if node.args[0] in owned else PARTIAL  # linear and row by row: keeps either state
        elif not partial and rowwise(node, owned, region.rows):
            state = OWNED
        elif linear_in_partial(node, partial | owned):
            state = PARTIAL
            region.masked |= owned
        if state is None:  # outside: what it reads of the region is summed over the ranks first
            if _inplace(node) and node.args[0] in region.state:
                problems.append(f"{describe(node)} writes in place into a tensor of the experts' computation; expert "
                                "parallelism cannot split that (write it out of place)")
                continue
            region.masked |= owned
            continue
        if _inplace(node) and region.state.get(node.args[0]) is None:
            problems.append(f"{describe(node)} writes in place into a tensor from outside the experts, from their "
                            "output; expert parallelism cannot split that")
            continue
        region.state[node] = state
        where[node] = region
    for region in regions.values():
        counts = {shape_of(g.args[0])[0] for g in region.seeds if is_grouped_mm(g)}
        if len(counts) > 1:
            problems.append(f"the grouped matmuls of one routing have different numbers of rows {sorted(counts)}")
        region.padded = broadcast_expert_params(region, params)
        _finish(gm, region, data)
    return list(regions.values()), problems


def broadcast_expert_params(region: ExpertRegion, params: dict[fx.Node, str]) -> list[fx.Node]:
    """In a region whose seeds are all matmuls batched over ``E`` experts: the other parameters of
    ``E`` rows read only through views that keep row ``e`` at dim 0 (``unsqueeze``/``slice`` past
    dim 0) by pointwise region ops whose result is owned rows of ``E`` leading (a bias added per
    expert, ``y + b[:, None, :]``): row ``e`` of the result reads row ``e`` of ``b`` alone."""
    if not region.seeds or not all(is_bmm_seed(seed) for seed in region.seeds):
        return []
    experts = shape_of(next(iter(region.seeds.values())))[0]
    seeds = set(region.seeds.values())
    found = []
    for param in params:
        shape = shape_of(param)
        if param in seeds or not shape or shape[0] != experts or not param.users:
            continue
        frontier, readers, ok = [param], [], True
        while frontier and ok:
            node = frontier.pop()
            for user in node.users:
                op = packet(user) if user.op == "call_function" and isinstance(user.target, OpOverload) else None
                if user in region.state and region.state[user] == OWNED and torch.Tag.pointwise in user.target.tags \
                        and (shape_of(user) or [None])[0] == experts:
                    readers.append(user)
                elif user not in region.state and user.args and user.args[0] is node and (
                        op is aten.unsqueeze and _norm(user.args[1], _ndim(user) or 0) >= 1
                        or op is aten.slice and (_norm(user.args[1], _ndim(node) or 0) >= 1
                                                 or shape_of(user) == shape_of(node))):
                    frontier.append(user)
                else:
                    ok = False
        if ok and readers:
            found.append(param)
    return found


def _merge(into: ExpertRegion, other: ExpertRegion, where: dict[fx.Node, ExpertRegion], regions: dict) -> None:
    """Make ``other`` part of ``into`` (their rows found to be the same pairs)."""
    into.seeds.update(other.seeds)
    into.state.update(other.state)
    into.masked |= other.masked
    for node in other.state:
        where[node] = into
    for key, region in list(regions.items()):
        if region is other:
            del regions[key]


def _finish(gm: fx.GraphModule, region: ExpertRegion, data: set[fx.Node]) -> None:
    """Outputs, inputs, and the data-only ops pulled in to exchange fewer bytes."""
    inside = set(region.state)
    region.outputs = [n for n in gm.graph.nodes if n in inside and any(u not in inside for u in n.users)]
    region.masked |= {n for n in region.outputs if region.state[n] == OWNED}
    changed = True
    while changed:  # pull in data-only producers that no one else reads, where fewer bytes are exchanged
        changed = False
        for node in list(_outside_inputs(region, inside)):
            if node not in data or node in inside:
                continue
            _, pulled = _exchange_cost(node, inside, data, {})
            for other in pulled:
                region.state[other] = PLAIN
                inside.add(other)
            changed |= bool(pulled)
    region.nodes = [n for n in gm.graph.nodes if n in inside]
    outside = _outside_inputs(region, inside)
    region.inputs = [n for n in outside if n in data]
    region.shared = [n for n in outside if n not in data]


SHAPE_ONLY = {aten.view_as: aten.view.default, aten.reshape_as: aten.reshape.default,
              aten.expand_as: aten.expand.default}
"""Ops whose second tensor gives only a shape -> the op taking that shape as a list (what the
rewrite runs instead, so that the shape's tensor is not exchanged)."""


def region_args(node: fx.Node) -> list[fx.Node]:
    """The nodes whose values ``node`` reads (not those that give it only a shape)."""
    if node.op == "call_function" and packet(node) in SHAPE_ONLY:
        return [node.args[0]] if isinstance(node.args[0], fx.Node) else []
    return list(node.all_input_nodes)


def _outside_inputs(region: ExpertRegion, inside: set[fx.Node]) -> list[fx.Node]:
    seen = {}
    for node in region.state:
        for a in region_args(node):
            if a not in inside:
                seen[a] = None
    return list(seen)


_DROPOUTS = {aten.dropout, aten.native_dropout, aten.feature_dropout, aten.alpha_dropout, aten.feature_alpha_dropout}


def _draws(node: fx.Node) -> bool:
    """Draws random numbers: a dropout only in training with p > 0 (eval graphs keep the op)."""
    if packet(node) in _DROPOUTS:
        p, train = _arg(node, 1, "p"), _arg(node, 2, "train")
        return bool(train) and not (isinstance(p, (int, float)) and p == 0)
    return is_random(node)


def _pullable(node: fx.Node, inside: set[fx.Node], data: set[fx.Node]) -> bool:
    """A deterministic, data-only op of one output that reads nothing of the region (what reads the
    region outside it reads the sum over the ranks) and is read only by ``inside``."""
    if node.op != "call_function" or is_multi_output(node) or node.target is operator.getitem:
        return False
    if any(a in inside for a in node.all_input_nodes):
        return False
    return not (_inplace(node) or _draws(node) or any(u not in inside for u in node.users))


def _nbytes(node: fx.Node) -> int | None:
    value = tensor_val(node)
    return None if value is None else value.numel() * value.element_size()


def _exchange_cost(node: fx.Node, inside: set[fx.Node], data: set[fx.Node],
                   seen: dict[fx.Node, tuple[int | None, frozenset[fx.Node]]]) -> tuple[int | None, frozenset[fx.Node]]:
    """The fewest bytes the region needs exchanged to have ``node`` (a data input), and the producers
    to pull in for that: ``node`` itself is exchanged, or it is computed in the region from its own
    data inputs, each at its own fewest bytes, when that is no more (a token copied per expert and
    scaled by its routing weight, ``mul(repeat(x, E), w)``: ``x`` and ``w`` are sent, not the copies)."""
    if node in seen:
        return seen[node]
    own = _nbytes(node)
    seen[node] = (own, frozenset())
    if own is None or not _pullable(node, inside, data):
        return seen[node]
    inputs = [a for a in node.all_input_nodes if a in data]
    if not inputs:
        return seen[node]
    below = inside | {node}
    total, pulled = 0, {node}
    for a in inputs:
        cost, more = _exchange_cost(a, below, data, {})
        if cost is None:
            return seen[node]
        total += cost
        pulled |= more
    if total <= own:
        seen[node] = (total, frozenset(pulled))
    return seen[node]


def data_nodes(gm: fx.GraphModule, user_inputs) -> set[fx.Node]:
    """Nodes whose values are computed from ``user_inputs`` (placeholders): differ from rank to rank."""
    found = set(user_inputs)
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found
