"""Every strategy DTensor accepts for an op (``dtensor_strategies``), from whichever of its
registries answers (single-dim rules, strategy functions, old-style rules, decompositions)."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from sptransform.torch_internals import propagate_through_decomposition, wrap_with_op_strategy
from sptransform.torch_internals import (
    DTensorSpec,
    GuardOnDataDependentSymNode,
    TensorMeta,
    TupleStrategy,
    fill_single_dim_strategy_placeholders as _fill_single_dim_strategy_placeholders,
    insert_single_dim_replication_strategy as _insert_single_dim_replication_strategy,
    pytree,
    register_lazy_dtensor_strategies,
)
from sptransform.torch_internals import disable_current_modes as _disable_current_modes
from sptransform.graph.dtensor_rules.args import _map_arg
from sptransform.graph.dtensor_rules.propagate import _propagate_uncached
from sptransform.graph.dtensor_rules.schema import (
    Answer, Strategy, _cache_put, _candidates, _check_node, _Node, _output_placements, _placement_of,
    _propagator, _shardable, abstract_mesh, dtensor_rule_source, is_basic,
)


# Enumeration through op_strategy_funcs / op_to_rules / decompositions tries
# every combination of candidate input placements; above this many we refuse.
MAX_COMBINATIONS = 1024


def registered_op_count(trigger_lazy: bool = True) -> dict[str, int]:
    """How many op overloads have a registered DTensor strategy, per registry
    (``"total"`` counts each overload once). Ops reachable only through their
    decomposition are not counted (that set is open-ended).

    The one lazy registration in torch 2.13 is ``prims.fma`` (an inductor
    prim, registered when ``torch._inductor.inductor_prims`` is imported);
    ``trigger_lazy`` imports that module first."""
    if trigger_lazy:
        register_lazy_dtensor_strategies()
    sp = _propagator()
    single = set(sp.op_single_dim_strategy_funcs)
    strat = set(sp.op_strategy_funcs)
    rules = set(sp.op_to_rules)
    return {
        "single_dim": len(single),
        "strategy": len(strat),
        "rule": len(rules),
        "total": len(single | strat | rules),
    }




def _dedupe(strats: list[Strategy]) -> list[Strategy]:
    seen: dict[tuple, Strategy] = {}
    for s in strats:
        seen.setdefault((s.inputs, s.outputs), s)
    return list(seen.values())


def _from_rule_lists(nd: _Node, rules: list[list[Any]], n_out: int) -> list[Strategy]:
    out = []
    for r in rules:
        out.append(nd.make_strategy(r[n_out:], r[:n_out]))
    return out


def _enum_single_dim(nd: _Node, tp: int) -> list[Strategy]:
    sp = _propagator()
    info = sp.op_single_dim_strategy_funcs[nd.op]
    mesh = abstract_mesh(tp)
    n_in = len(nd.tensor_pos)
    strategy_schema = wrap_with_op_strategy(sp, nd.schema(mesh, [Replicate()] * n_in))
    rules = info.func(nd.op, strategy_schema.args_meta, strategy_schema.kwargs_meta)
    out_meta = nd.output_tensor_meta()
    if rules:
        n_out = len(rules[0]) - n_in
    elif out_meta is None:
        n_out = 0
    elif isinstance(out_meta, TensorMeta):
        n_out = 1
    else:
        n_out = len(out_meta)
    rules = _insert_single_dim_replication_strategy(list(rules), n_out, n_in, out_meta)
    # Placeholders are filled with the shard types the inputs use; we want the
    # plain Shard(d) ones (the {R, S, P} domain).
    rules = _fill_single_dim_strategy_placeholders({Shard(0)}, rules)
    return _from_rule_lists(nd, rules, n_out)


def _enum_strategy_func(nd: _Node, tp: int) -> list[Strategy]:
    """OpStrategy generators. DTensor only ever calls them with one spec per
    input (its runtime placement), and several (stack, the "follow the input"
    view and shape ops) only answer for that one spec; fed with every
    candidate at once they pick one arbitrarily. So call once per input
    combination, as DTensor's dispatcher would, and take the union of the
    OpSpecs. A combination whose call raises (unbind along the sharded dim)
    is skipped; if all raise, the first error is reported."""
    sp = _propagator()
    mesh = abstract_mesh(tp)
    func = sp.op_strategy_funcs[nd.op]
    n_in = len(nd.tensor_pos)
    strats: list[Strategy] = []
    errors: list[str] = []
    for combo in _combos(nd, tp):
        schema = wrap_with_op_strategy(sp, nd.schema(mesh, combo))
        try:
            result = func(schema)
        except GuardOnDataDependentSymNode:
            raise
        except Exception as e:
            errors.append(f"inputs {combo}: {type(e).__name__}: {e}")
            continue
        if isinstance(result, TupleStrategy):
            raise NotImplementedError(
                f"{nd.op} returns a per-element TupleStrategy (foreach-style); "
                "enumerating those is not supported, use dtensor_propagate"
            )
        for spec in result.strategies:
            outs = _output_placements(spec.output_specs)
            if spec.input_specs is None:
                ins = [outs[0]] * n_in
            else:
                ins = [_placement_of(s) for s in spec.input_specs]
            if len(ins) != n_in:
                raise ValueError(f"strategy has {len(ins)} input specs for {n_in} tensor inputs")
            strats.append(nd.make_strategy(ins, outs))
    if not strats and errors:
        raise RuntimeError(errors[0])
    return strats


def _groups(nd: _Node) -> list[list[int]]:
    """Tensor inputs (as indices in tensor-input order) enumerated together:
    one group per tensor argument, one *tied* group per list-of-tensors
    argument (cat, stack, index's indices) whose elements all get the same
    placement. DTensor's list ops require equal placements anyway, and tying
    keeps a 32-way cat from being 5**32 combinations."""
    groups: list[list[int]] = []
    k = 0
    for a in list(nd.args) + list(nd.kwargs.values()):
        leaves: list[fx.Node] = []
        _map_arg(a, lambda n: leaves.append(n) or n)
        members = []
        for n in leaves:
            if isinstance(n.meta.get("val"), torch.Tensor):
                members.append(k)
                k += 1
        if members:
            groups.append(members)
    return groups


def _combos(nd: _Node, tp: int) -> list[list[Placement]]:
    """Every combination of candidate placements of the tensor inputs
    (R, Shard(d) on dims with >= tp elements, P(sum)), list arguments tied."""
    groups = _groups(nd)
    options: list[list[Placement]] = []
    for g in groups:
        vals = [nd.vals[nd.tensor_pos[k]] for k in g]
        ndim = min(v.dim() for v in vals)
        options.append(
            [p for p in _candidates(ndim) if all(_shardable(p, v.shape, tp) for v in vals)]
        )
    n = 1
    for o in options:
        n *= len(o)
    if n > MAX_COMBINATIONS:
        raise NotImplementedError(
            f"{nd.op}: {n} input placement combinations to try (limit {MAX_COMBINATIONS})"
        )
    combos = []
    for choice in itertools.product(*options):
        combo: list[Placement] = [Replicate()] * len(nd.tensor_pos)
        for g, p in zip(groups, choice):
            for k in g:
                combo[k] = p
        combos.append(combo)
    return combos


def _enum_rule(nd: _Node, tp: int) -> list[Strategy]:
    """op_to_rules ops: try every input combination, keep those DTensor runs
    without redistributing."""
    strats = []
    for combo in _combos(nd, tp):
        s, _ = _propagate_uncached(nd, combo, tp)
        if s is not None and [s.inputs[i] for i in nd.tensor_pos] == combo:
            strats.append(Strategy(s.inputs, s.outputs, 0.0))
    return strats


def _enum_decomp(nd: _Node, tp: int) -> list[Strategy]:
    """Ops with an ATen decomposition: trace the decomposition on meta tensors
    for every input combination (as DTensor's DecompShardingStrategy does,
    with our candidate set instead of the placements the inputs happen to use)."""
    sp = _propagator()
    mesh = abstract_mesh(tp)
    ds = sp.decomp_strategy
    ds.ensure_schema_info(nd.op)
    schema = nd.schema(mesh, [Replicate()] * len(nd.tensor_pos))
    flat, _ = pytree.tree_flatten(list(schema.args_schema + tuple(schema.kwargs_schema.values())))
    spec_slots = [i for i, x in enumerate(flat) if isinstance(x, DTensorSpec)]
    strats = []
    for combo in _combos(nd, tp):
        placement: list[Placement | None] = [None] * len(flat)
        for slot, p in zip(spec_slots, combo):
            placement[slot] = p
        try:
            with _disable_current_modes():
                out = propagate_through_decomposition(ds, schema, tuple(placement), mesh.device_type)
        except (NotImplementedError, GuardOnDataDependentSymNode):
            raise
        except Exception:
            continue  # DTensor skips combinations whose decomposition needs a redistribution
        outs = list(out) if isinstance(out, tuple) else [out]
        strats.append(nd.make_strategy(combo, outs))
    if not strats:
        raise RuntimeError(f"{nd.op}: no input combination traced through the decomposition")
    return strats


_ENUMERATORS = {
    "single_dim": _enum_single_dim,
    "strategy": _enum_strategy_func,
    "rule": _enum_rule,
    "decomposition": _enum_decomp,
}

_STRATEGY_CACHE: dict[Any, Answer] = {}  # why a cache: see schema._CACHE_LIMIT


def dtensor_strategies(
    node: fx.Node, tp: int, *, basic_only: bool = True
) -> Answer[tuple[Strategy, ...]]:
    """Every sharding strategy DTensor accepts for ``node``'s op overload on a
    1-D mesh of ``tp`` ranks, for the shapes in ``node.meta['val']``.

    Input candidates are ``Replicate()``, ``Shard(d)`` for every dim and
    ``Partial()``; strategies sharding a dim smaller than ``tp`` are dropped,
    and with ``basic_only`` (default) so are those using any placement other
    than ``Replicate()``, ``Shard(d)``, ``Partial()`` (sum) -- DTensor also
    lists ``Partial("avg"/"max"/"min"/"product")`` pass-throughs,
    ``_StridedShard`` view results, ``_MaskPartial``. ``redistribute_cost``
    is 0. The answer's value is ``None`` when DTensor has no rule, its strategy
    code raises, or nothing is left; its reason then says why.
    """
    err = _check_node(node)
    if err:
        return Answer(None, err)
    nd = _Node(node)
    try:
        key = nd.cache_key(tp, ("strategies", basic_only))
    except TypeError:
        key = None
    if key is not None and key in _STRATEGY_CACHE:
        return _STRATEGY_CACHE[key]
    res, err = _strategies_uncached(nd, tp, basic_only)
    answer = Answer(tuple(res) if res is not None else None, err)
    _cache_put(_STRATEGY_CACHE, key, answer)
    return answer


def _strategies_uncached(
    nd: _Node, tp: int, basic_only: bool
) -> tuple[list[Strategy] | None, str | None]:
    op = nd.op
    source = dtensor_rule_source(op)
    if source is None:
        return None, f"DTensor has no sharding rule for {op} (no strategy, rule or decomposition)"
    if refusal := nd.refusal():
        return None, f"{op}: {refusal}"
    try:
        strats = _ENUMERATORS[source](nd, tp)
        strats = _dedupe([s for s in strats if nd.valid(s, tp)])
    except Exception as e:  # anything torch raises: refuse, keep the message
        return None, f"DTensor {source} strategy for {op} failed: {type(e).__name__}: {e}"
    if basic_only:
        strats = [s for s in strats if all(map(is_basic, s.inputs + s.outputs))]
    if not strats:
        what = "R/S/P(sum) strategy" if basic_only else "strategy"
        return None, f"DTensor {source} strategy for {op} gave no {what} valid for tp={tp}"
    return strats, None

