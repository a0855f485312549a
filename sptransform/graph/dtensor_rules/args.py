"""A node's arguments in the form DTensor's dispatcher sees them: positional schema arguments
given by name moved into ``args``, dims made non-negative, ``fx.Node`` leaves in pytree order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from sptransform.torch_internals import op_schema
from sptransform.torch_internals import (
    OpOverload,
)


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
    positional = [a for a in op_schema(op).arguments if not a.kwarg_only]
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

    schema = op_schema(op).arguments
    args = tuple(fix(a) if i < len(schema) and schema[i].name in _DIM_ARGUMENTS else a for i, a in enumerate(args))
    kwargs = {k: (fix(v) if k in _DIM_ARGUMENTS else v) for k, v in kwargs.items()}
    return args, kwargs


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
