"""Our forward rules: where an op's inputs must live for it to run on local tensors, and where
its output lives, for the ops the training IR keeps whole and the ones whose splits we track in
fused segments (DTensor has no placement for those). Each is one ``ForwardRule`` of the registry
(``graph.rules.registry``); ``None`` from a rule means "not for these placements": DTensor's
strategies are asked next.

Partial sums never reach these rules (``registry.forward_rule`` passes them through data
movement or asks for a reduction first), so a rule sees replicated and split inputs only.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from sptransform.graph.nodes import is_grouped_mm, output_shape, packet, shape_of
from sptransform.graph.placement import PARTIAL, REPLICATED, DimShard, whole
from sptransform.graph.rules.base import Decision, LinksRule, RuleContext, replicated_like, same_for_each_output
from sptransform.graph.rules.links import einsum_subscripts
from sptransform.graph.rules.geometry import cat_pieces, is_split, reshape_spec, slice_bounds, slice_output_spec, split_dim, split_output_specs

aten = torch.ops.aten


def _ndim(node: fx.Node) -> int:
    return len(shape_of(node))


# ---------------------------------------------------------------------------
# views and dim-linked ops


def view_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    """``view(x: [4, 6, 8] split on 8, [24, 8])`` is split on its 8; a view that cannot keep the
    split (it would cut a rank's part) reads ``x`` whole."""
    x = node.args[0]
    placement = current[x]
    moved = reshape_spec(placement, shape_of(x), shape_of(node), ctx.tp)
    if moved is None:
        return Decision({x: REPLICATED}, REPLICATED)
    return Decision({x: placement}, moved)


def linked_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    """Ops whose output dims correspond one to one to input dims (their ``LinksRule``):
    the output is split where the split inputs' dims lead; replicated inputs whose linked dim
    is not broadcast are cut to match; a split that does not survive the op is gathered."""
    if links is None:
        return None
    try:
        linked, forbidden = links(node)
    except KeyError:  # no links for this call (repeat_interleave by a tensor)
        return None
    p = packet(node)
    out_spec = None
    for arg, mapping in linked:
        spec = current.get(arg)
        if not isinstance(spec, DimShard):
            continue
        inverse = {v: k for k, v in mapping.items()}
        out_dim = inverse.get(spec.dim)
        if out_dim is None or out_dim in forbidden:
            continue  # this input's split does not survive the op: it is gathered below
        candidate = _carried(spec, arg, out_dim, node, p)
        if candidate is not None and out_spec is None:
            out_spec = candidate
    if out_spec is None:
        return Decision({a: REPLICATED for a in current}, replicated_like(node))
    needs = {}
    for arg, mapping in linked:
        if arg not in current:
            continue
        in_dim = mapping.get(out_spec.dim)
        if in_dim is None:
            needs[arg] = REPLICATED  # broadcast along the split dim: every rank reads it whole
        else:
            needs[arg] = _in_spec(out_spec, arg, in_dim, node, p)
    for arg in current:
        needs.setdefault(arg, REPLICATED)
    return Decision(needs, same_for_each_output(node, out_spec))


def _carried(spec: DimShard, arg: fx.Node, out_dim: int, node: fx.Node, p) -> DimShard | None:
    """``spec`` of input ``arg`` expressed on the output's ``out_dim``."""
    in_size, out_size = shape_of(arg)[spec.dim], output_shape(node)[out_dim]
    if in_size == out_size:
        return DimShard(out_dim, spec.segments)
    if p is aten.repeat_interleave and out_size % in_size == 0 and len(spec.segments) == 1:
        return whole(out_dim, out_size)  # rank r's rows [a, b) repeat into [a*k, b*k)
    return None


def _in_spec(out_spec: DimShard, arg: fx.Node, in_dim: int, node: fx.Node, p) -> object:
    in_size, out_size = shape_of(arg)[in_dim], output_shape(node)[out_spec.dim]
    if in_size == out_size:
        return DimShard(in_dim, out_spec.segments)
    if p is aten.repeat_interleave and len(out_spec.segments) == 1:
        return whole(in_dim, in_size)
    return REPLICATED



# reductions


def reduction_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    """A reduction over other dims keeps the split; ``sum`` and ``mean`` over the split dim are
    partial sums (``mean``: of this rank's mean scaled by 1/tp); any other reduction over it (max,
    var) reads its input whole."""
    x = node.args[0]
    spec = current[x]
    mapping = links(node)[0][0][1]
    inverse = {v: k for k, v in mapping.items()}
    if spec.dim in inverse:
        return Decision({x: spec}, same_for_each_output(node, DimShard(inverse[spec.dim], spec.segments)))
    if packet(node) is aten.sum:
        return Decision({x: spec}, PARTIAL)  # summing over the split dim: a sum still owed
    padded = sum(n for _, n in spec.segments) != shape_of(x)[spec.dim]  # a vocabulary padded to tp's multiple
    if packet(node) is aten.mean and node.meta["val"].dtype.is_floating_point and not padded:
        # the mean of this rank's elements over tp: a sum still owed (the rewrite scales it,
        # ``passes.tensor_parallel``): every rank holds 1/tp of the reduced elements
        return Decision({x: spec}, PARTIAL)
    return Decision({x: REPLICATED}, replicated_like(node))  # max/var over a split dim: run whole


# ---------------------------------------------------------------------------
# splits


def split_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    """Chunks of a split along another dim keep it; chunks along the split dim take the
    segments inside them (``[q|k|v]`` split in three segments gives q, k, v each split evenly),
    or the input is read whole when a chunk boundary cuts a segment or tp does not divide one."""
    if not is_split(node):
        return None
    x = node.args[0]
    spec = current[x]
    count = len(node.meta["val"])
    try:
        chunks = split_output_specs(node, spec)
    except ValueError:
        return Decision({x: REPLICATED}, (REPLICATED,) * count)
    if spec.dim == split_dim(node) and any(sum(n for _, n in c.segments) % ctx.tp for c in chunks):
        return Decision({x: REPLICATED}, (REPLICATED,) * count)
    return Decision({x: spec}, tuple(chunks))


# ---------------------------------------------------------------------------
# matmuls


def _contraction(node: fx.Node, links: LinksRule):
    """(a, b, bias, a's contracted dim, b's contracted dim, out dims from a, out dims from b): the
    operands' links are the op's own, the contracted dims are the ones no output dim links to."""
    p = packet(node)
    if p is aten.einsum:
        found = einsum_subscripts(node)
        if found is None:
            return None
        (sa, sb), out = found
        contracted = [c for c in sa if c in sb and c not in out]
        if not contracted:
            return None
        (a, from_a), (b, from_b) = links(node)[0][:2]
        return a, b, None, sa.index(contracted[0]), sb.index(contracted[0]), from_a, from_b
    if p not in (aten.linear, aten.addmm) and (_ndim(node.args[0]) < 2 or _ndim(node.args[1]) < 2):
        return None
    (a, from_a), (b, from_b) = links(node)[0][:2]
    if p is aten.linear:
        bias = node.args[2] if len(node.args) > 2 else None
        return a, b, bias, _ndim(a) - 1, 1, from_a, from_b
    if p is aten.addmm:
        return a, b, node.args[0], 1, 0, from_a, from_b
    if is_grouped_mm(node):  # x [S, K] by each group's w[e] [K, N]
        return a, b, None, 1, 1, from_a, from_b
    return a, b, None, _ndim(a) - 1, _ndim(b) - 2, from_a, from_b


def grouped_mm_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    """As a matmul of ``x`` by each group's weight (``links.grouped_mm_links``); the offsets are
    read whole, since they say which of all the rows form each group."""
    decision = matmul_forward(node, links, current, ctx)
    if decision is None:
        return None
    offs = node.args[2]
    return Decision({**decision.needs, offs: REPLICATED}, decision.output, decision.source, decision.note)


def matmul_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    found = _contraction(node, links)
    if found is None:
        return None
    a, b, bias, ka, kb, from_a, from_b = found
    pa, pb = current.get(a, REPLICATED), current.get(b, REPLICATED)
    sa = pa if isinstance(pa, DimShard) else None
    sb = pb if isinstance(pb, DimShard) else None
    # A contraction over split dims: a partial sum (no bias: it would be added on every rank).
    if bias is None and (sa is not None and sa.dim == ka or sb is not None and sb.dim == kb):
        segments = (sa if sa is not None and sa.dim == ka else sb).segments
        if (sa is None or sa.dim == ka) and (sb is None or sb.dim == kb):
            return Decision({a: DimShard(ka, segments), b: DimShard(kb, segments)}, PARTIAL)
    out_from_a = {v: k for k, v in from_a.items()}
    out_from_b = {v: k for k, v in from_b.items()}
    candidates = []
    if sa is not None and sa.dim in out_from_a:
        candidates.append((ctx.is_constant(a), DimShard(out_from_a[sa.dim], sa.segments)))
    if sb is not None and sb.dim in out_from_b:
        candidates.append((ctx.is_constant(b), DimShard(out_from_b[sb.dim], sb.segments)))
    # A weight keeps its split and the activation moves (Megatron's column-parallel linear
    # gathers its input); between two activations, the first operand's split leads.
    candidates.sort(key=lambda c: not c[0])
    out_spec = candidates[0][1] if candidates else None
    if out_spec is None:
        return Decision({x: REPLICATED for x in current}, REPLICATED)
    needs = {}
    for operand, links in ((a, from_a), (b, from_b)):
        d = links.get(out_spec.dim)
        size = shape_of(operand)[d] if d is not None else None
        needs[operand] = DimShard(d, out_spec.segments) if d is not None and size == shape_of(node)[out_spec.dim] else REPLICATED
    if isinstance(bias, fx.Node) and bias in current:
        bias_shape = shape_of(bias)
        last = len(shape_of(node)) - 1
        if out_spec.dim == last and bias_shape and bias_shape[-1] == shape_of(node)[last]:
            needs[bias] = DimShard(len(bias_shape) - 1, out_spec.segments)
        else:
            needs[bias] = REPLICATED
    return Decision(needs, out_spec)


# ---------------------------------------------------------------------------
# attention, embedding, loss


def sdpa_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    """q, k, v split alike along a head (or batch) dim; the mask follows or broadcasts."""
    linked, forbidden = links(node)
    q = node.args[0]
    spec = current.get(q)
    if not isinstance(spec, DimShard) or spec.dim in forbidden or spec.dim >= _ndim(q) - 2:
        return None
    needs = {}
    heads = shape_of(q)[spec.dim]
    for arg, mapping in linked:
        d = mapping.get(spec.dim)
        if d is None:
            needs[arg] = REPLICATED
            continue
        size = shape_of(arg)[d]
        if size == heads:
            needs[arg] = DimShard(d, spec.segments)
        elif len(spec.segments) == 1 and heads % size == 0 and size % ctx.tp == 0:
            needs[arg] = whole(d, size)  # grouped K/V heads: rank r's query heads use its K/V heads
        else:
            return None  # fewer K/V heads than tp: canonicalize.repeat_grouped_kv repeats them first
    for arg in current:
        needs.setdefault(arg, REPLICATED)
    return Decision(needs, same_for_each_output(node, spec))


def embedding_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    weight, ids = node.args[0], node.args[1]
    pw, pi = current.get(weight, REPLICATED), current.get(ids, REPLICATED)
    if isinstance(pw, DimShard) and pw.dim == 0 and len(pw.segments) == 1 and pi == REPLICATED:
        return Decision({weight: pw, ids: REPLICATED}, PARTIAL)  # vocabulary-parallel lookup
    if pw == REPLICATED and isinstance(pi, DimShard):
        return Decision({weight: REPLICATED, ids: pi}, DimShard(pi.dim, pi.segments))
    return None


def cross_entropy_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    logits, target = node.args[0], node.args[1]
    spec = current.get(logits)
    class_dim = 1 if _ndim(logits) > 1 else 0
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if (isinstance(spec, DimShard) and spec.dim == class_dim and len(spec.segments) == 1
            and current.get(target, REPLICATED) == REPLICATED and weight is None and not smoothing):
        return Decision({logits: spec, target: REPLICATED}, REPLICATED)  # vocabulary-parallel loss
    return None


def slice_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    """A slice along a split dim keeps the segments it takes whole (a piece of a fused output)."""
    x = node.args[0]
    spec = current[x]
    if isinstance(spec, DimShard) and spec.dim == slice_bounds(node)[0]:
        out = slice_output_spec(node, spec, ctx.tp)
        return Decision({x: spec}, out) if out is not None else Decision({x: REPLICATED}, REPLICATED)
    return linked_forward(node, links, current, ctx)



def cat_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    """Two or more inputs, every one split along the concatenated dim: the output is split in
    their segments, side by side (each rank concatenates its parts, which is that layout: ``[q |
    k]`` each split by heads, concatenated for a convolution over both). Anything else by the
    links (the cat dim gathered): a replicated input among them, and a concatenation onto empty
    tensors (a KV cache's first write: its output, returned split, must keep the layout the
    decode step reads; split along the sequence by SP instead, the decode read it as heads and
    its self-check found other logits)."""
    d, pieces = cat_pieces(node)
    specs = [(t, offset, current.get(t)) for t, offset, size in pieces if size]
    if len(specs) < 2 or not all(isinstance(spec, DimShard) and spec.dim == d for _, _, spec in specs):
        return linked_forward(node, links, current, ctx)
    segments = tuple((offset + a, n) for _, offset, spec in specs for a, n in spec.segments)
    needs = {t: spec for t, _, spec in specs}
    needs.update({t: REPLICATED for t, _, size in pieces if not size})  # an empty 1-D input adds nothing
    return Decision(needs, DimShard(d, segments))


# ---------------------------------------------------------------------------
# factories that read a tensor for its dtype and device only

READS_METADATA_ONLY = frozenset({aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full})
"""``x.new_empty(size)`` and kin: the size is an argument, ``x`` gives only dtype and device."""


def metadata_forward(node: fx.Node, links: LinksRule | None, current: dict, ctx: RuleContext) -> Decision | None:
    """The input is read where it is (gathering it would move data nobody reads); the output,
    of the size the arguments give, is whole on every rank (MLA's key buffer is made this way
    from a head-split tensor)."""
    return Decision(dict(current), replicated_like(node))
