"""Fallback sharding rules read from DTensor's registered op strategies.

Our placement analysis gives every node of a captured ATen graph a placement on
the 1-D tensor-parallel mesh axis of ``tp`` ranks (``Replicate()``,
``Shard(dim)`` or ``Partial()``). Composite ops (linear, layer_norm, SDPA,
embedding, ...) have our own rules; for every other ATen op this module asks
DTensor, the way it would answer at dispatch time, without any process group,
without real tensors and without running the op on data:

``dtensor_strategies(node, tp)``
    every (input placements -> output placements) strategy DTensor accepts for
    ``node``'s op overload on a 1-D mesh of ``tp`` ranks, or ``None``.
``dtensor_propagate(node, input_placements, tp)``
    the one strategy DTensor's own sharding propagator picks for the given
    input placements (its ``inputs`` may differ from the given ones: that is
    a redistribution, costed in ``redistribute_cost``), or ``None``.
``last_error()``
    why the last call of either function (in this thread) returned ``None``,
    naming the op, so the caller can refuse clearly.

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
* ``None`` (with :func:`last_error`) for: a node that is not an ATen
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

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from sptransform.torch_internals import (
    DecompShardingStrategy,
    DTensorSpec,
    GuardOnDataDependentSymNode,
    OpOverload,
    OpSchema,
    RuntimeSchemaInfo,
    TensorMeta,
    TupleStrategy,
    abstract_device_mesh,
    fill_single_dim_strategy_placeholders as _fill_single_dim_strategy_placeholders,
    free_unbacked_symbols,
    insert_single_dim_replication_strategy as _insert_single_dim_replication_strategy,
    pytree,
    register_lazy_dtensor_strategies,
    sharding_propagator,
)
from sptransform.torch_internals import StridedShard as _StridedShard
from sptransform.torch_internals import disable_current_modes as _disable_current_modes

__all__ = [
    "Strategy",
    "abstract_mesh",
    "dtensor_propagate",
    "dtensor_rule_source",
    "dispatch_args",
    "dtensor_strategies",
    "flat_input_nodes",
    "is_basic",
    "last_error",
    "redistribute_bytes",
    "registered_op_count",
]

# Enumeration through op_strategy_funcs / op_to_rules / decompositions tries
# every combination of candidate input placements; above this many we refuse.
MAX_COMBINATIONS = 1024
_CACHE_LIMIT = 8192


@dataclass(frozen=True)
class Strategy:
    """One way DTensor can run an op on the ``tp``-rank mesh axis.

    ``inputs``: the placement each input must have (aligned with
    :func:`flat_input_nodes`; ``None`` for a non-tensor input).
    ``outputs``: the placement of each output tensor (one entry per tensor of
    ``node.meta["val"]``, ``None`` for a non-tensor element).
    ``redistribute_cost``: bytes each rank sends to move the *given* inputs to
    ``inputs`` (ring collectives, see :func:`redistribute_bytes`); always 0 in
    :func:`dtensor_strategies`, where no inputs are given.
    """

    inputs: tuple[Placement | None, ...]
    outputs: tuple[Placement | None, ...]
    redistribute_cost: float = 0.0


# ---------------------------------------------------------------------------
# small public helpers


_tls = threading.local()


def last_error() -> str | None:
    """Why the last ``dtensor_strategies``/``dtensor_propagate`` call of this
    thread returned ``None`` (``None`` after a successful call)."""
    return getattr(_tls, "error", None)


def _set_error(msg: str | None) -> None:
    _tls.error = msg


def is_basic(p: Placement | None) -> bool:
    """``p`` is ``None``, ``Replicate()``, a plain ``Shard(d)`` or ``Partial()``
    with sum reduction (not ``_StridedShard``, ``_MaskPartial``, max/avg/...)."""
    if p is None:
        return True
    t = type(p)
    if t is Replicate or t is Shard:
        return True
    return t is Partial and p.reduce_op == "sum"


def _propagator():
    return sharding_propagator()


_MESHES: dict[int, DeviceMesh] = {}
_MESH_LOCK = threading.Lock()


def abstract_mesh(tp: int) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` of ``tp`` ranks with no process group behind it.

    Built with ``_init_backend=False`` and this process pretending to be rank 0;
    nothing is communicated and ``torch.distributed`` need not be initialized.
    The rank map is a real CPU tensor, so it is built with every dispatch mode
    (FakeTensorMode, make_fx proxy mode) suspended. Cached per ``tp``.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    mesh = _MESHES.get(tp)
    if mesh is None:
        with _MESH_LOCK:
            mesh = _MESHES.get(tp)
            if mesh is None:
                with _disable_current_modes():
                    mesh = abstract_device_mesh("cpu", tp)
                _MESHES[tp] = mesh
    return mesh


def dtensor_rule_source(op: object) -> str | None:
    """Which DTensor registry answers for ``op`` (an ``OpOverload``):
    ``"single_dim"``, ``"strategy"``, ``"rule"``, ``"decomposition"``, or
    ``None`` when DTensor has nothing. ``"decomposition"`` only means the op
    has an ATen decomposition; tracing it may still fail for some inputs."""
    if not isinstance(op, OpOverload):
        return None
    sp = _propagator()
    if op in sp.op_single_dim_strategy_funcs:
        return "single_dim"
    if op in sp.op_strategy_funcs:
        return "strategy"
    if op in sp.op_to_rules:
        return "rule"
    if DecompShardingStrategy.has_decomp(op):
        return "decomposition"
    return None


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


def flat_input_nodes(node: fx.Node) -> list[fx.Node]:
    """The ``fx.Node`` leaves of the node's arguments in dispatcher form (see
    :func:`dispatch_args`), in order: lists flattened in place, kwarg-only
    arguments last. Duplicates are kept: ``mul(x, x)`` has two inputs."""
    out: list[fx.Node] = []
    _map_arg(dispatch_args(node), lambda n: out.append(n) or n)
    return out


def dispatch_args(node: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` as the dispatcher passes them to DTensor: every
    positional (non kwarg-only) schema argument that the node gives by name is
    moved into ``args`` (gaps filled with schema defaults). DTensor's
    strategies read tensors from ``args`` only; ``add.Tensor(x, other=y)``
    with ``y`` left in kwargs would be propagated as if ``y`` did not exist.
    Nodes whose target is not an ``OpOverload`` come back unchanged."""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    op = node.target
    if not isinstance(op, OpOverload):
        return args, kwargs
    args, kwargs = _nonnegative_dims(node, op, args, kwargs)
    if not kwargs:
        return args, kwargs
    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    named = [i for i in range(len(args), len(positional)) if positional[i].name in kwargs]
    if not named:
        return args, kwargs
    new_args = list(args)
    for i in range(len(args), max(named) + 1):
        a = positional[i]
        if a.name in kwargs:
            new_args.append(kwargs.pop(a.name))
        elif a.has_default_value():
            new_args.append(a.default_value)
        else:  # malformed call; leave it to torch to complain
            return args, dict(node.kwargs)
    return tuple(new_args), kwargs


