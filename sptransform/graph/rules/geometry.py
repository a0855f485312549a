"""How a split moves through the ops that rearrange a dim without computing on it: views
(which input dims and output dims belong together), splits into chunks, and slices of a fused
dim. Shapes come from ``node.meta["val"]`` only; both directions of the registry use these."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from sptransform.graph.nodes import describe, packet, shape_of, size_of
from sptransform.graph.placement import DimShard, whole
from sptransform.graph.rules.base import ShardingError, norm_dim

aten = torch.ops.aten

VIEWS = frozenset({aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten})


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


# ---------------------------------------------------------------------------
# splits into chunks


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
        size = size_of(v.shape[d]) if packet(node) is not aten.unbind else 1  # (routing counts: stand-ins)
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
    return norm_dim(d, ndim)


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



def cat_pieces(node: fx.Node) -> tuple[int, list[tuple[fx.Node, int, int]]]:
    """(dim, [(input, offset, size)]) of a ``cat``: where each input lands along the dim. A 1-D
    empty input beside tensors of more dims (``cat`` still accepts one) lands nowhere: size 0."""
    tensors = node.args[0]
    ndim = len(shape_of(node))
    d = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), ndim)
    pieces, offset = [], 0
    for t in tensors:
        size = shape_of(t)[d] if len(shape_of(t)) == ndim else 0
        pieces.append((t, offset, size))
        offset += size
    return d, pieces


def cat_input_specs(node: fx.Node, spec: DimShard) -> list[tuple[fx.Node, DimShard]]:
    """A ``cat`` whose output is split along its dim in segments: each input takes the segments
    that fall inside it (the inverse of ``split_output_specs``: Qwen3-Next concatenates its
    per-head query, key and value channels before a depthwise convolution)."""
    d, pieces = cat_pieces(node)
    result = []
    for t, offset, size in pieces:
        if size == 0:
            result.append((t, None))  # nothing of it lands in the output: read whole
            continue
        inside = tuple((a - offset, n) for a, n in spec.segments if offset <= a and a + n <= offset + size)
        if sum(n for _, n in inside) != size:
            raise ShardingError(f"{describe(node)}: an input's boundary cuts through a split segment")
        result.append((t, DimShard(d, inside)))
    return result


# ---------------------------------------------------------------------------
# slices of a split dim: the pieces of a fused output taken with ``x[..., a:b]``


def slice_bounds(node: fx.Node) -> tuple[int, int, int, int]:
    """(dim, start, end, step) of an ``aten.slice``, with start and end clamped into the dim."""
    x = node.args[0]
    size_in = shape_of(x)
    d = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(size_in))
    size = size_in[d]
    start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start")
    end = node.args[3] if len(node.args) > 3 else node.kwargs.get("end")
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return d, max(0, min(start, size)), max(0, min(end, size)), step


def strided_slice_step(node: fx.Node) -> int | None:
    """``k`` when ``node`` takes every ``k``-th element of its input along the sliced dim from one
    of the first ``k`` to the end (``x[..., ::2]``, ``x[..., 1::2]``: interleaved pairs taken
    apart, as GPT-OSS's experts take gate and up apart); None otherwise."""
    d, start, end, step = slice_bounds(node)
    size = shape_of(node.args[0])[d]
    if step == 1 or start >= step or size % step or end < size - step + 1 + start:
        return None
    return step


def strided_slice_input_spec(node: fx.Node, spec: DimShard, tp: int) -> DimShard | None:
    """The split of ``x`` for ``x[..., start::k]`` (``strided_slice_step``) to be split as ``spec``:
    each output segment's ``k`` times longer, so that every rank's part of a segment holds whole
    groups of ``k`` and its local ``start::k`` takes exactly its part of the output. None: no such split."""
    k = strided_slice_step(node)
    if k is None or spec.dim != slice_bounds(node)[0] or any(n % tp for _, n in spec.segments):
        return None
    return DimShard(spec.dim, tuple((a * k, n * k) for a, n in spec.segments))


def slice_output_spec(node: fx.Node, spec: DimShard, tp: int | None = None) -> DimShard | None:
    """The split of ``x[..., start:end]`` when ``x`` is split along the sliced dim as ``spec``:
    the segments inside the slice, if every segment is wholly inside or outside it; or, for a
    strided slice of the whole dim (``strided_slice_input_spec``), each segment ``k`` times shorter."""
    d, start, end, step = slice_bounds(node)
    if spec.dim != d:
        return None
    if step != 1:
        k = strided_slice_step(node)
        if k is None or tp is None or any(a % k or n % (k * tp) for a, n in spec.segments):
            return None
        return DimShard(d, tuple((a // k, n // k) for a, n in spec.segments))
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
