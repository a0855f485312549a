"""How one tensor dimension is split over the tensor-parallel ranks, and how that
split moves through ATen ops.

A ``DimShard`` says: along ``dim``, the index range is cut into ``segments``
``(start, length)``; each segment is split evenly over the ``tp`` ranks, rank r
holding ``[start + r*length/tp, start + (r+1)*length/tp)`` of every segment.
One segment covering the dim is ordinary ``Shard(dim)``; k equal segments are
torch's ``_StridedShard(dim, split_factor=k)`` (a fused ``[q|k|v]`` weight split
per head inside each of q, k and v).

``input_specs_for_output`` answers, for one op, "if the output is split like
this, how must each tensor input be split?" (used walking back from a row-parallel
linear); ``output_spec_for_inputs`` answers the forward question (used walking the
sequence-parallel region). Both read shapes from ``node.meta["val"]`` only.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from sptransform.graph.nodes import packet

from sptransform.torch_internals import OpOverload

aten = torch.ops.aten


@dataclass(frozen=True)
class DimShard:
    dim: int
    segments: tuple[tuple[int, int], ...]

    def local_size(self, tp: int) -> int:
        return sum(length for _, length in self.segments) // tp

    def indices(self, rank: int, tp: int) -> list[int]:
        out: list[int] = []
        for start, length in self.segments:
            part = length // tp
            out.extend(range(start + rank * part, start + (rank + 1) * part))
        return out

    def with_dim(self, dim: int) -> "DimShard":
        return DimShard(dim, self.segments)

    def covers_whole(self, size: int) -> bool:
        return self.segments == ((0, size),)


CUT = "cut"
"""``input_specs_for_output`` marks an input that cannot carry the split (fewer K/V heads than
tp): it is computed whole and cut where it is read."""


class ShardingError(ValueError):
    """An op in a region cannot run on the local shard; names the op and source line."""


class NoRuleError(ShardingError):
    """The op has no sharding rule at all (as opposed to a rule that forbids this split)."""


def whole(dim: int, size: int) -> DimShard:
    return DimShard(dim, ((0, size),))


def shape_of(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return None


def describe(node: fx.Node) -> str:
    """``aten.view.default (node view) at model.py, line 42: code`` for error messages: the
    innermost frame of the user's code (not torch's) that made the op."""
    target = getattr(node.target, "__name__", str(node.target))
    if isinstance(node.target, OpOverload):
        target = f"aten.{node.target._opname}.{node.target._overloadname}"
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines() if ln.strip()]
    frames = [(lines[i][5:], lines[i + 1] if i + 1 < len(lines) else "") for i in range(len(lines)) if lines[i].startswith("File ")]
    user = [f for f in frames if "/torch/" not in f[0]] or frames
    where = f" at {user[-1][0]}: {user[-1][1]}" if user else ""
    return f"{target} (node {node.name}){where}"


# ---------------------------------------------------------------------------
# view groups: which input dims and output dims of a reshape belong together


def view_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims whose sizes multiply equal.

    (b, s, h) -> (b*s, h) gives [([0, 1], [0]), ([2], [1])]. Size-1 dims form groups
    with an empty other side."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        if i < len(in_shape) and in_shape[i] == 1 and (j >= len(out_shape) or out_shape[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(out_shape) and out_shape[j] == 1 and (i >= len(in_shape) or in_shape[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(in_shape) or j >= len(out_shape):
            raise AssertionError(f"view {in_shape} -> {out_shape} does not pair up")
        ins, outs = [i], [j]
        pin, pout = in_shape[i], out_shape[j]
        i += 1
        j += 1
        while pin != pout:
            if pin < pout:
                ins.append(i)
                pin *= in_shape[i]
                i += 1
            else:
                outs.append(j)
                pout *= out_shape[j]
                j += 1
        groups.append((ins, outs))
    return groups


def _move_through_group(spec: DimShard, src_sizes, src_pos, dst_sizes, dst_dims, tp):
    """Re-express a split of dim ``src_pos`` of a group on one dim of the other side."""
    inner = math.prod(src_sizes[src_pos + 1 :])
    outer = math.prod(src_sizes[:src_pos])
    size = src_sizes[src_pos]
    flat = [
        (o * size * inner + s * inner, length * inner)
        for o in range(outer)
        for s, length in spec.segments
    ]
    # Several dims can carry the split when some are tp's multiple only by accident of tp (a batch
    # of 2 merged with heads, at tp=1 or 2): take the one whose pieces are largest, so that the
    # answer does not depend on tp (the region walk asks at tp=1 first).
    candidates = []
    for q, dim in enumerate(dst_dims):
        q_size = dst_sizes[q]
        if q_size == 1:
            continue
        q_inner = math.prod(dst_sizes[q + 1 :])
        q_outer = math.prod(dst_sizes[:q])
        per_outer: dict[int, list[tuple[int, int]]] = {}
        ok = True
        for fs, fl in flat:
            if fs % q_inner or fl % q_inner:
                ok = False
                break
            x, lx = fs // q_inner, fl // q_inner
            o, s = divmod(x, q_size)
            if s + lx > q_size or lx % tp:
                ok = False
                break
            per_outer.setdefault(o, []).append((s, lx))
        if not ok or len(per_outer) != q_outer:
            continue
        patterns = {tuple(v) for v in per_outer.values()}
        if len(patterns) == 1:
            pattern = patterns.pop()
            candidates.append((min(length for _, length in pattern), -q, DimShard(dim, pattern)))
    return max(candidates, key=lambda c: c[:2])[2] if candidates else None


def reshape_spec(spec: DimShard, src_shape, dst_shape, tp: int) -> DimShard | None:
    """Carry a split from ``src_shape`` to ``dst_shape`` across a view; None if impossible."""
    if any(length % tp for _, length in spec.segments):
        return None
    for src_dims, dst_dims in view_groups(src_shape, dst_shape):
        if spec.dim in src_dims:
            if not dst_dims:
                return None
            if len(src_dims) == 1 and len(dst_dims) == 1:  # the dim itself moves: its split moves whole
                return DimShard(dst_dims[0], spec.segments)
            pos = src_dims.index(spec.dim)
            return _move_through_group(
                spec,
                [src_shape[d] for d in src_dims],
                pos,
                [dst_shape[d] for d in dst_dims],
                dst_dims,
                tp,
            )
    return None


_POINTWISE = {
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.pow, aten.rsqrt, aten.sqrt,
    aten.exp, aten.log, aten.tanh, aten.sigmoid, aten.silu, aten.gelu, aten.relu,
    aten.where, aten.masked_fill, aten.clone, aten.contiguous, aten.alias, aten.detach,
    aten.to, aten._to_copy, aten.type_as, aten.dropout, aten.eq, aten.ne, aten.lt,
    aten.le, aten.gt, aten.ge, aten.logical_not, aten.logical_and, aten.bitwise_and,
    aten.__and__, aten.__or__, aten.abs, aten.clamp, aten.clamp_min, aten.clamp_max,
    aten.maximum, aten.minimum, aten.erf, aten.reciprocal, aten.square, aten.rsub,
    aten.sin, aten.cos, aten.lift_fresh_copy, aten.zeros_like, aten.ones_like,
    aten.full_like, aten.empty_like, aten.rand_like, aten.bernoulli, aten.softmax,
    aten._softmax, aten.log_softmax, aten._log_softmax, aten.copy, aten.mish,
    aten.hardtanh, aten.leaky_relu, aten.elu, aten.softplus, aten.sign, aten.floor_divide,
}
_REDUCTIONS = {aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.std, aten.var_mean}
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten}
_NO_OUTPUT = {aten._assert_tensor_metadata}


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _pointwise_links(node: fx.Node) -> list[tuple[fx.Node, dict[int, int]]]:
    out = shape_of(node)
    links = []
    for arg in _tensor_args(node):
        shape = shape_of(arg)
        offset = len(out) - len(shape)
        links.append((arg, {d + offset: d for d in range(len(shape)) if shape[d] != 1 or out[d + offset] == 1}))
    return links


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    found = []
    for a in list(node.args) + list(node.kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else [a]
        for x in items:
            if isinstance(x, fx.Node) and shape_of(x) is not None and x not in found:
                found.append(x)
    return found


def dim_links(node: fx.Node) -> tuple[list[tuple[fx.Node, dict[int, int]]], set[int]]:
    """For an op that is not a view/split/cat: for each tensor input, ``{out_dim: in_dim}``
    of dims that correspond one to one, and the set of output dims that may not be split
    (reduced, normalized, contracted or sliced). Raises ``KeyError`` for unknown ops."""
    p = packet(node)
    out = shape_of(node)
    if p in _POINTWISE or (isinstance(node.target, OpOverload) and torch.Tag.pointwise in node.target.tags):
        forbidden = set()
        if p in (aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax):
            forbidden.add(_norm_dim(node.args[1], len(out)))
        return _pointwise_links(node), forbidden
    if p in _REDUCTIONS:
        x = node.args[0]
        n = len(shape_of(x))
        dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(n))
        dims = {_norm_dim(d, n) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
        keep = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        mapping, o = {}, 0
        for d in range(n):
            if d in dims:
                if keep:
                    o += 1
                continue
            mapping[o] = d
            o += 1
        return [(x, mapping)], set()
    if p in (aten.layer_norm, aten.rms_norm):
        x = node.args[0]
        n = len(shape_of(x))
        k = len(node.args[1])
        return [(x, {d: d for d in range(n - k)})], set(range(n - k, n))
    if p is aten.transpose:
        x, a, b = node.args[0], *(_norm_dim(d, len(out)) for d in node.args[1:3])
        perm = list(range(len(out)))
        perm[a], perm[b] = perm[b], perm[a]
        return [(x, {o: perm[o] for o in range(len(out))})], set()
    if p in (aten.t, aten.numpy_T, aten.mT):
        n = len(out)
        if p is aten.numpy_T:  # reverses every dim
            return [(node.args[0], {o: n - 1 - o for o in range(n)})], set()
        if p is aten.mT or n == 2:  # swaps the last two
            perm = list(range(n))
            perm[-1], perm[-2] = perm[-2], perm[-1]
            return [(node.args[0], {o: perm[o] for o in range(n)})], set()
        return [(node.args[0], {0: 0})], set()
    if p is aten.permute:
        perm = [_norm_dim(d, len(out)) for d in node.args[1]]
        return [(node.args[0], {o: perm[o] for o in range(len(out))})], set()
    if p is aten.unsqueeze:
        k = _norm_dim(node.args[1], len(out))
        return [(node.args[0], {o: (o if o < k else o - 1) for o in range(len(out)) if o != k})], set()
    if p is aten.squeeze:
        x = node.args[0]
        shape = shape_of(x)
        kept = [d for d in range(len(shape)) if not (shape[d] == 1 and _squeezed(node, d, len(shape)))]
        return [(x, dict(enumerate(kept)))], set()
    if p is aten.expand:
        x = node.args[0]
        shape = shape_of(x)
        offset = len(out) - len(shape)
        return [(x, {d + offset: d for d in range(len(shape)) if shape[d] == out[d + offset]})], set()
    if p in (aten.slice,):
        x = node.args[0]
        d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(out))
        full = shape_of(x)[d] == out[d]
        return [(x, {o: o for o in range(len(out))})], set() if full else {d}
    if p is aten.select:
        x = node.args[0]
        d = _norm_dim(node.args[1], len(out) + 1)
        return [(x, {o: (o if o < d else o + 1) for o in range(len(out))})], set()
    if p is aten.repeat_interleave and isinstance(node.args[1], int):
        # out[i] = in[i // repeats] along dim: a contiguous split maps to one `repeats` times smaller.
        return [(node.args[0], {o: o for o in range(len(out))})], set()
    if p is aten.cat:
        d = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(out))
        return [(t, {o: o for o in range(len(out)) if o != d}) for t in node.args[0]], {d}
    if p is aten.index_select:
        d = _norm_dim(node.args[1], len(out))
        return [(node.args[0], {o: o for o in range(len(out))})], {d}
    if p in (aten.matmul, aten.bmm, aten.mm):
        a, b = node.args[0], node.args[1]
        sa, sb = shape_of(a), shape_of(b)
        n = len(out)
        la, lb = {}, {}
        if len(sa) >= 2:
            la[n - 2] = len(sa) - 2
        if len(sb) >= 2:
            lb[n - 1] = len(sb) - 1
        for o in range(n - 2):
            for shape, links in ((sa, la), (sb, lb)):
                d = o - (n - len(shape))
                if 0 <= d < len(shape) - 2 and shape[d] == out[o]:
                    links[o] = d
        return [(a, la), (b, lb)], set()
    if p is aten.linear:
        x, w = node.args[0], node.args[1]
        n = len(out)
        links = [(x, {o: o for o in range(n - 1)}), (w, {n - 1: 0})]
        if len(node.args) > 2 and node.args[2] is not None:
            links.append((node.args[2], {n - 1: 0}))
        return links, set()
    if p is aten.addmm:
        bias, x, w = node.args[:3]
        links = [(x, {0: 0}), (w, {1: 1})]
        sb = shape_of(bias)
        links.append((bias, {1: len(sb) - 1} if sb and sb[-1] != 1 else {}))
        return links, set()
    if p is aten.scaled_dot_product_attention:
        q, k, v = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        n = len(out)
        sk = shape_of(k)
        # K/V batch dims may be broadcast (size 1) or hold fewer, grouped heads (GQA).
        kv = {o: o for o in range(n - 2) if sk[o] != 1 or out[o] == 1}
        links = [(q, {o: o for o in range(n - 1)}), (k, kv), (v, kv | {n - 1: n - 1})]
        if isinstance(mask, fx.Node):
            sm = shape_of(mask)
            off = n - len(sm)
            links.append((mask, {o: o - off for o in range(off, n - 1) if sm[o - off] != 1}))
        return links, {n - 1}
    if p is aten.embedding:
        w, ids = node.args[0], node.args[1]
        n = len(out)
        return [(ids, {o: o for o in range(n - 1)}), (w, {n - 1: 1})], set()
    raise KeyError(p)


def _squeezed(node: fx.Node, d: int, ndim: int) -> bool:
    if len(node.args) < 2:
        return True
    dims = node.args[1]
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return d in {_norm_dim(x, ndim) for x in dims}


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


SPLIT_PACKETS = (aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.unsafe_split,
           aten.unsafe_split_with_sizes, aten.tensor_split)


def is_split(node: fx.Node) -> bool:
    """An op that cuts its input into consecutive chunks along one dim (``args[2]``, ``unbind``'s
    ``args[1]``), the chunks' sizes read from its output. ``tensor_split`` by a tensor of indices
    is not one: its sizes are a tensor input that a rewrite to local sizes would drop."""
    return packet(node) in SPLIT_PACKETS and node.target is not aten.tensor_split.tensor_indices_or_sections


def split_chunks(node: fx.Node) -> list[tuple[int, int]]:
    """(offset, size) of each output chunk along the split dim."""
    vals = node.meta["val"]
    d = split_dim(node)
    out, off = [], 0
    for v in vals:
        size = int(v.shape[d]) if packet(node) is not aten.unbind else 1
        out.append((off, size))
        off += size
    return out


def split_dim(node: fx.Node) -> int:
    p = packet(node)
    ndim = len(shape_of(node.args[0]))
    if p is aten.unbind:
        d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    else:
        d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return _norm_dim(d, ndim)


# ---------------------------------------------------------------------------
# propagation through one op


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


def input_specs_for_output(node: fx.Node, spec: DimShard, tp: int) -> list[tuple[fx.Node, DimShard | None]]:
    """How each tensor input of ``node`` must be split so that its output is split as ``spec``."""
    out = shape_of(node)
    if packet(node) in _VIEWS:
        x = node.args[0]
        moved = reshape_spec(spec, out, shape_of(x), tp)
        if moved is None:
            raise ShardingError(f"{describe(node)}: reshape {out} cannot keep dim {spec.dim} split over tp={tp}")
        return [(x, moved)]
    try:
        links, forbidden = dim_links(node)
    except KeyError:
        return _dtensor_input_specs(node, spec)
    if spec.dim in forbidden:
        raise ShardingError(f"{describe(node)} reduces, normalizes or contracts dim {spec.dim}, which is split")
    result: list[tuple[fx.Node, DimShard | None]] = []
    for arg, mapping in links:
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


def output_spec_for_inputs(
    node: fx.Node, in_specs: dict[fx.Node, DimShard], tp: int
) -> tuple[DimShard | None, list[tuple[fx.Node, DimShard]]]:
    """The output split of ``node`` given its split inputs, and the replicated inputs
    that must be cut to the local part to line up with it."""
    out = shape_of(node)
    if packet(node) in _VIEWS:
        x = node.args[0]
        moved = reshape_spec(in_specs[x], shape_of(x), out, tp)
        if moved is None:
            raise ShardingError(f"{describe(node)}: reshape to {out} cannot keep the split dim")
        return moved, []
    try:
        links, forbidden = dim_links(node)
    except KeyError:
        raise NoRuleError(f"{describe(node)} cannot run on a split input (no sharding rule for it)") from None
    out_spec: DimShard | None = None
    for arg, mapping in links:
        s = in_specs.get(arg)
        if s is None:
            continue
        inverse = {v: k for k, v in mapping.items()}
        if s.dim not in inverse:
            raise ShardingError(f"{describe(node)} reduces or contracts the split dim {s.dim} of its input")
        candidate = DimShard(inverse[s.dim], s.segments)
        if out_spec is not None and candidate != out_spec:
            raise ShardingError(f"{describe(node)}: inputs are split in incompatible ways")
        out_spec = candidate
    if out_spec is not None and out_spec.dim in forbidden:
        raise ShardingError(f"{describe(node)} reduces or normalizes over the split dim {out_spec.dim}")
    to_cut = []
    if out_spec is not None:
        for arg, mapping in links:
            if arg in in_specs:
                continue
            d = mapping.get(out_spec.dim)
            if d is not None:
                to_cut.append((arg, DimShard(d, out_spec.segments)))
    return out_spec, to_cut


def split_input_spec(node: fx.Node, chunk_specs: dict[int, DimShard | None]) -> DimShard | None:
    """The split of a ``split``'s input given the splits wanted for its chunks."""
    d = split_dim(node)
    chunks = split_chunks(node)
    wanted = [chunk_specs.get(i) for i in range(len(chunks))]
    if packet(node) is aten.unbind:  # chunk dims from d on sit one higher in the input
        wanted = [s.with_dim(s.dim + 1) if s is not None and s.dim >= d else s for s in wanted]
    if all(s is None for s in wanted):
        return None
    other = {s for s in wanted if s is not None and s.dim != d}
    if other:
        if len(other) > 1 or any(s is None or s.dim == d for s in wanted):
            raise ShardingError(f"{describe(node)}: its chunks are split in incompatible ways")
        return other.pop()
    segments = []
    for (offset, size), s in zip(chunks, wanted):
        s = s or whole(d, size)
        segments.extend((offset + a, n) for a, n in s.segments)
    return DimShard(d, tuple(segments))


