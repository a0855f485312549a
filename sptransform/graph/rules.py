"""Forward sharding rules: given where an op's inputs live, where must they live for the op to
run on local tensors, and where does its output live?

``forward_rule(node, placement_of, tp)`` answers with a ``Decision``: the placement each tensor
input must have (equal to its current one when nothing moves) and the output's placement.
Rules, in the order they are tried:

1. every tensor input replicated -> the op runs as is, output replicated (any op);
2. ours, for the ops the training IR keeps whole and the ones whose splits we track in
   fused segments: views (``reshape_spec``), layout and pointwise ops and reductions
   (``sharding.dim_links``), splits, matmuls (``linear``, ``addmm``, ``mm``, ``bmm``,
   ``matmul``: a contraction over split dims is a partial sum), norms, softmax, SDPA,
   embedding (vocabulary-parallel), cross-entropy (vocabulary-parallel);
3. DTensor's registered strategies (``graph.dtensor_rules``) for every other ATen op;
4. none applies: every input is gathered to replicated and the op runs whole on every rank.

Rule 4 is always correct for a deterministic op (each rank computes the single-device value),
so an op nobody wrote a rule for costs communication, never correctness. Partial sums pass
only through ops that are linear in them (sums, scaling by a replicated tensor, views, casts,
contractions); anywhere else they must be reduced first, and the propagation
(``graph.propagate``) chooses how: all-reduce to replicated, or reduce-scatter to the
sequence split under sequence parallelism.

Nothing here reads names: op overload packets and ``node.meta["val"]`` shapes only.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial as DTPartial
from torch.distributed.tensor import Replicate as DTReplicate
from torch.distributed.tensor import Shard as DTShard

from sptransform.graph.nodes import packet
from sptransform.torch_internals import OpOverload
from sptransform.graph.placement import PARTIAL, REPLICATED, PartialSum, Placement, Replicated
from sptransform.graph.sharding import (
    SPLIT_PACKETS,
    DimShard,
    dim_links,
    is_split,
    reshape_spec,
    shape_of,
    slice_bounds,
    slice_output_spec,
    split_dim,
    split_output_specs,
    whole,
)

aten = torch.ops.aten

PlacementOf = Callable[[fx.Node], object]


@dataclass(frozen=True)
class RuleContext:
    tp: int
    is_constant: Callable[[fx.Node], bool]
    """Computed from parameters and buffers only (a weight, its transpose, its cast): a
    matmul keeps such an operand where it is and moves the other one."""


@dataclass(frozen=True)
class Decision:
    needs: dict
    """Tensor input node -> the placement the op reads it in (a redistribution where it differs)."""
    output: object
    """The output's placement (a tuple for ops with several outputs)."""
    source: str = "ours"
    """Which rule decided: ``replicated``, ``ours``, ``dtensor`` or ``gather``."""


