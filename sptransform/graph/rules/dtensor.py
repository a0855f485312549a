"""The one bridge to DTensor: our placements to and from DTensor's, and the two questions the
registry asks DTensor's strategies (``graph.dtensor_rules``) for ops it has no rule of its own for.

* forward (``dtensor_forward``): the strategy DTensor's propagator picks for the inputs' current
  placements, trusted only if running the op whole and on each rank's pieces agree;
* backward (``dtensor_backward``): a strategy whose output is split as asked and whose inputs are
  split or replicated (no partial sums).

DTensor has placements for an even split (``Shard``), replicated and partial sums; a fused,
several-segment split has none here, so DTensor is not asked about it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial as DTPartial
from torch.distributed.tensor import Replicate as DTReplicate
from torch.distributed.tensor import Shard as DTShard

from sptransform.graph.dtensor_rules import dtensor_propagate, dtensor_strategies, flat_input_nodes
from sptransform.graph.nodes import describe, is_random, shape_of
from sptransform.graph.placement import PARTIAL, REPLICATED, DimShard, whole
from sptransform.graph.rules.base import Decision, ShardingError, tensor_inputs
from sptransform.torch_internals import disable_current_modes, maybe_disable_local_tensor_mode

UNSUPPORTED = "unsupported"
"""``from_dtensor`` of a DTensor placement we have no counterpart for (``Partial("max")``, ...)."""


def to_dtensor(placement):
    """Ours -> DTensor's; None for a fused (several-segment) split, which DTensor cannot express."""
    if placement == REPLICATED:
        return DTReplicate()
    if placement == PARTIAL:
        return DTPartial()
    if isinstance(placement, DimShard) and len(placement.segments) == 1:
        return DTShard(placement.dim)
    return None


def from_dtensor(placement, shape) -> object:
    """DTensor's -> ours, for a tensor of ``shape``; ``UNSUPPORTED`` where we have none."""
    if isinstance(placement, DTReplicate):
        return REPLICATED
    if isinstance(placement, DTPartial) and placement.reduce_op == "sum":
        return PARTIAL
    if type(placement) is DTShard:
        return whole(placement.dim, shape[placement.dim])
    return UNSUPPORTED


def _is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


# ---------------------------------------------------------------------------
# forward


def dtensor_forward(node: fx.Node, current: dict, tp: int) -> Decision | None:
    """DTensor's pick for the inputs placed ``current``, as our ``Decision`` (source ``dtensor``);
    None when DTensor has none, wants a move we never make, or running it disagrees."""
    flat = flat_input_nodes(node)
    given = []
    for a in flat:
        if a is None or not _is_tensor(a):
            given.append(None)
            continue
        converted = to_dtensor(current.get(a, REPLICATED))
        if converted is None:  # a fused (several-segment) split: DTensor has no such placement
            return None
        given.append(converted)
    strategy = dtensor_propagate(node, given, tp).value
    if strategy is None:
        return None
    needs = {}
    for a, wanted in zip(flat, strategy.inputs):
        if a is None or not _is_tensor(a):
            continue
        ours = from_dtensor(wanted, shape_of(a))
        if ours == UNSUPPORTED or needs.get(a, ours) != ours:
            return None
        if ours == PARTIAL and current.get(a) != PARTIAL:
            return None  # a replicated tensor turned into a partial sum: a move we never make
        needs[a] = ours
    value = node.meta.get("val")
    outs = []
    values = value if isinstance(value, (tuple, list)) else [value]
    for v, placement in zip(values, strategy.outputs):
        if not isinstance(v, torch.Tensor):
            outs.append(None)
            continue
        ours = from_dtensor(placement, tuple(int(s) for s in v.shape))
        if ours == UNSUPPORTED:
            return None
        outs.append(ours)
    output = tuple(outs) if isinstance(value, (tuple, list)) else outs[0]
    decision = Decision(needs, output, "dtensor")
    agrees, unchecked = check_by_running(node, decision, tp)
    if not agrees:
        return None
    if unchecked is not None:
        # Refusing would gather these ops to replicated and change the placements the tests'
        # models get; the decision stays, and the user sees that it rests on DTensor's word alone.
        return Decision(needs, output, "dtensor", note=f"{describe(node)}: DTensor's rule is used unchecked ({unchecked})")
    return decision


_CHECK_LIMIT = 1 << 16  # elements: a decision on tensors this small is checked by running it


def check_by_running(node: fx.Node, decision: Decision, tp: int) -> tuple[bool, str | None]:
    """Run the op whole and on each rank's parts, on random values, and compare: a foreign rule
    that splits (or passes through) a tensor is trusted only if the pieces agree.

    ``(agrees, why not checked)``: ``(False, None)`` when the pieces disagree; ``(True, reason)``
    when the op could not be run (a random op, integer inputs, tensors above ``_CHECK_LIMIT``
    elements, an op that does not run on plain tensors), which the caller reports."""
    outputs = decision.output if isinstance(decision.output, tuple) else (decision.output,)
    if all(p in (REPLICATED, None) for p in outputs):
        return True, None  # nothing of the output is split or partial: each rank computes it whole
    if is_random(node):
        return True, "a random op: its pieces draw other values than the whole"
    tensors = tensor_inputs(node)
    values = [a.meta["val"] for a in tensors]
    out = node.meta["val"]
    out_values = out if isinstance(out, (tuple, list)) else [out]
    if any(not v.is_floating_point() for v in values):
        return True, "it reads integer tensors, whose valid values random ones would not be"
    size = sum(v.numel() for v in values) + sum(o.numel() for o in out_values if isinstance(o, torch.Tensor))
    if size > _CHECK_LIMIT:
        return True, f"{size} elements, above the {_CHECK_LIMIT} checked by running"
    try:
        with disable_current_modes(), maybe_disable_local_tensor_mode(), torch.no_grad():
            return _pieces_agree(node, decision, tensors, values, outputs, tp), None
    except Exception as err:  # the op does not run on plain tensors this way: no evidence either way
        return True, f"running it on plain tensors failed: {type(err).__name__}"


def _pieces_agree(node, decision, tensors, values, outputs, tp) -> bool:
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


def _piece(value: torch.Tensor, placement, rank: int, tp: int) -> torch.Tensor:
    if isinstance(placement, DimShard):
        return value.index_select(placement.dim, torch.tensor(placement.indices(rank, tp)))
    return value


# ---------------------------------------------------------------------------
# backward


_ANY_TP = 2
"""DTensor drops strategies that split a dim smaller than the mesh; any size the split could have
works for finding which dims correspond, so the backward question is asked on a 2-rank mesh."""


def dtensor_backward(node: fx.Node, spec: DimShard) -> list:
    """A strategy whose output is split as ``spec`` (one segment) and whose inputs are split or
    replicated (no partial sums): ``[(input, split or None)]``; ``ShardingError`` if none."""
    if len(spec.segments) == 1:
        for strategy in dtensor_strategies(node, _ANY_TP).value or ():
            out = strategy.outputs[0] if strategy.outputs else None
            if not (type(out) is DTShard and out.dim == spec.dim):
                continue
            wanted = [(a, None if p is None else from_dtensor(p, shape_of(a)))
                      for a, p in zip(flat_input_nodes(node), strategy.inputs)]
            if all(p is None or isinstance(p, DimShard) or p == REPLICATED for _, p in wanted):
                return [(a, p if isinstance(p, DimShard) else None) for a, p in wanted]
    raise ShardingError(f"{describe(node)} cannot run on a split input (no sharding rule for it)")