def split_output_specs(node: fx.Node, spec: DimShard) -> list[DimShard]:
    """The split of each chunk of a ``split`` whose input is split as ``spec``."""
    d = split_dim(node)
    chunks = split_chunks(node)
    if spec.dim != d:
        if packet(node) is aten.unbind and spec.dim > d:  # unbind removes dim d: later dims move down
            return [spec.with_dim(spec.dim - 1)] * len(chunks)
        return [spec] * len(chunks)
    result = []
    for offset, size in chunks:
        inside = [(a - offset, n) for a, n in spec.segments if offset <= a and a + n <= offset + size]
        if sum(n for _, n in inside) != size:
            raise ShardingError(f"{describe(node)}: a chunk boundary cuts through a split segment")
        result.append(DimShard(d, tuple(inside)))
    return result


def _dtensor_input_specs(node: fx.Node, spec: DimShard) -> list[tuple[fx.Node, DimShard | None]]:
    """The backward question for an op we have no rule for, answered by DTensor's strategies:
    a strategy whose output is split like ``spec`` (one segment) and whose inputs are split or
    replicated (no partial sums)."""
    from torch.distributed.tensor import Replicate, Shard

    from sptransform.graph.dtensor_rules import dtensor_strategies, flat_input_nodes

    def no_rule() -> NoRuleError:
        return NoRuleError(f"{describe(node)} cannot run on a split input (no sharding rule for it)")

    if len(spec.segments) != 1:
        raise no_rule()
    strategies = dtensor_strategies(node, _tp_hint(spec)) or []
    flat = flat_input_nodes(node)
    for strategy in strategies:
        out = strategy.outputs[0] if strategy.outputs else None
        if not (type(out) is Shard and out.dim == spec.dim):
            continue
        if not all(p is None or type(p) is Shard or isinstance(p, Replicate) for p in strategy.inputs):
            continue
        result = []
        for arg, placement in zip(flat, strategy.inputs):
            if arg is None or placement is None or isinstance(placement, Replicate):
                result.append((arg, None) if arg is not None else None)
                continue
            result.append((arg, whole(placement.dim, shape_of(arg)[placement.dim])))
        return [r for r in result if r is not None]
    raise no_rule()