_DIM_ARGUMENTS = frozenset({"dim", "dims", "dim0", "dim1", "start_dim", "end_dim"})
_INSERTS_A_DIM = frozenset({torch.ops.aten.stack, torch.ops.aten.unsqueeze})


def _nonnegative_dims(node: fx.Node, op: OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Dim arguments made non-negative. Some of DTensor's strategies compare a negative dim with
    a placement's non-negative one and miss that they are the same dim (``cumsum(dim=-1)`` on a
    tensor split along its last dim is accepted as split in torch 2.13): a silent error, so every
    dim reaches DTensor non-negative. A negative dim counts from the end of the output when the op
    inserts a dim (``stack``, ``unsqueeze``), else of the first input."""
    first = next((a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)), None)
    out = node.meta.get("val")
    if first is None or not isinstance(out, torch.Tensor):
        return args, kwargs
    ndim = out.dim() if op.overloadpacket in _INSERTS_A_DIM else first.meta["val"].dim()

    def fix(value):
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            return value + ndim
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return type(value)(v + ndim if v < 0 else v for v in value)
        return value

    schema = op._schema.arguments
    args = tuple(fix(a) if i < len(schema) and schema[i].name in _DIM_ARGUMENTS else a for i, a in enumerate(args))
    kwargs = {k: (fix(v) if k in _DIM_ARGUMENTS else v) for k, v in kwargs.items()}
    return args, kwargs


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


# ---------------------------------------------------------------------------
# node -> DTensor schema


def _map_arg(a: Any, f: Callable[[fx.Node], Any]) -> Any:
    """Map ``f`` over the ``fx.Node`` leaves of an argument structure, in the
    same left-to-right order as ``torch.utils._pytree`` (plain list/tuple/dict
    come back; fx's immutable containers are converted)."""
    if isinstance(a, fx.Node):
        return f(a)
    if isinstance(a, tuple):
        return tuple(_map_arg(x, f) for x in a)
    if isinstance(a, list):
        return [_map_arg(x, f) for x in a]
    if isinstance(a, dict):
        return {k: _map_arg(v, f) for k, v in a.items()}
    return a


def _meta(t: torch.Tensor, contiguous: bool = False) -> TensorMeta:
    if not contiguous or not all(isinstance(d, int) for d in t.shape):
        return TensorMeta(shape=t.shape, stride=tuple(t.stride()), dtype=t.dtype)
    stride, acc = [], 1
    for size in reversed(t.shape):
        stride.append(acc)
        acc *= max(int(size), 1)
    return TensorMeta(shape=t.shape, stride=tuple(reversed(stride)), dtype=t.dtype)


def _normalize(p: Placement | None, ndim: int) -> Placement | None:
    if isinstance(p, Shard) and p.dim < 0:
        return Shard(p.dim + ndim)
    if isinstance(p, _StridedShard) and p.dim < 0:
        return _StridedShard(p.dim + ndim, split_factor=p.split_factor)
    return p


def _shardable(p: Placement | None, shape: Sequence[Any] | None, tp: int) -> bool:
    if not isinstance(p, (Shard, _StridedShard)):
        return True
    if shape is None or not (0 <= p.dim < len(shape)):
        return False
    try:
        return bool(shape[p.dim] >= tp)
    except Exception:  # unbacked SymInt: let DTensor decide at runtime
        return True


def _candidates(ndim: int) -> tuple[Placement, ...]:
    return (Replicate(), *(Shard(d) for d in range(ndim)), Partial())


class _Node:
    """What we need of one node: its op, input values and output structure."""

    def __init__(self, node: fx.Node):
        self.node = node
        self.args, self.kwargs = dispatch_args(node)
        self.op: OpOverload = node.target  # type: ignore[assignment]
        self.inputs = flat_input_nodes(node)
        self.vals = [n.meta.get("val") for n in self.inputs]
        self.is_tensor = [isinstance(v, torch.Tensor) for v in self.vals]
        self.tensor_pos = [i for i, t in enumerate(self.is_tensor) if t]
        out = node.meta.get("val")
        # output structure: "single" | "tuple" | "list" | "none"
        if isinstance(out, torch.Tensor):
            self.out_kind, self.out_vals = "single", [out]
        elif isinstance(out, tuple):
            self.out_kind, self.out_vals = "tuple", list(out)
        elif isinstance(out, list):
            self.out_kind, self.out_vals = "list", list(out)
        else:
            self.out_kind, self.out_vals = "none", []
        self.out_is_tensor = [isinstance(v, torch.Tensor) for v in self.out_vals]

    def refusal(self) -> str | None:
        """Why we cannot ask DTensor about this node at all, or None."""
        for n, v in zip(self.inputs, self.vals):
            if v is None:
                return f"input {n.name} has no meta['val']"
        if self.node.meta.get("val", None) is None and self.op._schema.returns:
            return f"{self.node.name} has no meta['val']"
        if not self.tensor_pos:
            return "no tensor inputs; DTensor strategies need at least one"
        if not any(self.out_is_tensor):
            return (
                "produces no tensor, so DTensor has no placement to give "
                "(its propagator refuses such ops); needs a graph-level rule"
            )
        try:
            unbacked = free_unbacked_symbols([v for v in self.out_vals if isinstance(v, torch.Tensor)])
        except Exception:
            unbacked = set()
        if unbacked:
            names = ", ".join(sorted(map(str, unbacked)))
            return (
                f"data-dependent output shape ({names}): the local result's size depends "
                "on each rank's data, which DTensor's strategies do not model"
            )
        return None

    def output_tensor_meta(self) -> Any:
        if self.out_kind == "single":
            return _meta(self.out_vals[0])
        if self.out_kind == "none":
            return None
        metas = [_meta(v) if isinstance(v, torch.Tensor) else None for v in self.out_vals]
        return tuple(metas) if self.out_kind == "tuple" else metas

    def schema(self, mesh: DeviceMesh, placements: Sequence[Placement]) -> OpSchema:
        """An OpSchema with a DTensorSpec (``placements[k]`` for the k-th tensor
        input) in place of each tensor input; non-tensor nodes become their value.

        For ops DTensor handles through their decomposition the specs get
        contiguous strides: DTensor traces the decomposition on contiguous
        meta tensors but re-derives each inner op's output from the specs'
        strides, so a transposed input (``q @ k.transpose(-2, -1)`` through
        ``aten.matmul``) fails in the decomposition's ``view``. Placements do
        not depend on strides."""
        it = iter(placements)
        contiguous = dtensor_rule_source(self.op) == "decomposition"

        def conv(n: fx.Node) -> Any:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                return DTensorSpec(mesh, (next(it),), tensor_meta=_meta(v, contiguous))
            return v

        args = _map_arg(self.args, conv)
        kwargs = _map_arg(self.kwargs, conv)
        return OpSchema(self.op, args, kwargs, schema_info=self.schema_info())

    def schema_info(self) -> RuntimeSchemaInfo | None:
        sp = _propagator()
        info = sp.op_to_schema_info.get(self.op)
        if info is None:
            info = sp.op_to_schema_info_for_single_dim_strategy.get(self.op)
        has_list = any(
            isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a)
            for a in self.args
        )
        if has_list and (info is None or not info.needs_pytree):
            # DTensor's dispatcher flattens such args too (needs_pytree auto-detection)
            info = RuntimeSchemaInfo(needs_pytree=True) if info is None else RuntimeSchemaInfo(
                static_argnum=info.static_argnum,
                static_kwargkey=info.static_kwargkey,
                needs_pytree=True,
            )
        return info

    def cache_key(self, tp: int, extra: Any) -> Any:
        def conv(n: fx.Node) -> Any:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(v.shape), tuple(v.stride()), v.dtype)
            return ("V", v)

        key = (self.op, tp, _freeze(_map_arg((self.args, self.kwargs), conv)), extra)
        hash(key)  # SymInts are unhashable -> TypeError -> not cached
        return key

    def expand_outputs(self, outs: Sequence[Placement | None]) -> tuple[Placement | None, ...]:
        """DTensor's output placements (one per tensor *return* of the schema,
        or one per tensor of a returned tuple) -> one per tensor of meta['val']."""
        n_vals = len(self.out_vals)
        tensor_idx = [i for i, t in enumerate(self.out_is_tensor) if t]
        outs = list(outs)
        if self.out_kind == "none":
            if any(p is not None for p in outs):
                raise ValueError(f"DTensor gave output placements {outs} for an op without outputs")
            return ()
        if self.out_kind == "single":
            if len(outs) != 1:
                raise ValueError(f"DTensor gave {len(outs)} output placements for one output")
            res = outs
        elif len(outs) == n_vals:
            res = [p if t else None for p, t in zip(outs, self.out_is_tensor)]
        elif len(outs) == len(tensor_idx) or len(outs) == 1:
            res = [None] * n_vals
            for k, i in enumerate(tensor_idx):
                res[i] = outs[k] if len(outs) == len(tensor_idx) else outs[0]
        else:
            raise ValueError(
                f"DTensor gave {len(outs)} output placements for {n_vals} outputs"
            )
        return tuple(
            _normalize(p, self.out_vals[i].dim()) if p is not None else None
            for i, p in enumerate(res)
        )

    def make_strategy(
        self, tensor_inputs: Sequence[Placement | None], outs: Sequence[Placement | None], cost: float = 0.0
    ) -> Strategy:
        ins: list[Placement | None] = [None] * len(self.inputs)
        for k, i in enumerate(self.tensor_pos):
            ins[i] = _normalize(tensor_inputs[k], self.vals[i].dim())
        return Strategy(tuple(ins), self.expand_outputs(outs), cost)

    def valid(self, s: Strategy, tp: int) -> bool:
        for p, v in zip(s.inputs, self.vals):
            if isinstance(v, torch.Tensor) and not _shardable(p, v.shape, tp):
                return False
        for p, v in zip(s.outputs, self.out_vals):
            if isinstance(v, torch.Tensor) and not _shardable(p, v.shape, tp):
                return False
        return True