_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten}
_PASS_PARTIAL = {  # ops that only move data (or cast it): a partial sum passes through unreduced
    aten.clone, aten.contiguous, aten.alias, aten.detach, aten.to, aten._to_copy, aten.type_as,
    aten.transpose, aten.t, aten.numpy_T, aten.mT, aten.permute, aten.unsqueeze, aten.squeeze, aten.expand,
    aten.lift_fresh_copy, aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten,
}
_MATMULS = {aten.mm, aten.bmm, aten.matmul, aten.linear, aten.addmm}
_DROPOUTS = {aten.dropout, aten.native_dropout}


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued inputs, in order of first appearance."""
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _ndim(node: fx.Node) -> int:
    return len(shape_of(node))


def forward_rule(node: fx.Node, placement_of: PlacementOf, ctx: RuleContext) -> Decision | None:
    """Where ``node``'s inputs must live and where its output lives (see module docstring).

    ``None`` when a partial-sum input must be reduced first (the op is not linear in it):
    the caller chooses the reduction and asks again."""
    if node.target is operator.getitem:
        parent, index = node.args
        placement = placement_of(parent)
        return Decision({}, placement[index] if isinstance(placement, tuple) else placement)
    inputs = tensor_inputs(node)
    current = {a: placement_of(a) for a in inputs}
    if all(p == REPLICATED for p in current.values()):
        return Decision({a: REPLICATED for a in inputs}, _replicated_like(node), "replicated")
    p = packet(node)
    if PARTIAL in current.values():
        # Partial sums move through data movement only (views, transposes, casts), and only when
        # that is their one reader: with several, one reduction at the source serves them all.
        # Anything else, even a linear op, reads them reduced: the caller chooses the reduction.
        if p in _PASS_PARTIAL and len(current) == 1 and len(inputs[0].users) == 1:
            return Decision({a: PARTIAL for a in inputs}, _multi(node, PARTIAL))
        return None
    ours = _OURS.get(p)
    decision = None
    if ours is not None:
        decision = ours(node, current, ctx)
    elif p in _SIMPLE_LINKED or _is_pointwise(node):
        decision = _linked(node, current, ctx)
    if decision is None:
        decision = _from_dtensor(node, current, ctx.tp)
    return decision if decision is not None else gather_all(node, inputs)


def gather_all(node: fx.Node, inputs: list[fx.Node]) -> Decision:
    """Rule 4: every input replicated, the op runs whole."""
    return Decision({a: REPLICATED for a in inputs}, _replicated_like(node), "gather")


def _replicated_like(node: fx.Node):
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return tuple(REPLICATED if isinstance(v, torch.Tensor) else None for v in value)
    return REPLICATED if isinstance(value, torch.Tensor) else None


# ---------------------------------------------------------------------------
# views and dim-linked ops


def _view(node: fx.Node, current: dict, ctx: RuleContext) -> Decision | None:
    x = node.args[0]
    placement = current[x]
    moved = reshape_spec(placement, shape_of(x), shape_of(node), ctx.tp)
    if moved is None:
        return Decision({x: REPLICATED}, REPLICATED)
    return Decision({x: placement}, moved)


_SIMPLE_LINKED = {
    aten.transpose, aten.t, aten.numpy_T, aten.mT, aten.permute, aten.unsqueeze, aten.squeeze, aten.expand, aten.slice,
    aten.select, aten.repeat_interleave, aten.cat, aten.index_select, aten.clone, aten.contiguous, aten.alias, aten.detach,
    aten.to, aten._to_copy, aten.type_as, aten.lift_fresh_copy, aten.where, aten.masked_fill, aten.dropout,
    aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.layer_norm, aten.rms_norm,
}


def _is_pointwise(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, OpOverload) and torch.Tag.pointwise in target.tags


def _linked(node: fx.Node, current: dict, ctx: RuleContext) -> Decision | None:
    """Ops whose output dims correspond one to one to input dims (``sharding.dim_links``):
    the output is split where the split inputs' dims lead; replicated inputs whose linked dim
    is not broadcast are cut to match; partial sums pass where the op is linear in them."""
    try:
        links, forbidden = dim_links(node)
    except KeyError:
        return None
    p = packet(node)
    out_spec = None
    for arg, mapping in links:
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
        return Decision({a: REPLICATED for a in current}, _replicated_like(node))
    needs = {}
    for arg, mapping in links:
        if arg not in current:
            continue
        in_dim = mapping.get(out_spec.dim)
        if in_dim is None:
            needs[arg] = REPLICATED  # broadcast along the split dim: every rank reads it whole
        else:
            needs[arg] = _in_spec(out_spec, arg, in_dim, node, p)
    for arg in current:
        needs.setdefault(arg, REPLICATED)
    return Decision(needs, _multi(node, out_spec))


def _carried(spec: DimShard, arg: fx.Node, out_dim: int, node: fx.Node, p) -> DimShard | None:
    """``spec`` of input ``arg`` expressed on the output's ``out_dim``."""
    in_size, out_size = shape_of(arg)[spec.dim], shape_of(node)[out_dim]
    if in_size == out_size:
        return DimShard(out_dim, spec.segments)
    if p is aten.repeat_interleave and out_size % in_size == 0 and len(spec.segments) == 1:
        return whole(out_dim, out_size)  # rank r's rows [a, b) repeat into [a*k, b*k)
    return None


def _in_spec(out_spec: DimShard, arg: fx.Node, in_dim: int, node: fx.Node, p) -> object:
    in_size, out_size = shape_of(arg)[in_dim], shape_of(node)[out_spec.dim]
    if in_size == out_size:
        return DimShard(in_dim, out_spec.segments)
    if p is aten.repeat_interleave and len(out_spec.segments) == 1:
        return whole(in_dim, in_size)
    return REPLICATED


def _multi(node: fx.Node, placement):
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):  # native_dropout: (out, mask) share the split
        return tuple(placement if isinstance(v, torch.Tensor) else None for v in value)
    return placement


# ---------------------------------------------------------------------------
# reductions


def _reduction(node: fx.Node, current: dict, ctx: RuleContext) -> Decision | None:
    x = node.args[0]
    spec = current[x]
    links, _ = dim_links(node)
    mapping = links[0][1]
    inverse = {v: k for k, v in mapping.items()}
    if spec.dim in inverse:
        return Decision({x: spec}, _multi(node, DimShard(inverse[spec.dim], spec.segments)))
    if packet(node) is aten.sum:
        return Decision({x: spec}, PARTIAL)  # summing over the split dim: a sum still owed
    return Decision({x: REPLICATED}, _replicated_like(node))  # mean/max/var over a split dim: run whole


