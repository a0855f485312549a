"""Facts about the tensors of an ATen FX graph, read from ``node.meta["val"]`` and op schemas.

Which node is a view of which (and so which storage a saved tensor keeps alive),
how many bytes that storage holds, and what kind of op a node runs (matmul, fused
attention, random, collective). Nothing here reads node names or module paths.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from sptransform.torch_internals import op_qualified_name, op_schema
from sptransform.torch_internals import OpOverload, free_unbacked_symbols, run_and_save_rng_state, run_with_rng_state

aten = torch.ops.aten

MATMUL_OPS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.linear, aten._scaled_mm})

GROUPED_MM_OPS = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback"})
"""Grouped matmuls by schema name: ``out[rows of group e] = x[rows of group e] @ w[e]`` for
``x [S, K]``, ``w [E, K, N]`` and cumulative group ends ``offs [E]``. transformers' MoE experts
(``experts_implementation="grouped_mm"``) run torch's kernel or, where it cannot (float32 under
tracing, CPU), its own custom op with the same schema; that op exists only once transformers is
imported, so it is known by name rather than by its packet."""


def is_grouped_mm(node: fx.Node) -> bool:
    """A grouped matmul of a 2-D ``x`` by a 3-D ``w`` with offsets and no bias (``GROUPED_MM_OPS``)."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return False
    if node.target.name() not in GROUPED_MM_OPS or len(node.args) < 3 or not isinstance(node.args[2], fx.Node):
        return False
    if node.args[3:] and node.args[3] is not None or node.kwargs.get("bias") is not None:
        return False
    x, w = shape_of(node.args[0]), shape_of(node.args[1])
    return x is not None and w is not None and len(x) == 2 and len(w) == 3


# Ops that return (an alias of) their input without an alias annotation in the
# schema: ``_unsafe_view`` is how ``reshape`` aliases a fresh clone, and a
# collective's ``wait_tensor`` hands back the tensor the collective wrote.
_UNANNOTATED_ALIASES = frozenset({aten._unsafe_view.default, torch.ops._c10d_functional.wait_tensor.default})
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
ALL_GATHERS = frozenset({
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional_autograd.all_gather_into_tensor.default,
})
# Fused softmax-attention kernels (forward only), by overload packet.
_FUSED_ATTENTION = frozenset(getattr(aten, name) for name in (
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_flash_attention_forward_no_dropout_inplace",  # by name: not in every torch (2.11 lacks it)
    "_efficient_attention_forward",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_attention_math_for_mps",
) if hasattr(aten, name))

JOINT_ID = "sptransform_joint_id"
"""``node.meta`` key: a node's position in the joint forward+backward graph it was partitioned
from. torch's extraction of the forward and backward graphs copies ``meta``, so the forward
node and the backward placeholder of one saved value carry the same id: identity by
provenance, never by ``node.name``."""
TANGENT = "sptransform_tangent"
"""``node.meta`` key set on the joint graph's tangent placeholders (and so on the backward
graph's, which share their ``meta``)."""


def number_joint_nodes(joint: fx.Graph, joint_inputs=None) -> None:
    """Give every node of ``joint`` its ``JOINT_ID`` and mark its tangent inputs (``TANGENT``).

    AOTAutograd calls a partition with ``joint_inputs = (primals, tangents)`` and the joint
    graph's placeholders in that order, so the tangents are the last ``len(tangents)``."""
    placeholders = list(joint.find_nodes(op="placeholder"))
    if joint_inputs is not None and len(joint_inputs) == 2 and all(isinstance(x, (list, tuple)) for x in joint_inputs):
        primals, tangents = joint_inputs
        if len(primals) + len(tangents) != len(placeholders):
            raise AssertionError(f"joint graph has {len(placeholders)} inputs, AOTAutograd passed "
                                 f"{len(primals)} primals and {len(tangents)} tangents")
        for node in placeholders[len(primals):]:
            node.meta[TANGENT] = True
    for index, node in enumerate(joint.nodes):
        node.meta[JOINT_ID] = index


def joint_id(node: fx.Node) -> int | None:
    return node.meta.get(JOINT_ID)


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and bool(node.meta.get(TANGENT))


