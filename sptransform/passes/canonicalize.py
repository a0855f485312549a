"""Canonical forms the analysis and the rewrite rely on.

``remove_dead_code``: nodes no output depends on (a computed-but-unused tensor, a dead
``alias``) are erased, so they are never counted as readers that force a placement.

    before:  a = alias(x); y = linear(x, W)        # a unused
    after:   y = linear(x, W)

``split_bias``: a bias folded into a matmul is added separately, so that a matmul whose
contraction is split (a row-parallel linear, a partial sum) never adds it on every rank.

    before:  y = addmm(b, x, W)          y = linear(x, W, b)
    after:   y = add(mm(x, W), b)        y = add(linear(x, W), b)

``repeat_grouped_kv``: an attention kernel with grouped K/V heads (``enable_gqa``) whose K/V
head count tp does not divide gets its K/V heads repeated to the query heads, so that every
rank's query heads find theirs in a split of the repeated ones.

    before:  o = sdpa(q, k, v, enable_gqa=True)                      # q: 8 heads, k, v: 2
    after:   o = sdpa(q, repeat_interleave(k, 4, -3), repeat_interleave(v, 4, -3))

``functional_copies``: the functional ``copy`` that functionalization leaves where a model
wrote ``buf[...].copy_(x)`` has no autograd formula; it is ``x`` cast to ``buf``'s dtype and
broadcast to its shape, which is what it becomes; the slice it wrote into goes when nothing
else reads it.

    before:  c = copy(slice(buf, 3, 0, 8), x)
    after:   c = _to_copy(x, dtype=buf.dtype)                      # same shape
             c = clone(expand(x, buf.shape))                       # x broadcast

``narrow_as_slice``: ``narrow(x, dim, start, length)`` is the slice it names, and slices have
the rules (a piece of a fused weight, its bounds on a rank's local rows) that narrow lacks.

    before:  p = narrow(w, 0, 32, 64)
    after:   p = slice(w, 0, 32, 96)

``sizes_as_arguments``: ``expand_as``, ``view_as`` and ``reshape_as`` take their size from a
second tensor, which is read for its shape only; with that tensor split (the sequence under SP)
the op would take the local size while its first input is whole. The size it names goes in
as an argument, which the rewrite localizes like any other (shapes are static).

    before:  m = expand_as(mask, scores)                 # scores: [2, 8, 16, 16]
    after:   m = expand(mask, [2, 8, 16, 16])

``written_norms``: a fused ``rms_norm`` of a projection's output is written out as the ops its
composite runs (bitwise alike), so that its mean square over split features can be a partial sum.

    before:  y = rms_norm(linear(x, Wq), [d], w, eps)
    after:   f = linear(x, Wq); y = mul(mul(f, rsqrt(add(mean(pow(f, 2), [-1], True), eps))), w)

All edit ``gm`` in place and keep ``node.meta["val"]`` on what they create.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from sptransform.graph.nodes import is_view, packet

aten = torch.ops.aten


def remove_dead_code(gm: fx.GraphModule) -> int:
    """Erase pure nodes nothing reads; returns how many went."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    removed = before - len(gm.graph.nodes)
    if removed:
        gm.recompile()
    return removed