# ---------------------------------------------------------------------------
# splits


def _split(node: fx.Node, current: dict, ctx: RuleContext) -> Decision | None:
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


def _contraction(node: fx.Node):
    """(a, b, bias, a's contracted dim, b's contracted dim, out dims from a, out dims from b)."""
    p = packet(node)
    args = node.args
    if p is aten.linear:
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else None
        n = _ndim(x)
        return x, w, bias, n - 1, 1, {o: o for o in range(n - 1)}, {n - 1: 0}
    if p is aten.addmm:
        bias, a, b = args[:3]
        return a, b, bias, 1, 0, {0: 0}, {1: 1}
    a, b = args[0], args[1]
    na, nb = _ndim(a), _ndim(b)
    if na < 2 or nb < 2:
        return None
    out = shape_of(node)
    n = len(out)
    from_a, from_b = {n - 2: na - 2}, {n - 1: nb - 1}
    for o in range(n - 2):
        for shape, links, offset in ((shape_of(a), from_a, n - na), (shape_of(b), from_b, n - nb)):
            d = o - offset
            if 0 <= d < len(shape) - 2 and shape[d] == out[o]:
                links[o] = d
    return a, b, None, na - 1, nb - 2, from_a, from_b


def _matmul(node: fx.Node, current: dict, ctx: RuleContext) -> Decision | None:
    found = _contraction(node)
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


def _sdpa(node: fx.Node, current: dict, ctx: RuleContext) -> Decision | None:
    """q, k, v split alike along a head (or batch) dim; the mask follows or broadcasts."""
    links, forbidden = dim_links(node)
    q = node.args[0]
    spec = current.get(q)
    if not isinstance(spec, DimShard) or spec.dim in forbidden or spec.dim >= _ndim(q) - 2:
        return None
    needs = {}
    heads = shape_of(q)[spec.dim]
    for arg, mapping in links:
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
    return Decision(needs, _multi(node, spec))


def _embedding(node: fx.Node, current: dict, ctx: RuleContext) -> Decision | None:
    weight, ids = node.args[0], node.args[1]
    pw, pi = current.get(weight, REPLICATED), current.get(ids, REPLICATED)
    if isinstance(pw, DimShard) and pw.dim == 0 and len(pw.segments) == 1 and pi == REPLICATED:
        return Decision({weight: pw, ids: REPLICATED}, PARTIAL)  # vocabulary-parallel lookup
    if pw == REPLICATED and isinstance(pi, DimShard):
        return Decision({weight: REPLICATED, ids: pi}, DimShard(pi.dim, pi.segments))
    return None


def _cross_entropy(node: fx.Node, current: dict, ctx: RuleContext) -> Decision | None:
    logits, target = node.args[0], node.args[1]
    spec = current.get(logits)
    class_dim = 1 if _ndim(logits) > 1 else 0
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if (isinstance(spec, DimShard) and spec.dim == class_dim and len(spec.segments) == 1
            and current.get(target, REPLICATED) == REPLICATED and weight is None and not smoothing):
        return Decision({logits: spec, target: REPLICATED}, REPLICATED)  # vocabulary-parallel loss
    return None


def _slice(node: fx.Node, current: dict, ctx: RuleContext) -> Decision | None:
    """A slice along a split dim keeps the segments it takes whole (a piece of a fused output)."""
    x = node.args[0]
    spec = current[x]
    if isinstance(spec, DimShard) and spec.dim == slice_bounds(node)[0]:
        out = slice_output_spec(node, spec)
        return Decision({x: spec}, out) if out is not None else Decision({x: REPLICATED}, REPLICATED)
    return _linked(node, current, ctx)


_OURS = {
    aten.slice: _slice,
    **{p: _view for p in _VIEWS},
    **{p: _reduction for p in (aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.std, aten.var_mean)},
    **{p: _split for p in SPLIT_PACKETS},
    **{p: _matmul for p in _MATMULS},
    aten.scaled_dot_product_attention: _sdpa,
    aten.embedding: _embedding,
    aten.cross_entropy_loss: _cross_entropy,
}


# ---------------------------------------------------------------------------
# DTensor's strategies


def _to_dtensor(placement):
    if placement == REPLICATED:
        return DTReplicate()
    if placement == PARTIAL:
        return DTPartial()
    if isinstance(placement, DimShard) and len(placement.segments) == 1:
        return DTShard(placement.dim)
    return None