def val(node) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def data_dependent(node) -> bool:
    """Whether ``node`` makes or reads a value whose shape (or an integer) depends on the data:
    an unbacked symbol (``u0``) of ``nonzero``, a boolean mask, ``.tolist()`` of routing counts.
    Such a value has no static size to split, and differs from rank to rank if computed from
    each rank's part of the tokens."""
    if not isinstance(node, fx.Node):
        return False
    return any(free_unbacked_symbols(val(n)) for n in (node, *node.all_input_nodes))


def routes(node) -> bool:
    """Whether ``node`` decides something from the data: it makes a new unbacked symbol (the
    count of ``nonzero``, an ``.item()``) or a value that is not a tensor from one (a size, a
    comparison, an assertion). Such ops must see the same whole inputs on every rank, so that
    every rank routes every token alike; an op that only reads a tensor with a data-dependent
    size (the rows ``x[idx]`` and what is computed from them) need not."""
    if not data_dependent(node):
        return False
    value = val(node)
    if not _tensors(value):  # a size, a comparison, an assertion
        return True
    read = set().union(*(free_unbacked_symbols(val(n)) for n in node.all_input_nodes))
    return bool(free_unbacked_symbols(value) - read)


def _tensors(value) -> bool:
    """A tensor, or the chunks of a ``split`` (sized by run-time counts it reads, not new ones)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def unbacked_dims(node, index: int | None = None) -> set[int]:
    """The dims of ``node``'s tensor (its chunk ``index``, for a ``split``) whose size is known
    only at run time (``u0``)."""
    value = val(node)
    if index is not None and isinstance(value, (list, tuple)):
        value = value[index]
    if not isinstance(value, torch.Tensor):
        return set()
    return {d for d, size in enumerate(value.shape) if free_unbacked_symbols(size)}


def tensor_val(node) -> torch.Tensor | None:
    value = val(node)
    return value if isinstance(value, torch.Tensor) else None


def packet(node: fx.Node):
    target = node.target
    return target.overloadpacket if isinstance(target, OpOverload) else target


def _returns_alias(target) -> bool:
    if not isinstance(target, OpOverload):
        return False
    if target in _UNANNOTATED_ALIASES:
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op_schema(target).returns)


def is_view(node: fx.Node) -> bool:
    """``node`` shares storage with its first tensor input (view, transpose, split item, ...)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, fx.Node) and parent.op == "call_function" and _returns_alias(parent.target)
    return _returns_alias(node.target) and isinstance(node.args[0], fx.Node)


def storage_root(node: fx.Node) -> fx.Node:
    """The node that allocated the storage ``node`` looks at."""
    while is_view(node):
        node = node.args[0]  # a split item steps to the split, then to the split's input
    return node


def storage_nbytes(node: fx.Node) -> int:
    """Bytes of the storage ``node`` keeps alive (0 when it is not a tensor)."""
    value = tensor_val(storage_root(node))
    if value is None:
        return 0
    try:
        return int(value.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):  # tensor subclasses without a storage
        return value.numel() * value.element_size()


def tensor_nbytes(node: fx.Node) -> int:
    value = tensor_val(node)
    return 0 if value is None else value.numel() * value.element_size()


_RNG_WRAPPERS = {run_and_save_rng_state: 0, run_with_rng_state: 1}
"""Higher-order ops that run a random op with a saved generator state -> position of that op in args."""


def unwrap_rng(node: fx.Node) -> tuple[object, tuple, dict]:
    """``(op, args, kwargs)`` of ``node``, looking through a save/replay-RNG wrapper."""
    at = _RNG_WRAPPERS.get(node.target)
    if at is None:
        return node.target, tuple(node.args), dict(node.kwargs)
    return node.args[at], tuple(node.args[at + 1:]), dict(node.kwargs)


def is_random(node: fx.Node) -> bool:
    """Draws from a random generator (also when wrapped to save or replay the generator's state).

    An attention kernel called with ``dropout_p=0`` is tagged random but draws nothing."""
    op, args, kwargs = unwrap_rng(node)
    if not (isinstance(op, OpOverload) and torch.Tag.nondeterministic_seeded in op.tags):
        return node.target in _RNG_WRAPPERS
    names = [a.name for a in op_schema(op).arguments]
    if "dropout_p" in names:
        at = names.index("dropout_p")
        p = kwargs.get("dropout_p", args[at] if at < len(args) else op_schema(op).arguments[at].default_value)
        return not (isinstance(p, (int, float)) and p == 0)
    return True