def _tp_hint(spec: DimShard) -> int:
    """DTensor drops strategies that split a dim smaller than the mesh; any size the split
    could have works for finding which dims correspond, so ask for a 2-rank mesh."""
    return 2


# ---------------------------------------------------------------------------
# slices of a split dim: the pieces of a fused output taken with ``x[..., a:b]``


def slice_bounds(node: fx.Node) -> tuple[int, int, int, int]:
    """(dim, start, end, step) of an ``aten.slice``, with start and end clamped into the dim."""
    x = node.args[0]
    size_in = shape_of(x)
    d = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(size_in))
    size = size_in[d]
    start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start")
    end = node.args[3] if len(node.args) > 3 else node.kwargs.get("end")
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return d, max(0, min(start, size)), max(0, min(end, size)), step


def slice_output_spec(node: fx.Node, spec: DimShard) -> DimShard | None:
    """The split of ``x[..., start:end]`` when ``x`` is split along the sliced dim as ``spec``:
    the segments inside the slice, if every segment is wholly inside or outside it."""
    d, start, end, step = slice_bounds(node)
    if spec.dim != d or step != 1:
        return None
    inside = []
    for a, n in spec.segments:
        if start <= a and a + n <= end:
            inside.append((a - start, n))
        elif a < end and a + n > start:
            return None  # the slice cuts through a segment
    if sum(n for _, n in inside) != end - start:
        return None  # part of the slice is not split: no single placement for it
    return DimShard(d, tuple(inside))


def slices_input_spec(size: int, dim: int, pieces: list[tuple[int, DimShard]], tp: int) -> DimShard | None:
    """The split of a tensor whose slices ``(start, split of the slice)`` along ``dim`` are needed
    split: their segments, and every part no slice takes split whole (None if one cannot be)."""
    segments = sorted((start + a, n) for start, spec in pieces for a, n in spec.segments)
    filled, at = [], 0
    for a, n in segments:
        if a < at:
            return None  # overlapping slices
        if a > at:
            if (a - at) % tp:
                return None
            filled.append((at, a - at))
        filled.append((a, n))
        at = a + n
    if at < size:
        if (size - at) % tp:
            return None
        filled.append((at, size - at))
    return DimShard(dim, tuple(filled))


def local_slice_bounds(spec: DimShard, start: int, end: int, tp: int) -> tuple[int, int]:
    """Where ``[start, end)`` (whole segments of ``spec``) lies in a rank's local tensor, which
    holds each segment's part one after the other."""
    before = sum(n // tp for a, n in spec.segments if a + n <= start)
    inside = sum(n // tp for a, n in spec.segments if start <= a and a + n <= end)
    return before, before + inside
