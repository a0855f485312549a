"""The one registry of per-op sharding knowledge, and the two questions everything asks it.

``RULES`` maps an op overload packet to its ``OpRule``: how its output dims link to its inputs'
(``links``), our forward rule, our backward rule, and whether partial sums pass through it. An
op tagged ``torch.Tag.pointwise`` that is not listed gets ``POINTWISE``. Where an entry has no
rule for a direction (or its rule declines the call), DTensor's registered strategies answer,
through the one bridge ``graph.rules.dtensor``.

``forward_rule(node, placement_of, ctx)`` (asked by ``graph.propagate`` for every op, in graph
order) answers with a ``Decision``. In order:

1. every tensor input replicated -> the op runs as is, output replicated (any op);
2. our forward rule, for the ops the training IR keeps whole and the ones whose splits we track
   in fused segments: views, layout and pointwise ops, reductions, splits, matmuls (a
   contraction over split dims is a partial sum), norms, softmax, SDPA, embedding,
   cross-entropy (vocabulary-parallel), indexing by integer tensors (``W[ids]``: the dims the
   index does not read keep their split), grouped and depthwise convolutions (channels split in
   whole groups, ``groups`` localized), ``cat`` (split inputs side by side in segments), ops
   along one dim (``topk``, ``sort``: the other dims), ``scatter``/``gather`` (the other dims
   where every operand is as large), ``pad`` (the dims it does not pad), ``tril``/``triu``
   (leading dims), and ``new_empty`` and kin (the input read where it is);
3. DTensor's strategies for every other ATen op;
4. none applies: every input is gathered to replicated and the op runs whole on every rank.

Rule 4 is always correct for a deterministic op (each rank computes the single-device value),
so an op nobody wrote a rule for costs communication, never correctness. Partial sums pass
only through ops that move data (``moves_data_only``); anywhere else they must be reduced
first, and the propagation chooses how: all-reduce to replicated, or reduce-scatter to the
sequence split under sequence parallelism.

``input_specs_for_output(node, spec, tp)`` (asked by ``graph.analysis``'s region walk, walking
back from a row-parallel linear) says how each tensor input must be split for the output to be
split as ``spec``: our backward rule, else DTensor's strategies, else ``ShardingError``.

The entries keep the two directions' coverage as it was: DTensor answers forward for the
pointwise ops that torch does not tag pointwise (``zeros_like``, ``rand_like``, ``bernoulli``,
...), and backward for splits and cross-entropy, whose backward the region walk handles itself
(``geometry.split_input_spec``) or never asks.

Nothing here reads names: op overload packets and ``node.meta["val"]`` shapes only.
"""

from __future__ import annotations

import math
import operator
from typing import Callable

import torch
import torch.fx as fx

from sptransform.graph.nodes import describe, is_grouped_mm, output_shape, packet, shape_of
from sptransform.graph.placement import PARTIAL, REPLICATED, DimShard
from sptransform.graph.rules.backward import cat_backward, linked_backward, slice_backward, view_backward
from sptransform.graph.rules.base import (
    Decision, OpRule, RuleContext, ShardingError, replicated_like, same_for_each_output, tensor_inputs,
)
from sptransform.graph.rules.dtensor import dtensor_backward, dtensor_forward
from sptransform.graph.rules.forward import (
    READS_METADATA_ONLY, cat_forward, cross_entropy_forward, embedding_forward, grouped_mm_forward, linked_forward, matmul_forward,
    metadata_forward, reduction_forward, sdpa_forward, slice_forward, split_forward, view_forward,
)
from sptransform.graph.rules.geometry import SPLIT_PACKETS, VIEWS
from sptransform.graph.rules.links import (
    ALONG_DIM, SCATTERS, along_dim_links, flip_links, pad_links, scatter_links, unfold_links,
    POINTWISE as POINTWISE_PACKETS, REDUCING_OVERLOADS, REDUCTIONS, addmm_links, grouped_mm_links, reduction_links,
    CONVOLUTIONS, TRIANGLES, cat_links, conv_aligned, conv_links, einsum_links, embedding_links, triangle_links,
    expand_links, index_add_links, index_links, index_select_links, linear_links, matmul_links, norm_links,
    permute_links, pointwise_links,
    repeat_interleave_links, sdpa_links, select_links, slice_links, squeeze_links, t_links, transpose_links,
    unsqueeze_links,
)
from sptransform.torch_internals import OpOverload