def _freeze(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(e) for e in x)
    if isinstance(x, dict):
        return tuple((k, _freeze(v)) for k, v in x.items())
    return x


def _placement_of(spec: Any) -> Placement | None:
    if isinstance(spec, DTensorSpec):
        if len(spec.placements) != 1:
            raise ValueError(f"expected a 1-D spec, got {spec}")
        return spec.placements[0]
    return None


def _output_placements(output_specs: Any) -> list[Placement | None]:
    if output_specs is None:
        return []
    if isinstance(output_specs, DTensorSpec):
        return [_placement_of(output_specs)]
    return [_placement_of(s) for s in output_specs]


# ---------------------------------------------------------------------------
# enumeration


def _check_node(node: fx.Node) -> str | None:
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return f"{node.format_node()} is not a call to an ATen OpOverload"
    return None


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
    strategy_schema = sp._wrap_with_op_strategy(nd.schema(mesh, [Replicate()] * n_in))
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
        schema = sp._wrap_with_op_strategy(nd.schema(mesh, combo))
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
    fake_mesh = ds._get_fake_mesh(mesh.device_type)
    flat, _ = pytree.tree_flatten(list(schema.args_schema + tuple(schema.kwargs_schema.values())))
    spec_slots = [i for i, x in enumerate(flat) if isinstance(x, DTensorSpec)]
    strats = []
    for combo in _combos(nd, tp):
        placement: list[Placement | None] = [None] * len(flat)
        for slot, p in zip(spec_slots, combo):
            placement[slot] = p
        try:
            with _disable_current_modes():
                out = ds._propagate_through_decomp(schema, tuple(placement), fake_mesh)
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

