"""Fallback sharding rules read from DTensor's registered op strategies.

Our placement analysis gives every node of a captured ATen graph a placement on
the 1-D tensor-parallel mesh axis of ``tp`` ranks (``Replicate()``,
``Shard(dim)`` or ``Partial()``). Composite ops (linear, layer_norm, SDPA,
embedding, ...) have our own rules; for every other ATen op this module asks
DTensor, the way it would answer at dispatch time, without any process group,
without real tensors and without running the op on data:

``dtensor_strategies(node, tp)``
    every (input placements -> output placements) strategy DTensor accepts for
    ``node``'s op overload on a 1-D mesh of ``tp`` ranks (``enumerate.py``).
``dtensor_propagate(node, input_placements, tp)``
    the one strategy DTensor's own sharding propagator picks for the given
    input placements (its ``inputs`` may differ from the given ones: that is
    a redistribution, costed in ``redistribute_cost``; ``propagate.py``).

Both return an ``Answer``: the value, or ``None`` with the reason why not,
naming the op, so the caller can refuse clearly. How a node's arguments are
presented to DTensor is ``args.py``; the mesh, the node as DTensor sees it and
the answer types are ``schema.py``.

Conventions
-----------
* **Inputs** are the ``fx.Node`` leaves of the node's arguments in the
  form the dispatcher hands DTensor (positional schema arguments given as
  kwargs moved into ``args``), flattened in order (lists such as
  ``aten.cat``'s tensors in place, kwarg-only arguments last); see
  :func:`flat_input_nodes`. For export/make_fx graphs that is simply the
  order of ``(node.args, node.kwargs)``. ``Strategy.inputs`` has one entry per such leaf;
  the entry is ``None`` when the leaf is not a tensor (a ``SymInt`` node).
  Non-node arguments (ints, int lists, dtypes, ...) are passed to DTensor as
  they are and have no entry.
* **Outputs**: one entry per tensor of ``node.meta["val"]``: a tensor gives
  one entry, a tuple/list of tensors (``split``, ``var_mean``,
  ``native_layer_norm``, ``unbind``) one entry per element (``None`` for a
  non-tensor element).
* ``Shard`` dims are normalized to be non-negative. Placements are DTensor's
  own objects. Besides ``Replicate()``, ``Shard(d)`` and ``Partial()`` (sum)
  DTensor also answers ``Partial("max"/"min"/"avg"/"product")`` (``amax``
  over a sharded dim), ``_MaskPartial`` and ``_StridedShard`` (a view
  merging a sharded dim); ``dtensor_strategies`` drops strategies using them
  unless ``basic_only=False``, ``dtensor_propagate`` returns what DTensor
  picked (check with :func:`is_basic`).
* Shapes, strides and dtypes come from ``node.meta["val"]`` (FakeTensors).
* An input may be ``Shard(d)`` only when its dim ``d`` has at least ``tp``
  elements (DTensor's own ``is_tensor_shardable`` criterion; uneven splits
  are allowed); the same is required of outputs.
* Enumeration tries R, every ``Shard(d)`` and P(sum) for each tensor
  argument; the tensors of one list argument (``cat``, ``stack``) get the
  same placement (DTensor's list ops require that anyway).
* ``Answer(None, reason)`` for: a node that is not an ATen
  ``OpOverload`` call, an op DTensor knows nothing about, an op without
  tensor inputs (factories) or without tensor outputs (``sym_size``), a
  data-dependent output shape (``nonzero``, boolean-mask indexing), and any
  exception raised by torch's strategy code.

Where the answer comes from (same order as DTensor's propagator, see
:func:`dtensor_rule_source`):

1. ``op_single_dim_strategy_funcs``: a list of single-mesh-dim rules
   ``[out placements..., in placements...]`` (with ``_ShardingPlaceholder``
   for "any shard type"); for a 1-D mesh that list *is* the strategy set.
   Most pointwise ops, mm/bmm, index/index_select, native_layer_norm ...
2. ``op_strategy_funcs``: OpStrategy generators. DTensor calls them with one
   spec per input, and several (stack, view/shape ops) only answer for that
   spec, so :func:`dtensor_strategies` calls them once per combination of
   candidate input placements and takes the union.
3. ``op_to_rules``: old-style propagation rules, enumerated by propagating
   every input combination. In 2.13 only ``convolution`` and its backward
   are there, and both also have single-dim strategies, which win: the path
   is kept for other torch versions but is not reached in 2.13.
4. Ops with an ATen decomposition (CompositeImplicit ops such as
   ``aten.linear``, ``aten.matmul``, ``aten.layer_norm`` that export keeps):
   DTensor traces the decomposition on meta tensors per input combination.
   CompositeImplicit ops never reach DTensor's dispatcher in eager (they
   decompose above it), so for them this path is only exercised by direct
   callers of the propagator such as this module.

Registration: importing ``torch.distributed.tensor`` registers everything
(including the automatic in-place/out/functional/foreach variants of
``auto_register_op_variants``) except ``prims.fma``, which is registered
lazily when ``torch._inductor.inductor_prims`` is imported (see
:func:`registered_op_count`). Pointwise ops are discovered at import through
``torch.Tag.pointwise`` over ``dir(torch.ops.aten)``, i.e. over the op
packets *already accessed* at that time; in torch 2.13 that covers 564 of the
566 pointwise-tagged aten/prims overloads (not ``_conj_physical``, ``rrelu``).
"""