aten = torch.ops.aten

PlacementOf = Callable[[fx.Node], object]


def _is_pointwise(node: fx.Node) -> bool:
    return isinstance(node.target, OpOverload) and torch.Tag.pointwise in node.target.tags


def _if_tagged_pointwise(node, links, current, ctx) -> Decision | None:
    """Listed as elementwise but not tagged so by torch for every overload: our rule only for
    the tagged overloads, DTensor's for the others."""
    return linked_forward(node, links, current, ctx) if _is_pointwise(node) else None


POINTWISE = OpRule(pointwise_links, linked_forward, linked_backward)

_LAYOUT = {  # only move data: (links, partial sums pass)
    aten.transpose: transpose_links, aten.t: t_links, aten.numpy_T: t_links, aten.mT: t_links,
    aten.permute: permute_links, aten.unsqueeze: unsqueeze_links, aten.squeeze: squeeze_links,
    aten.expand: expand_links, aten.broadcast_to: expand_links,  # broadcast_to(x, size) is expand(x, size)
}
_COPIES = {aten.clone, aten.contiguous, aten.alias, aten.detach, aten.to, aten._to_copy, aten.type_as,
           aten.lift_fresh_copy}
_LINKED_POINTWISE = _COPIES | {aten.where, aten.masked_fill, aten.dropout, aten.softmax, aten._softmax,
                               aten.log_softmax, aten._log_softmax}

REDUCTION = OpRule(reduction_links, reduction_forward, linked_backward)


def _along_dim_forward(node: fx.Node, links, current: dict, ctx: RuleContext) -> Decision | None:
    """``topk``/``sort`` keep a split of another dim in one segment (heads); a split in several
    segments (tokens: the batch merged with the sequence) is gathered, as DTensor's rule did: the
    router's top-k then stays whole, which expert parallelism's dispatch reads (carried split, the
    dispatch of tp x ep sent 2x the hidden states)."""
    if any(isinstance(p, DimShard) and len(p.segments) > 1 for p in current.values()):
        return Decision({a: REPLICATED for a in current}, replicated_like(node))
    return linked_forward(node, links, current, ctx)


def _conv_forward(node: fx.Node, links, current: dict, ctx: RuleContext) -> Decision | None:
    """A grouped convolution keeps a channel split whose pieces hold whole groups; any other
    split of its channels is gathered (a piece cutting a group would need the group's other
    channels)."""
    decision = linked_forward(node, links, current, ctx)
    out = decision.output if decision is not None else None
    if isinstance(out, DimShard) and out.dim == 1 and not conv_aligned(node, out.segments, ctx.tp):
        return Decision({a: REPLICATED for a in current}, replicated_like(node))
    return decision


def _conv_backward(node: fx.Node, links, spec: DimShard, tp: int) -> list | None:
    if spec.dim == 1 and not conv_aligned(node, spec.segments, tp):
        raise ShardingError(f"{describe(node)}: a split of its channels into pieces of {spec.local_size(tp)} "
                            "cuts through its groups")
    return linked_backward(node, links, spec, tp)


