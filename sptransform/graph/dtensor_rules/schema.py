"""What DTensor is asked: an abstract mesh, one node as DTensor's strategies see it (``_Node``:
its op, input specs, output structure) and the answers' types (``Strategy``, ``Answer``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from sptransform.torch_internals import op_schema
from sptransform.torch_internals import (
    DecompShardingStrategy,
    DTensorSpec,
    OpOverload,
    OpSchema,
    RuntimeSchemaInfo,
    TensorMeta,
    abstract_device_mesh,
    free_unbacked_symbols,
    sharding_propagator,
)
from sptransform.torch_internals import StridedShard as _StridedShard
from sptransform.torch_internals import disable_current_modes as _disable_current_modes
from sptransform.graph.dtensor_rules.args import _map_arg, dispatch_args, flat_input_nodes

# The answer caches (``enumerate._STRATEGY_CACHE``, ``propagate._PROPAGATE_CACHE``) are keyed by
# op, shapes, strides, dtypes, tp and the question: DTensor's answer is a pure function of those,
# and asking again re-runs its strategy code for every node of every layer. Bounded, cleared whole.
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


T = TypeVar("T")


@dataclass(frozen=True)
class Answer(Generic[T]):
    """What DTensor said: ``value``, or ``None`` and ``reason`` why not (naming the op)."""

    value: T | None
    reason: str | None = None


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


# One abstract mesh per tp, shared: building one suspends every dispatch mode, and the mesh
# holds no process group or other state that a caller could change.
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
        if self.node.meta.get("val", None) is None and op_schema(self.op).returns:
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


def _check_node(node: fx.Node) -> str | None:
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return f"{node.format_node()} is not a call to an ATen OpOverload"
    return None


def _cache_put(cache: dict, key: Any, value: Any) -> None:
    if key is None:
        return
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value