# ---------------------------------------------------------------------------
# Private torch APIs used here (imported through sptransform.torch_internals).
# None has a public equivalent in torch 2.13; "->" says what public API
# would replace it.
#
#  1. DTensor._op_dispatcher.sharding_propagator (a
#     torch.distributed.tensor._sharding_prop.ShardingPropagator): its dicts
#     op_single_dim_strategy_funcs, op_strategy_funcs, op_to_rules,
#     op_to_schema_info, op_to_schema_info_for_single_dim_strategy, and
#     _wrap_with_op_strategy, propagate_op_sharding_non_cached. Why: the
#     registry of per-op strategies and DTensor's own choice of strategy.
#     -> a public "strategies / propagation for (op, input specs, mesh)"
#        query (torch.distributed.tensor.experimental.register_sharding only
#        registers).
#  2. DeviceMesh(device_type, ranks, _init_backend=False, _rank=0): a mesh
#     with no process group behind it, as DTensor builds its own size-1
#     decomposition mesh. -> a public abstract/fake DeviceMesh
#     (init_device_mesh always creates process groups).
#  3. torch.distributed.tensor._dtensor_spec.DTensorSpec, TensorMeta;
#     torch.distributed.tensor._op_schema.OpSchema, TupleStrategy,
#     RuntimeSchemaInfo: what strategy functions take and return.
#     -> public spec / strategy types.
#  4. torch.distributed.tensor._ops.single_dim_strategy.
#     _insert_single_dim_replication_strategy and
#     _fill_single_dim_strategy_placeholders: turn a single-dim rule list
#     into concrete placements exactly as DTensor does.
#     -> a public "expand a single-dim strategy" helper (or the query in 1).
#  5. torch.distributed.tensor._decompositions.DecompShardingStrategy
#     (has_decomp; sharding_propagator.decomp_strategy.ensure_schema_info,
#     _get_fake_mesh, _propagate_through_decomp): strategies of ops that only
#     have a decomposition. -> the query in 1.
#  6. torch.distributed.tensor.placement_types._StridedShard: recognized
#     (normalized, filtered out by basic_only) in DTensor's answers.
#     -> a public StridedShard placement.
#  7. torch.utils._python_dispatch._disable_current_modes: the mesh's rank
#     map must be a real CPU tensor even when we are called under an active
#     FakeTensorMode / make_fx proxy mode; the decomposition tracing runs
#     outside them too. -> a public "suspend dispatch modes" context manager.
#  8. torch.utils._pytree (tree_flatten / tree_leaves): the same flattening
#     DTensor uses internally, so slot order matches. -> torch.utils.pytree
#     is not a public module in 2.13.
#  9. OpOverload: the type of an ATen overload (node.target).
#     -> torch.ops types are only reachable through torch._ops.
# 10. torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode and
#     free_unbacked_symbols (not in that module's __all__): "no rule" on
#     data-dependent shapes. -> public symbolic-shape queries.
# 11. torch._inductor.inductor_prims (imported by registered_op_count only):
#     triggers DTensor's one lazy registration (prims.fma). -> none needed if
#     DTensor registered it eagerly.
# ---------------------------------------------------------------------------

from __future__ import annotations

from sptransform.graph.dtensor_rules.args import dispatch_args, flat_input_nodes
from sptransform.graph.dtensor_rules.enumerate import dtensor_strategies, registered_op_count
from sptransform.graph.dtensor_rules.propagate import dtensor_propagate, redistribute_bytes
from sptransform.graph.dtensor_rules.schema import Answer, Strategy, abstract_mesh, dtensor_rule_source, is_basic

__all__ = [
    "Answer",
    "Strategy",
    "abstract_mesh",
    "dtensor_propagate",
    "dtensor_rule_source",
    "dispatch_args",
    "dtensor_strategies",
    "flat_input_nodes",
    "is_basic",
    "redistribute_bytes",
    "registered_op_count",
]