def split_bias(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """Take the bias out of ``linear`` / ``addmm`` ``node``; returns the node of the bias-free
    matmul (the add after it takes over ``node``'s readers)."""
    p = packet(node)
    if p is aten.linear and len(node.args) > 2 and node.args[2] is not None:
        bias = node.args[2]
        node.args = node.args[:2]
    elif p is aten.addmm and not node.kwargs and len(node.args) == 3:
        bias = node.args[0]
        node.target = aten.mm.default
        node.args = (node.args[1], node.args[2])
    else:
        return node
    readers = list(node.users)
    with gm.graph.inserting_after(node):
        added = gm.graph.call_function(aten.add.Tensor, (node, bias))
    added.meta = {k: v for k, v in node.meta.items()}
    for reader in readers:
        reader.replace_input_with(node, added)
    return node


def repeat_grouped_kv(gm: fx.GraphModule, *, tp: int) -> int:
    """Repeat grouped K/V heads of fused attention calls where tp does not divide their count;
    returns how many calls changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        if packet(node) is not aten.scaled_dot_product_attention or not node.kwargs.get("enable_gqa"):
            continue
        q, k, v = node.args[:3]
        heads, groups = q.meta["val"].shape[-3], k.meta["val"].shape[-3]
        if groups == heads or groups % tp == 0:
            continue
        repeated = []
        for x in (k, v):
            with gm.graph.inserting_before(node):
                r = gm.graph.call_function(aten.repeat_interleave.self_int, (x, heads // groups, -3))
            value = x.meta["val"]
            shape = list(value.shape)
            shape[-3] = heads
            r.meta["val"] = value.new_empty(shape)
            repeated.append(r)
        node.args = (q, *repeated, *node.args[3:])
        node.kwargs = {key: val for key, val in node.kwargs.items() if key != "enable_gqa"}
        changed += 1
    if changed:
        gm.recompile()
    return changed


def functional_copies(gm: fx.GraphModule) -> int:
    """Rewrite functional ``aten.copy`` (no autograd formula) as a cast or a broadcast copy of
    its source; returns how many changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        dst, src = node.args[:2]
        want, have = dst.meta["val"], src.meta["val"]
        with gm.graph.inserting_before(node):
            value = src
            if tuple(have.shape) != tuple(want.shape):
                value = gm.graph.call_function(aten.expand.default, (value, list(want.shape)))
                value.meta["val"] = have.expand(want.shape)
            if have.dtype != want.dtype:
                new = gm.graph.call_function(aten._to_copy.default, (value,), {"dtype": want.dtype})
            else:
                new = gm.graph.call_function(aten.clone.default, (value,))
        _take_over(gm, node, new)
        while is_view(dst) and not dst.users and dst.target is not operator.getitem:
            # The written-to view (a slice, a select: Qwen3-Next writes its recurrence's output
            # chunk by chunk) has no reader left; kept, it would read the buffer as a whole
            # tensor and stand between the buffer and a tensor-parallel region.
            parent = dst.args[0]
            gm.graph.erase_node(dst)
            dst = parent
        changed += 1
    if changed:
        gm.recompile()
    return changed


def narrow_as_slice(gm: fx.GraphModule) -> int:
    """Rewrite ``narrow`` with a constant start as ``slice``; returns how many changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.narrow.default:
            continue
        x, dim, start, length = node.args
        if not all(isinstance(v, int) for v in (dim, start, length)):
            continue  # a start computed in the graph: no static bounds to rewrite with
        size = x.meta["val"].shape[dim]
        start = start + size if start < 0 else start  # narrow counts a negative start from the end; slice's end would not
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(aten.slice.Tensor, (x, dim, start, start + length))
        _take_over(gm, node, new)
        changed += 1
    if changed:
        gm.recompile()
    return changed


def _projected(x: fx.Node) -> bool:
    """``x`` is a linear's output, directly or through views and casts."""
    from sptransform.graph.nodes import MOVES_ONLY

    while packet(x) in MOVES_ONLY and x.args and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return packet(x) in (aten.linear, aten.matmul, aten.mm, aten.addmm, aten.bmm, aten.einsum)


def written_norms(gm: fx.GraphModule) -> int:
    """Write out each fused ``rms_norm`` of a projection's output (a query/key norm over the whole
    projection, a norm after a block) as the ops torch's composite runs, bitwise alike, so that
    its mean square over split features can be a partial sum (``graph.walk._statistic``); a fused
    norm over a split dim would make its input gathered. Norms of anything else (the residual
    stream's) stay fused. Returns how many changed.

        before:  y = rms_norm(q, [d], w, eps)                                   # q = linear(...)
        after:   f = _to_copy(q, float32); r = rsqrt(add(mean(pow(f, 2), [-1], True), eps))
                 y = _to_copy(mul(mul(f, r), w), q.dtype)                       # (casts if q is not)
    """
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.rms_norm.default or not _projected(node.args[0]):
            continue
        x, shape = node.args[0], node.args[1]
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        eps = node.args[3] if len(node.args) > 3 else node.kwargs.get("eps")
        value = x.meta["val"]
        wide = torch.promote_types(value.dtype, torch.float32)  # the composite's accumulation dtype
        eps = torch.finfo(wide).eps if eps is None else eps
        dims = list(range(value.dim() - len(shape), value.dim()))
        graph = gm.graph

        def op(target, *args, like, **kwargs):
            new = graph.call_function(target, args, kwargs)
            new.meta["val"] = like
            new.meta["stack_trace"] = node.meta.get("stack_trace")
            return new

        with graph.inserting_before(node):
            wide_value = value.to(wide)
            f = op(aten._to_copy.default, x, like=wide_value, dtype=wide) if wide != value.dtype else x
            square = op(aten.pow.Tensor_Scalar, f, 2, like=wide_value)
            stat = wide_value.mean(dims, keepdim=True)
            mean = op(aten.mean.dim, square, dims, True, like=stat)
            r = op(aten.rsqrt.default, op(aten.add.Tensor, mean, eps, like=stat), like=stat)
            y = op(aten.mul.Tensor, f, r, like=wide_value)
            if isinstance(weight, fx.Node):
                y = op(aten.mul.Tensor, y, weight, like=wide_value * weight.meta["val"])
            if y.meta["val"].dtype != value.dtype:
                y = op(aten._to_copy.default, y, like=node.meta["val"], dtype=value.dtype)
        _take_over(gm, node, y)
        changed += 1
    if changed:
        gm.recompile()
    return changed


_SIZED_BY = {aten.expand_as.default: aten.expand.default, aten.view_as.default: aten.view.default,
             aten.reshape_as.default: aten.reshape.default}


def sizes_as_arguments(gm: fx.GraphModule) -> int:
    """Rewrite ``expand_as``/``view_as``/``reshape_as`` with the other tensor's (static) shape as a
    size argument; returns how many changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SIZED_BY:
            continue
        x, other = node.args[:2]
        size = list(other.meta["val"].shape) if isinstance(other, fx.Node) else None
        if size is None or not all(isinstance(d, int) for d in size):
            continue  # a size known only at run time: left as it is (run whole with the routing)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(_SIZED_BY[node.target], (x, size))
        _take_over(gm, node, new)
        changed += 1
    if changed:
        gm.recompile()
    return changed


def _take_over(gm: fx.GraphModule, node: fx.Node, new: fx.Node) -> None:
    """``new`` replaces ``node``: its meta (value, source line), its readers; ``node`` goes."""
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