def is_collective(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, OpOverload) and target.namespace in _COLLECTIVE_NAMESPACES


def is_matmul(node: fx.Node) -> bool:
    return node.op == "call_function" and packet(node) in MATMUL_OPS


def is_fused_attention(node: fx.Node) -> bool:
    """A fused softmax-attention kernel (SDPA or one of the flash / efficient / cuDNN kernels)."""
    target, _, _ = unwrap_rng(node)
    return isinstance(target, OpOverload) and target.overloadpacket in _FUSED_ATTENTION


def is_multi_output(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(val(node), (tuple, list))


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(val(a), torch.Tensor) or is_multi_output(a)]


def shape_of(node) -> tuple[int, ...] | None:
    """The node's tensor shape as ints (None for non-tensors and non-nodes).

    A size known only at run time (routed rows, ``u0``) reads as ``stand_in(size)``: a prime no
    real size divides, not 1, so the rules that look at shapes treat it as a size that neither
    broadcasts (as ``torch.export`` assumes of it) nor splits; no split of it is ever made
    (``unbacked_dims``)."""
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(value, torch.Tensor):
        return tuple(size_of(s) for s in value.shape)
    return None


def size_of(size) -> int:
    """One size as an int: a static one as it is, one known only at run time by its ``stand_in``."""
    return stand_in(size) if free_unbacked_symbols(size) else int(size)


_STAND_INS = (1_000_003, 1_000_033, 1_000_037, 1_000_039)


def stand_in(size) -> int:
    """An integer for a data-dependent size: each unbacked symbol by one of a few large primes
    (the same symbol always by the same one, so equal sizes stay equal)."""
    expr = size.node.expr if isinstance(size, torch.SymInt) else size
    symbols = sorted(expr.free_symbols, key=str)
    values = {sym: _STAND_INS[int("".join(c for c in str(sym) if c.isdigit()) or 0) % len(_STAND_INS)]
              for sym in symbols}  # (u0, u1, ...: by the symbol's number, the same in every process)
    return int(expr.subs(values))


def output_shape(node) -> tuple[int, ...] | None:
    """``shape_of``, or for an op with several tensor outputs of one shape (``max.dim``'s values
    and indices, ``var_mean``) that shape: each output is split as the others."""
    shape = shape_of(node)
    value = node.meta.get("val") if shape is None and isinstance(node, fx.Node) else None
    if isinstance(value, (tuple, list)):
        shapes = {tuple(int(s) for s in v.shape) for v in value if isinstance(v, torch.Tensor)}
        if len(shapes) == 1:
            return shapes.pop()
    return shape


def describe(node: fx.Node) -> str:
    """``aten.view.default (node view) at model.py, line 42: code`` for error messages: the
    innermost frame of the user's code (not torch's) that made the op."""
    target = getattr(node.target, "__name__", str(node.target))
    if isinstance(node.target, OpOverload):
        target = op_qualified_name(node.target)
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines() if ln.strip()]
    frames = [(lines[i][5:], lines[i + 1] if i + 1 < len(lines) else "") for i in range(len(lines)) if lines[i].startswith("File ")]
    user = [f for f in frames if "/torch/" not in f[0]] or frames
    where = f" at {user[-1][0]}: {user[-1][1]}" if user else ""
    return f"{target} (node {node.name}){where}"


MOVES_ONLY = frozenset({aten.view, aten.reshape, aten._unsafe_view, aten.to, aten._to_copy, aten.contiguous, aten.clone,
                        aten.alias, aten.detach, aten.slice, aten.transpose, aten.permute, aten.squeeze, aten.unsqueeze})
"""Op packets that only move, view or cast data: looked through to find who really reads a tensor."""


def forward_closure(starts) -> list[fx.Node]:
    """``starts`` and every node downstream of them, each once (depth first)."""
    seen, stack, order = set(), list(starts), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        stack.extend(n.users)
    return order
