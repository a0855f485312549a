"""Table lookups whose indices a graph computes from constants alone, checked when captured.

A model that reads a position table with ``arange(seq)`` (GPT-2's ``wpe``) fails on one device
with ``IndexError: index out of range in self`` when the sequence is longer than the table:
the kernel checks each index. The check cannot run at capture, where tensors are fake and carry
no values, and split over ranks the same lookup may read a slice of the table, so the error
would come late, from inside the graph, naming nothing. Such indices depend on no input value
(only on shapes, which the capture fixes), so they are computed here once per captured graph,
on real tensors, from the nodes they come from, and compared with the table's rows.

Only lookups whose indices descend from no placeholder are evaluated (token ids are inputs and
are checked per call, in ``runtime.checks``); random ops are never evaluated, and a chain that
fails to evaluate, or is large, is skipped (nothing is refused that one device would run).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from sptransform.torch_internals import OpOverload, op_schema

aten = torch.ops.aten

LOOKUPS = (aten.embedding.default, aten.index_select.default)
"""Ops that read rows of a table by index: (table, indices) for embedding, (table, dim, index)."""

MAX_ELEMENTS = 1 << 20
"""Largest intermediate evaluated (elements); larger chains are skipped."""


def constant_lookup_problems(gm: fx.GraphModule, state_names: dict[fx.Node, str]) -> list[str]:
    """One line per lookup of ``gm`` whose constant indices reach past its table's rows.
    ``state_names``: placeholder -> the parameter or buffer's name, for the message."""
    problems, values = [], {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LOOKUPS:
            continue
        if node.target is aten.embedding.default:
            table, indices, dim = node.args[0], node.args[1], 0
        else:
            table, dim, indices = node.args[0], node.args[1], node.args[2]
        value = _evaluate(indices, values)
        shape = getattr(table.meta.get("val"), "shape", None) if isinstance(table, fx.Node) else None
        if value is None or shape is None or value.numel() == 0 or value.is_floating_point():
            continue
        rows = int(shape[dim])
        high, low = int(value.max()), int(value.min())
        if high >= rows or low < -rows:
            name = state_names.get(table, table.name)
            problems.append(
                f"{name!r} has {rows} rows and the model reads row {high if high >= rows else low} of it "
                f"(indices computed from the input's shape, e.g. positions up to the sequence length)"
            )
    return problems


def _evaluate(node, values: dict):
    """The real value of ``node`` if it depends on constants alone, else None (memoised)."""
    if not isinstance(node, fx.Node):
        return node
    if node in values:
        return values[node]
    values[node] = None  # cycles cannot happen in a graph; this also marks "in progress"
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return None
    schema = op_schema(node.target)
    if schema.is_mutable or any(word in schema.name for word in ("rand", "bernoulli")):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.numel() > MAX_ELEMENTS:
        return None
    args = []
    for arg in node.args:
        if isinstance(arg, fx.Node):
            value = _evaluate(arg, values)
            if value is None:
                return None
            args.append(value)
        elif isinstance(arg, (list, tuple)) and any(isinstance(a, fx.Node) for a in arg):
            return None
        else:
            args.append(arg)
    kwargs = {k: v for k, v in node.kwargs.items() if not isinstance(v, fx.Node)}
    if len(kwargs) != len(node.kwargs):
        return None
    kwargs.pop("device", None)  # evaluated on the CPU whatever device the graph runs on
    try:
        result = node.target(*args, **kwargs)
    except Exception:  # a chain that does not evaluate is skipped, never refused
        return None
    values[node] = result
    return result