_STRATEGY_CACHE: dict[Any, tuple[tuple[Strategy, ...] | None, str | None]] = {}
_PROPAGATE_CACHE: dict[Any, tuple[Strategy | None, str | None]] = {}


def _cache_put(cache: dict, key: Any, value: Any) -> None:
    if key is None:
        return
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def dtensor_strategies(
    node: fx.Node, tp: int, *, basic_only: bool = True
) -> list[Strategy] | None:
    """Every sharding strategy DTensor accepts for ``node``'s op overload on a
    1-D mesh of ``tp`` ranks, for the shapes in ``node.meta['val']``.

    Input candidates are ``Replicate()``, ``Shard(d)`` for every dim and
    ``Partial()``; strategies sharding a dim smaller than ``tp`` are dropped,
    and with ``basic_only`` (default) so are those using any placement other
    than ``Replicate()``, ``Shard(d)``, ``Partial()`` (sum) -- DTensor also
    lists ``Partial("avg"/"max"/"min"/"product")`` pass-throughs,
    ``_StridedShard`` view results, ``_MaskPartial``. ``redistribute_cost``
    is 0. Returns ``None`` when DTensor has no rule, its strategy code raises,
    or nothing is left; :func:`last_error` then says why.
    """
    err = _check_node(node)
    if err:
        _set_error(err)
        return None
    nd = _Node(node)
    try:
        key = nd.cache_key(tp, ("strategies", basic_only))
    except TypeError:
        key = None
    if key is not None and key in _STRATEGY_CACHE:
        res, err = _STRATEGY_CACHE[key]
        _set_error(err)
        return list(res) if res is not None else None
    res, err = _strategies_uncached(nd, tp, basic_only)
    _cache_put(_STRATEGY_CACHE, key, (tuple(res) if res is not None else None, err))
    _set_error(err)
    return res


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