RULES: dict[object, OpRule] = {
    **{p: OpRule(pointwise_links, linked_forward if p in _LINKED_POINTWISE else _if_tagged_pointwise,
                 linked_backward, moves_data_only=p in _COPIES) for p in POINTWISE_PACKETS},
    **{p: OpRule(links, linked_forward, linked_backward, moves_data_only=True) for p, links in _LAYOUT.items()},
    **{p: OpRule(None, view_forward, view_backward, moves_data_only=True) for p in VIEWS},
    **{p: REDUCTION for p in REDUCTIONS},
    **{p: OpRule(None, split_forward, None) for p in SPLIT_PACKETS},
    aten.layer_norm: OpRule(norm_links, linked_forward, linked_backward),
    aten.rms_norm: OpRule(norm_links, linked_forward, linked_backward),
    aten.slice: OpRule(slice_links, slice_forward, slice_backward),
    aten.select: OpRule(select_links, linked_forward, linked_backward),
    aten.repeat_interleave: OpRule(repeat_interleave_links, linked_forward, linked_backward),
    aten.cat: OpRule(cat_links, cat_forward, cat_backward),
    aten.index_select: OpRule(index_select_links, linked_forward, linked_backward),
    **{p: OpRule(along_dim_links, _along_dim_forward, linked_backward) for p in ALONG_DIM},
    **{p: OpRule(pad_links, linked_forward, linked_backward) for p in (aten.constant_pad_nd, aten.pad)},
    **{p: OpRule(scatter_links, linked_forward, linked_backward) for p in SCATTERS},
    aten.unfold: OpRule(unfold_links, linked_forward, linked_backward, moves_data_only=True),
    aten.flip: OpRule(flip_links, linked_forward, linked_backward, moves_data_only=True),
    aten.index_add: OpRule(index_add_links, linked_forward, linked_backward),
    aten.index: OpRule(index_links, linked_forward, linked_backward),
    **{p: OpRule(conv_links, _conv_forward, _conv_backward) for p in CONVOLUTIONS},
    **{p: OpRule(triangle_links, linked_forward, linked_backward) for p in TRIANGLES},
    aten.mm: OpRule(matmul_links, matmul_forward, linked_backward),
    aten.einsum: OpRule(einsum_links, matmul_forward, linked_backward),
    aten.bmm: OpRule(matmul_links, matmul_forward, linked_backward),
    aten.matmul: OpRule(matmul_links, matmul_forward, linked_backward),
    aten.linear: OpRule(linear_links, matmul_forward, linked_backward),
    aten.addmm: OpRule(addmm_links, matmul_forward, linked_backward),
    aten.scaled_dot_product_attention: OpRule(sdpa_links, sdpa_forward, linked_backward),
    aten.embedding: OpRule(embedding_links, embedding_forward, linked_backward),
    aten.cross_entropy_loss: OpRule(None, cross_entropy_forward, None),
    **{p: OpRule(None, metadata_forward, None) for p in READS_METADATA_ONLY},
}


GROUPED_MM = OpRule(grouped_mm_links, grouped_mm_forward, linked_backward)
"""``nodes.GROUPED_MM_OPS``, known by schema name (one of them is transformers' custom op)."""


def rule_for(node: fx.Node) -> OpRule | None:
    """The registry's entry for ``node``'s op (None: DTensor's strategies are all there is)."""
    if node.op != "call_function":
        return None
    if is_grouped_mm(node):
        return GROUPED_MM
    if node.target in REDUCING_OVERLOADS:
        return REDUCTION
    rule = RULES.get(packet(node))
    if rule is None and _is_pointwise(node):
        return POINTWISE
    return rule


def reduces_into_alike_outputs(node: fx.Node) -> bool:
    """An op with several tensor outputs of one shape, each linked alike to its input (``max.dim``
    and ``topk``: values and indices, ``var_mean``): each output is split as the others, so a
    split wanted of one is the op's."""
    value = node.meta.get("val")
    rule = rule_for(node)
    alike = rule is REDUCTION or (rule is not None and rule.links is along_dim_links)
    return alike and isinstance(value, (tuple, list)) and output_shape(node) is not None


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
        return Decision({a: REPLICATED for a in inputs}, replicated_like(node), "replicated")
    rule = rule_for(node)
    if PARTIAL in current.values():
        # Partial sums move through data movement only (views, transposes, casts), and only when
        # that is their one reader: with several, one reduction at the source serves them all.
        # Anything else, even a linear op, reads them reduced: the caller chooses the reduction.
        if rule is not None and rule.moves_data_only and len(current) == 1 and len(inputs[0].users) == 1:
            return Decision({a: PARTIAL for a in inputs}, same_for_each_output(node, PARTIAL))
        if _joins_partial_sums(node, current) or _linear_in_its_partial_input(node, current):
            return Decision(dict(current), PARTIAL)
        return None
    decision = None
    if rule is not None and rule.forward is not None:
        decision = rule.forward(node, rule.links, current, ctx)
    if decision is None:
        decision = dtensor_forward(node, current, ctx.tp)
    return decision if decision is not None else gather_all(node, inputs)


