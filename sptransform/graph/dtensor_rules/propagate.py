"""The one strategy DTensor's propagator picks for given input placements (``dtensor_propagate``)
and what moving the inputs there costs (``redistribute_bytes``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from sptransform.torch_internals import (
    DTensorSpec,
    pytree,
)
from sptransform.torch_internals import StridedShard as _StridedShard
from sptransform.graph.dtensor_rules.schema import (
    Answer, Strategy, _cache_put, _check_node, _Node, _normalize, _output_placements, _placement_of, _propagator,
    _shardable, abstract_mesh, dtensor_rule_source,
)

_PROPAGATE_CACHE: dict[Any, Answer] = {}  # why a cache: see schema._CACHE_LIMIT


def redistribute_bytes(val: Any, src: Placement, dst: Placement, tp: int) -> float:
    """Bytes each rank sends to turn a tensor placed ``src`` into ``dst``.

    ``val`` is anything with ``.shape`` and ``.dtype`` (a FakeTensor,
    ``TensorMeta``), with the *global* shape. Ring collectives:
    all-gather and reduce-scatter move ``(tp-1)/tp`` of the tensor,
    all-reduce twice that, all-to-all (shard dim change) ``(tp-1)/tp**2``;
    Replicate -> Shard/Partial is local (0). A size that is an unbacked
    SymInt counts as 8192 (DTensor's own fallback hint).
    """
    if tp <= 1 or src == dst:
        return 0.0
    numel = 1
    for size in val.shape:
        try:
            numel *= int(size)
        except Exception:  # unbacked SymInt: DTensor's own cost fallback
            numel *= 8192
    nbytes = float(numel * val.dtype.itemsize)
    frac = (tp - 1) / tp
    if isinstance(src, Replicate):
        return 0.0
    src_shard = isinstance(src, (Shard, _StridedShard))
    dst_shard = isinstance(dst, (Shard, _StridedShard))
    if isinstance(dst, Replicate):
        return (2.0 if isinstance(src, Partial) else 1.0) * frac * nbytes
    if dst_shard:
        if src_shard:
            return frac / tp * nbytes  # all-to-all
        return frac * nbytes  # reduce-scatter from Partial
    if isinstance(dst, Partial):
        # Shard -> Partial: all-gather then keep; Partial(op) -> Partial(other op): all-reduce.
        return (1.0 if src_shard else 2.0) * frac * nbytes
    return float("inf")



def dtensor_propagate(
    node: fx.Node, input_placements: Sequence[Placement | None], tp: int
) -> Answer[Strategy]:
    """The strategy DTensor's sharding propagator picks for ``node`` when its
    inputs are placed ``input_placements`` (aligned with
    :func:`flat_input_nodes`, ``None`` for non-tensor inputs).

    The returned ``inputs`` are what DTensor needs; where they differ from the
    given ones DTensor would redistribute, and ``redistribute_cost`` is the
    bytes per rank of those redistributions (:func:`redistribute_bytes`).
    DTensor never redistributes kwarg-only tensor arguments (``out=``; rare
    in functional graphs): their given placement is kept.
    The answer's value is ``None`` (its reason says why) when there is no rule
    or torch's code raises. A wrong number of placements, or ``None`` for a tensor input,
    is a caller error and raises ``ValueError``.
    """
    err = _check_node(node)
    if err:
        return Answer(None, err)
    nd = _Node(node)
    given = list(input_placements)
    if len(given) != len(nd.inputs):
        raise ValueError(
            f"{node.name}: {len(given)} placements for {len(nd.inputs)} inputs "
            f"({[n.name for n in nd.inputs]})"
        )
    tensor_given: list[Placement] = []
    for i in nd.tensor_pos:
        p = given[i]
        if not isinstance(p, Placement):
            raise ValueError(f"{node.name}: input {nd.inputs[i].name} is a tensor but got placement {p!r}")
        tensor_given.append(_normalize(p, nd.vals[i].dim()))
    try:
        key = nd.cache_key(tp, ("propagate", tuple(tensor_given)))
    except TypeError:
        key = None
    if key is not None and key in _PROPAGATE_CACHE:
        return _PROPAGATE_CACHE[key]
    try:
        res, err = _propagate_uncached(nd, tensor_given, tp)
    except Exception as e:  # never let torch's errors escape: refuse, keep the message
        res, err = None, f"DTensor sharding propagation for {nd.op} failed: {type(e).__name__}: {e}"
    answer = Answer(res, err)
    _cache_put(_PROPAGATE_CACHE, key, answer)
    return answer


def _propagate_uncached(
    nd: _Node, tensor_given: list[Placement], tp: int
) -> tuple[Strategy | None, str | None]:
    """(DTensor's pick, None) or (None, why not)."""
    op = nd.op
    if dtensor_rule_source(op) is None:
        return None, f"DTensor has no sharding rule for {op} (no strategy, rule or decomposition)"
    if refusal := nd.refusal():
        return None, f"{op}: {refusal}"
    for k, i in enumerate(nd.tensor_pos):
        if not _shardable(tensor_given[k], nd.vals[i].shape, tp):
            return None, f"{op}: input {nd.inputs[i].name} cannot be {tensor_given[k]} over {tp} ranks"
    sp = _propagator()
    mesh = abstract_mesh(tp)
    try:
        out = sp.propagate_op_sharding_non_cached(nd.schema(mesh, tensor_given))
        outs = _output_placements(out.output_spec)
        needed = list(tensor_given)
        if out.redistribute_schema is not None:
            # also set for view ops whose shape argument becomes local: compare placements only
            rs = out.redistribute_schema
            specs = [
                x
                for x in pytree.tree_leaves((rs.args_schema, rs.kwargs_schema))
                if isinstance(x, DTensorSpec)
            ]
            if len(specs) != len(needed):
                raise ValueError(
                    f"redistribute schema has {len(specs)} tensor specs for {len(needed)} inputs"
                )
            needed = [_placement_of(s) for s in specs]
        strategy = nd.make_strategy(needed, outs)
        cost = sum(
            redistribute_bytes(nd.vals[i], tensor_given[k], strategy.inputs[i], tp)
            for k, i in enumerate(nd.tensor_pos)
        )
    except Exception as e:  # anything torch raises: refuse, keep the message
        return None, f"DTensor sharding propagation for {op} failed: {type(e).__name__}: {e}"
    return Strategy(strategy.inputs, strategy.outputs, cost), None