def _from_dtensor_placement(placement, node_shape) -> object:
    if isinstance(placement, DTReplicate):
        return REPLICATED
    if isinstance(placement, DTPartial) and placement.reduce_op == "sum":
        return PARTIAL
    if type(placement) is DTShard:
        return whole(placement.dim, node_shape[placement.dim])
    return "unsupported"


def _from_dtensor(node: fx.Node, current: dict, tp: int) -> Decision | None:
    from sptransform.graph.dtensor_rules import dtensor_propagate, flat_input_nodes

    flat = flat_input_nodes(node)
    given = []
    for a in flat:
        if a is None or not _is_tensor(a):
            given.append(None)
            continue
        converted = _to_dtensor(current.get(a, REPLICATED))
        if converted is None:  # a fused (several-segment) split: DTensor has no such placement
            return None
        given.append(converted)
    strategy = dtensor_propagate(node, given, tp)
    if strategy is None:
        return None
    needs = {}
    for a, wanted in zip(flat, strategy.inputs):
        if a is None or not _is_tensor(a):
            continue
        ours = _from_dtensor_placement(wanted, shape_of(a))
        if ours == "unsupported" or needs.get(a, ours) != ours:
            return None
        if ours == PARTIAL and current.get(a) != PARTIAL:
            return None  # a replicated tensor turned into a partial sum: a move we never make
        needs[a] = ours
    value = node.meta.get("val")
    outs = []
    values = value if isinstance(value, (tuple, list)) else [value]
    placements = list(strategy.outputs)
    for v, placement in zip(values, placements):
        if not isinstance(v, torch.Tensor):
            outs.append(None)
            continue
        ours = _from_dtensor_placement(placement, tuple(int(s) for s in v.shape))
        if ours == "unsupported":
            return None
        outs.append(ours)
    output = tuple(outs) if isinstance(value, (tuple, list)) else outs[0]
    decision = Decision(needs, output, "dtensor")
    if not _agrees_numerically(node, decision, tp):
        return None
    return decision


_CHECK_LIMIT = 1 << 16  # elements: a decision on tensors this small is checked by running it


def _agrees_numerically(node: fx.Node, decision: Decision, tp: int) -> bool:
    """Run the op whole and on each rank's parts, on random values, and compare: a foreign rule
    that splits (or passes through) a tensor is trusted only if the pieces agree. Ops on large
    tensors, random ops and ops reading integer tensors are not run (True)."""
    from sptransform.graph.nodes import is_random

    outputs = decision.output if isinstance(decision.output, tuple) else (decision.output,)
    if all(p in (REPLICATED, None) for p in outputs) or is_random(node):
        return True
    tensors = tensor_inputs(node)
    values = [a.meta["val"] for a in tensors]
    out = node.meta["val"]
    out_values = out if isinstance(out, (tuple, list)) else [out]
    if any(not v.is_floating_point() for v in values) or \
            sum(v.numel() for v in values) + sum(o.numel() for o in out_values if isinstance(o, torch.Tensor)) > _CHECK_LIMIT:
        return True
    from sptransform.torch_internals import maybe_disable_local_tensor_mode
    from sptransform.torch_internals import disable_current_modes

    try:
        with disable_current_modes(), maybe_disable_local_tensor_mode(), torch.no_grad():
            generator = torch.Generator().manual_seed(0)
            full = {a: torch.randn(v.shape, dtype=torch.float64, generator=generator) for a, v in zip(tensors, values)}

            def run(inputs):
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: inputs.get(a, a))
                result = node.target(*args, **kwargs)
                return result if isinstance(result, (tuple, list)) else (result,)

            whole_out = run(full)
            for rank in range(tp):
                local = {a: _piece(full[a], decision.needs.get(a, REPLICATED), rank, tp) for a in tensors}
                for got, want, placement in zip(run(local), whole_out, outputs):
                    if placement is None or not isinstance(want, torch.Tensor):
                        continue
                    expected = _piece(want, placement, rank, tp) if placement != PARTIAL else None
                    if expected is not None and (got.shape != expected.shape or not torch.allclose(got, expected)):
                        return False
            return True
    except Exception:  # the op does not run on plain tensors this way: no evidence either way
        return True


def _piece(value: torch.Tensor, placement, rank: int, tp: int) -> torch.Tensor:
    if isinstance(placement, DimShard):
        return value.index_select(placement.dim, torch.tensor(placement.indices(rank, tp)))
    return value


__all__ = ["Decision", "RuleContext", "forward_rule", "gather_all", "tensor_inputs", "Placement", "Replicated",
           "PartialSum", "is_split"]