def _joins_partial_sums(node: fx.Node, current: dict) -> bool:
    """``cat``/``stack`` of partial sums only (experts' row-parallel outputs laid end to end):
    the pieces of a sum are the sum of the pieces, so the joined tensor is a partial sum and one
    reduction of it replaces one per piece. Each piece must be read by the join alone; a
    replicated piece would be counted ``tp`` times."""
    return (packet(node) in (aten.cat, aten.stack) and all(p == PARTIAL for p in current.values())
            and all(len(a.users) == 1 for a in current))


_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


def _zeros(node: fx.Node) -> bool:
    """Made as zeros: a valid partial sum on every rank (``tp`` zeros sum to zero)."""
    return node.target in _ZEROS or (
        node.target in (aten.full.default, aten.full_like.default, aten.new_full.default)
        and len(node.args) > 1 and node.args[-1] == 0 and not node.kwargs.get("fill_value"))


def _linear_in_its_partial_input(node: fx.Node, current: dict) -> bool:
    """Ops linear in a partial-sum input, the others the same on every rank, that keep its size:
    ``y * w`` and ``y / w`` (an expert's output scaled by its routing weight) and
    ``index_add(out, d, ids, y)`` into zeros or into a partial sum (experts' outputs laid back
    where their tokens came from, one after another). Each rank's term of the sum goes through
    the op alike, so the output is a partial sum and one reduction after a chain of them replaces
    one per expert. The partial input must have no other reader (one reduction at the source
    would serve them all) and must not be broadcast to a larger output (a larger sum to reduce).
    A replicated operand's gradient through such an op is a partial sum: the gradient plan sees
    the op's partial output and sums it (``graph.gradients``)."""
    partial = [a for a, p in current.items() if p == PARTIAL]
    if any(len(a.users) != 1 for a in partial) or any(p not in (PARTIAL, REPLICATED) for p in current.values()):
        return False  # a split operand (a sequence-split gate) is not the same on every rank
    op = packet(node)
    if op in (aten.mul, aten.div):
        y = partial[0] if len(partial) == 1 else None
        if y is None or node.args.count(y) != 1 or (op is aten.div and node.args[0] is not y):
            return False  # y * y is not linear in y
        out, shape = shape_of(node), shape_of(y)
        return out is not None and shape is not None and math.prod(out) == math.prod(shape)
    if op is aten.index_add:
        x, _, ids, source = node.args[:4]
        return (current.get(source) == PARTIAL and current.get(ids) != PARTIAL
                and (current.get(x) == PARTIAL or _zeros(x))
                and node.kwargs.get("alpha", node.args[4] if len(node.args) > 4 else 1) == 1)
    return False


def gather_all(node: fx.Node, inputs: list[fx.Node]) -> Decision:
    """Rule 4: every input replicated, the op runs whole."""
    return Decision({a: REPLICATED for a in inputs}, replicated_like(node), "gather")


def input_specs_for_output(node: fx.Node, spec: DimShard, tp: int) -> list[tuple[fx.Node, object]]:
    """How each tensor input of ``node`` must be split so that its output is split as ``spec``:
    ``[(input, split | None | CUT)]``, None for an input read whole, ``CUT`` for one computed
    whole and cut where it is read. ``ShardingError`` when no rule can split the output so."""
    rule = rule_for(node)
    if rule is not None and rule.backward is not None:
        wanted = rule.backward(node, rule.links, spec, tp)
        if wanted is not None:
            return wanted
    return dtensor_backward(node, spec)


__all__ = ["POINTWISE", "RULES", "ShardingError", "forward_rule", "gather_all", "input_specs_for_output",
           "reduces_into_alike_outputs", "rule_for"]