# ---------------------------------------------------------------------------
# propagation


def dtensor_propagate(
    node: fx.Node, input_placements: Sequence[Placement | None], tp: int
) -> Strategy | None:
    """The strategy DTensor's sharding propagator picks for ``node`` when its
    inputs are placed ``input_placements`` (aligned with
    :func:`flat_input_nodes`, ``None`` for non-tensor inputs).

    The returned ``inputs`` are what DTensor needs; where they differ from the
    given ones DTensor would redistribute, and ``redistribute_cost`` is the
    bytes per rank of those redistributions (:func:`redistribute_bytes`).
    DTensor never redistributes kwarg-only tensor arguments (``out=``; rare
    in functional graphs): their given placement is kept.
    Returns ``None`` (see :func:`last_error`) when there is no rule or torch's
    code raises. A wrong number of placements, or ``None`` for a tensor input,
    is a caller error and raises ``ValueError``.
    """
    err = _check_node(node)
    if err:
        _set_error(err)
        return None
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
        res, err = _PROPAGATE_CACHE[key]
        _set_error(err)
        return res
    try:
        res, err = _propagate_uncached(nd, tensor_given, tp)
    except Exception as e:  # never let torch's errors escape: refuse, keep the message
        res, err = None, f"DTensor sharding propagation for {nd.op} failed: {type(e).__name__}: {e}"
    _cache_put(_PROPAGATE_CACHE, key, (res, err))
    _set_error(err)
    return res


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
