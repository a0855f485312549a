"""Checks of a parallel module's inputs, run before any collective of the step.

A bad input must fail the way it fails on one device, and on *every* rank: a rank that raises
while its peers enter a collective leaves them waiting for the process group's timeout. So
each call runs in two phases:

1. **local** (no communication): structural checks (meta tensors, ``use_cache=True``), building
   the graph of a new signature, and the vocabulary check: token ids that feed the
   vocab-parallel embedding and labels that feed the vocab-parallel loss are compared with the
   vocabulary (on one device ``F.embedding`` and ``cross_entropy`` raise ``IndexError``; split
   over ranks, each rank would silently mask the ids it does not hold). Any exception is held.
2. **agree** (one fixed-size all-gather of ``FINGERPRINT`` int64s per call, ``check_inputs``):
   each rank contributes whether phase 1 failed, and hashes of its train/eval mode, of the input
   structure, and of each input's shape/dtype and values, and the digest of the captured graph
   the call runs (a graph built for a new signature or mode is compared here, at no extra
   collective: tp peers with the same inputs and modes trace the same program unless the
   forward depends on the rank). Every rank then raises the same way:
   its own held error, or that a peer failed, or that the ranks were given different inputs
   (naming the input). The collective has the same shape whatever the inputs, so ranks passing
   different shapes meet in it instead of aborting inside a graph collective. The hashes of what
   depends on the input signature alone (``signature_fingerprint``) are worked out once per
   signature by the module; values are hashed every call, CPU tensors from their bytes (no tensor
   op: the check's only op is the row it sends).

Under LocalTensorMode (simulated ranks in one process) phase 2 reads every simulated rank's
value directly. Under ``torch.compile`` (tracing) the checks are skipped: they read values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from sptransform.graph.nodes import packet
from sptransform.runtime.ops import take_local, vocab_parallel_cross_entropy, vocab_parallel_embedding
from sptransform.torch_internals import local_values, maybe_disable_local_tensor_mode, pytree

aten = torch.ops.aten

LEAF_SLOTS = 6
"""Inputs fingerprinted one by one (so that a mismatch names the input); later ones share a slot."""
FINGERPRINT = 3 + 2 * LEAF_SLOTS + 2
"""int64s per rank: failed flag, mode, structure, per-input shape/dtype and values, the rest, and the
digest of the graph the call runs, as captured (``graph.fingerprint``)."""
_MASK = (1 << 62) - 1


# ---------------------------------------------------------------------------
# phase 1: local checks


def leaf_names(args: tuple, kwargs: dict) -> list[str]:
    """A readable name for each flattened input: ``input 'labels'``, ``positional input 0``, ``input 'x'[1]``."""
    names = []
    for path, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        head, *rest = path
        if getattr(head, "idx", None) == 0:  # the args tuple
            first = rest[0]
            name = f"positional input {first.idx}"
        else:
            first = rest[0]
            name = f"input {first.key!r}"
        names.append(name + pytree.keystr(tuple(rest[1:])))
    return names


def describe_inputs(args: tuple, kwargs: dict) -> dict[str, tuple]:
    """Each input tensor's ``(shape, dtype)`` by its readable name (``leaf_names``)."""
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    return {name: (tuple(leaf.shape), leaf.dtype) for name, leaf in zip(leaf_names(args, kwargs), leaves)
            if isinstance(leaf, torch.Tensor)}


def differences(example: dict[str, tuple], args: tuple, kwargs: dict) -> list[str]:
    """How a call's inputs differ from the example inputs: names, dtypes, ranks and shapes, one
    phrase per input. Told when a new call's capture fails, so the message names the input."""
    call = describe_inputs(args, kwargs)
    out = [f"{name} is not among the example inputs ({', '.join(example) or 'none'})"
           for name in call if name not in example]
    out += [f"{name} is missing" for name in example if name not in call]
    for name, (shape, dtype) in call.items():
        if name not in example:
            continue
        ex_shape, ex_dtype = example[name]
        if dtype != ex_dtype:
            out.append(f"{name} is {str(dtype).removeprefix('torch.')} where the example had "
                       f"{str(ex_dtype).removeprefix('torch.')}")
        if len(shape) != len(ex_shape):
            out.append(f"{name} has {len(shape)} dims {list(shape)} where the example had {len(ex_shape)} "
                       f"{list(ex_shape)}")
        elif shape != ex_shape:
            out.append(f"{name} has shape {list(shape)} (example: {list(ex_shape)})")
    return out


def check_call(args: tuple, kwargs: dict, call_defaults: dict, *, example: bool = False) -> None:
    """Structural checks of one call's inputs (local, cheap). ``example``: the inputs are
    ``example_inputs``, of which only shapes are read (meta tensors are fine there)."""
    if "use_cache" in call_defaults and kwargs.get("use_cache") not in (None, False):
        raise ValueError(
            f"use_cache={kwargs['use_cache']!r}: a KV cache of heads split over the tensor-parallel ranks is not "
            "something sptransform returns; pass use_cache=False (the default when omitted) and run generation on "
            "an unparallelized copy"
        )
    if kwargs.get("past_key_values") is not None:
        raise ValueError("past_key_values: sptransform runs training steps without a KV cache; pass none")
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    for index, leaf in enumerate(leaves):
        if not example and isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
            name = leaf_names(args, kwargs)[index]
            raise ValueError(
                f"{name} is a meta tensor (shape {tuple(leaf.shape)}, no values): a parallel module runs "
                "real inputs; pass a tensor on the model's device (meta tensors are fine in example_inputs=)"
            )


@dataclass(frozen=True)
class VocabCheck:
    """Flat input ``leaf`` feeds the vocab-parallel embedding (``kind="ids"``) or loss (``"labels"``)."""

    leaf: int
    kind: str
    vocab: int
    ignore_index: int | None = None


# A constant table (never written at run time): ops through which token ids keep their values.
_INDEX_PRESERVING = {
    aten.view, aten.reshape, aten._unsafe_view, aten.slice, aten.contiguous, aten.clone, aten.alias,
    aten.to, aten._to_copy, aten.constant_pad_nd, aten.pad, aten.expand, aten.t, aten.transpose, aten.permute,
    aten.squeeze, aten.unsqueeze, aten.flatten, aten.select, aten.detach, aten.lift_fresh_copy, aten.narrow,
}
"""Ops that only move or copy values (and pads, whose fill is the model's own constant): a
value of their output is a value of their first input."""


def _source_input(node: Any, user_inputs: dict[fx.Node, int]) -> int | None:
    """The flat user input whose values ``node`` carries unchanged, if any."""
    while isinstance(node, fx.Node):
        if node in user_inputs:
            return user_inputs[node]
        if node.op != "call_function" or not node.args:
            return None
        if node.target is not take_local and packet(node) not in _INDEX_PRESERVING:
            return None
        node = node.args[0]
    return None


def vocab_checks(gm: fx.GraphModule, num_state: int, num_user: int, vocab: int | None) -> list[VocabCheck]:
    """Which user inputs a graph reads as token ids or labels, and the vocabulary.

    Found on the graph: the ids argument of each embedding (``vocab_parallel_embedding``, whose
    vocabulary is ``vocab``, or ATen's, whose vocabulary is its weight's rows) and the target of
    each cross-entropy (vocab-parallel or ATen's), followed back through views, slices, casts
    and pads to a user input (HF shifts labels by a pad and a slice). A target computed from
    the inputs otherwise is not checked."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user_inputs = {n: i for i, n in enumerate(placeholders[num_state : num_state + num_user])}
    checks: dict[tuple[int, str], VocabCheck] = {}

    def add(kind: str, source, size, ignore_index=None) -> None:
        leaf = _source_input(source, user_inputs)
        if leaf is not None and size is not None:
            checks.setdefault((leaf, kind), VocabCheck(leaf, kind, int(size), ignore_index))

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is vocab_parallel_embedding:
            add("ids", node.args[1], vocab)
        elif node.target is vocab_parallel_cross_entropy:
            add("labels", node.args[1], node.args[4], int(node.args[5]))
        elif packet(node) is aten.embedding:
            add("ids", node.args[1], _dim_size(node.args[0], 0))
        elif packet(node) is aten.cross_entropy_loss and len(node.args) > 1:
            logits = node.args[0]
            ndim = len(_shape(logits) or ())
            ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
            add("labels", node.args[1], _dim_size(logits, 1 if ndim >= 2 else 0), int(ignore))
    return list(checks.values())


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _dim_size(node, dim: int) -> int | None:
    shape = _shape(node)
    return int(shape[dim]) if shape is not None and len(shape) > dim else None


def _per_rank(x: torch.Tensor) -> list[torch.Tensor]:
    values = local_values(x)
    return [x] if values is None else [values[r] for r in sorted(values)]


def check_vocab(checks: Sequence[VocabCheck], leaves: list, names: Callable[[], list[str]]) -> None:
    """Raise ``IndexError`` (as one device does) for an id or label outside the vocabulary.
    ``names()`` gives the inputs' names (built only for a message)."""
    with maybe_disable_local_tensor_mode():
        for check in checks:
            value = leaves[check.leaf]
            if not isinstance(value, torch.Tensor):
                continue
            for t in _per_rank(value):
                _check_range(check, t.detach(), lambda: names()[check.leaf])


def _value_range(t: torch.Tensor) -> tuple[int, int]:
    """The least and greatest of an integer tensor's values: on the CPU read by numpy (no op
    call, no filled output per call: ``aminmax`` was 4 ``aten::fill_`` per call with ids and
    labels); elsewhere one ``aminmax`` where the tensor lives."""
    if t.device.type == "cpu":
        values = t.numpy()
        return int(values.min()), int(values.max())
    low, high = torch.aminmax(t)
    return int(low), int(high)


def _check_range(check: VocabCheck, t: torch.Tensor, name_of: Callable[[], str]) -> None:
    if t.numel() == 0:
        return
    if t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name_of()} feeds the vocabulary as {check.kind} and must hold integers, got {t.dtype}")
    low, high = _value_range(t)
    if 0 <= low and high < check.vocab:
        return
    bad = (t < 0) | (t >= check.vocab)
    if check.ignore_index is not None:
        bad &= t != check.ignore_index
    if not bool(bad.any()):
        return
    value = int(t[bad].reshape(-1)[0])
    count = int(bad.sum())
    name = name_of()
    if check.kind == "ids":
        raise IndexError(
            f"token id {value} in {name} is outside the vocabulary of {check.vocab} (ids must be in "
            f"[0, {check.vocab - 1}]; {count} value(s) are not): the single-device model raises IndexError "
            "('index out of range in self') here; split over ranks it would silently read zeros"
        )
    raise IndexError(
        f"label {value} in {name} is out of bounds for the vocabulary of {check.vocab} (labels must be in "
        f"[0, {check.vocab - 1}] or the ignore index {check.ignore_index}; {count} value(s) are not): the "
        "single-device loss raises IndexError ('Target ... is out of bounds') here"
    )


# ---------------------------------------------------------------------------
# phase 2: agree across ranks


def stable_hash(*parts: object) -> int:
    """A hash of ``repr(parts)`` that is the same in every process (Python's ``hash`` of a str is not)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


# A constant table (never written): the integer dtype of each width, to read a digest's bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _content(t: torch.Tensor) -> int | torch.Tensor:
    """A hash of a tensor's values (< 2**62): on the CPU a Python int, the digest of its bytes (no
    tensor op: each reduction was an op call and a fill of its output per input per call);
    elsewhere a 0-dim int64 tensor left on its device (read with the gathered table, one sync)."""
    if t.device.type == "cpu":
        t = t.detach() if t.requires_grad else t
        try:
            data = t.numpy().tobytes()
        except (TypeError, RuntimeError):  # no numpy dtype (bfloat16, float8), or a lazy conj/neg bit
            data = _as_bits(t).numpy().tobytes()
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK
    return _device_content(t)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bits as integers of the same width (complex as pairs of reals; a lazy
    conjugate or negation resolved first)."""
    t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_BITS[t.element_size()]) if t.is_floating_point() else t


def _device_content(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 hash of a tensor's values, computed where it lives: the sum of its bits
    weighted by position (a permutation changes it), wrapping in int64."""
    x = _as_bits(t.detach()).reshape(-1).to(torch.int64)
    weights = torch.arange(1000004, 1000004 + x.numel(), dtype=torch.int64, device=x.device)
    return (x * weights).sum() & _MASK


def signature_fingerprint(args: tuple, kwargs: dict) -> list[int]:
    """The part of a call's fingerprint that depends on its input signature alone (structure,
    non-tensor values, each tensor's shape and dtype): ``FINGERPRINT - 2 - LEAF_SLOTS`` ints,
    which a module computes once per signature and hands to ``fingerprint``."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    structure = stable_hash(str(spec), [("T",) if isinstance(x, torch.Tensor) else ("V", repr(x)) for x in leaves])
    metas = [0] * LEAF_SLOTS
    rest_meta = []
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        meta = stable_hash(tuple(x.shape), str(x.dtype))
        if i < LEAF_SLOTS:
            metas[i] = meta
        else:
            rest_meta.append(meta)
    return [structure, *metas, (stable_hash(rest_meta) * 1000003) & _MASK]  # < 2**62: its sum below stays in int64


def fingerprint(args: tuple, kwargs: dict, mode_key: tuple, failed: bool, device: torch.device,
                signature: list[int] | None = None, graph: int = 0) -> list[torch.Tensor]:
    """This rank's fingerprint of one call, one ``FINGERPRINT``-long int64 tensor per simulated
    rank (one on a real rank). A failed rank sends only its flag. ``signature``: the call's
    ``signature_fingerprint``, when the caller has it already; ``graph``: the digest of the
    captured graph the call runs (0: none to compare)."""
    with maybe_disable_local_tensor_mode():  # plain tensors; simulated ranks' values are read one by one
        return _fingerprint(args, kwargs, mode_key, failed, device, signature, graph)


def _fingerprint(args: tuple, kwargs: dict, mode_key: tuple, failed: bool, device: torch.device,
                 signature: list[int] | None, graph: int) -> list[torch.Tensor]:
    # Built from Python ints in one ``torch.tensor`` (on the CPU; elsewhere with the inputs'
    # content hashes where they live): no zero-filled buffer written slot by slot.
    if failed:
        return [torch.tensor([1] + [0] * (FINGERPRINT - 1), dtype=torch.int64, device=device)]
    if signature is None:
        signature = signature_fingerprint(args, kwargs)
    structure, *metas, rest_meta_hash = signature
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    # layout: flag, mode, structure, metas[0..L), contents[0..L), rest (metas and contents)
    head = [0, stable_hash(mode_key), structure, *metas]
    ranks = max((len(_per_rank(x)) for _, x in tensors), default=1)
    rows = []
    for r in range(ranks):
        contents: list[int | torch.Tensor] = [0] * LEAF_SLOTS
        rest: int | torch.Tensor = 0
        for i, x in tensors:
            values = _per_rank(x)
            value = _content(values[r if len(values) > 1 else 0])
            if i < LEAF_SLOTS:
                contents[i] = value
            else:
                rest = (rest * 31 + value) & _MASK
        rest = (rest + rest_meta_hash) & _MASK
        tail = [*contents, rest, graph]
        if any(isinstance(v, torch.Tensor) for v in tail):  # hashes computed on a device
            tail = [v.to(device) if isinstance(v, torch.Tensor) else torch.tensor(v, device=device) for v in tail]
            rows.append(torch.cat([torch.tensor(head, dtype=torch.int64, device=device), torch.stack(tail)]))
        else:
            rows.append(torch.tensor(head + tail, dtype=torch.int64, device=device))
    return rows


def gather_fingerprints(rows: list[torch.Tensor], groups: Sequence[dist.ProcessGroup], simulated: bool) -> list[list[int]]:
    """Every rank's fingerprint: gathered over ``groups`` in turn (tensor-parallel, then
    pipeline), or read from the simulated ranks. Ranks in the order of the flattened mesh."""
    if simulated:
        with maybe_disable_local_tensor_mode():
            return [row.tolist() for row in rows]
    gathered = rows[0].reshape(1, -1)
    for group in groups:
        size = dist.get_world_size(group)
        if size == 1:
            continue
        # one output buffer, no list of parts to concatenate after
        out = gathered.new_empty((size * gathered.shape[0], gathered.shape[1]))
        dist.all_gather_into_tensor(out, gathered.contiguous(), group=group)
        gathered = out
    return gathered.tolist()


def raise_if_disagree(table: list[list[int]], own_error: BaseException | None, names: Callable[[], list[str]],
                      rank_label: Callable[[int], str], this_rank: int) -> None:
    """Raise on every rank when any rank failed (its own error, or a message naming the failed
    ranks) or when the ranks' fingerprints differ (naming the first input that differs;
    ``names()`` is called only then)."""
    failed = [r for r, row in enumerate(table) if row[0]]
    if own_error is not None:
        raise own_error
    if failed:
        who = ", ".join(rank_label(r) for r in failed)
        raise RuntimeError(
            f"the inputs of this call were rejected on {who} (that rank's error says why); this rank "
            f"({rank_label(this_rank)}) raises too, so that no rank waits in a collective for one that stopped"
        )
    if all(row == table[0] for row in table):
        return
    column = next(c for c in range(1, FINGERPRINT) if len({row[c] for row in table}) > 1)
    groups: dict[int, list[int]] = {}
    for r, row in enumerate(table):
        groups.setdefault(row[column], []).append(r)
    split = " vs ".join("[" + ", ".join(rank_label(r) for r in ranks) + "]" for ranks in groups.values())
    if column == FINGERPRINT - 1:
        raise ValueError(
            f"tensor-parallel ranks {split} run different graphs for the same inputs and modes: the model's forward "
            "traced differently on them (it depends on the rank, the device index or a per-rank flag or config), "
            "so the parallel model would compute another function on some ranks; every rank must trace the same "
            "program (check_inputs=False turns this check off)")
    if column == 1:
        what = "are in different train/eval modes (call .train() / .eval() on every rank alike)"
    elif column == 2:
        what = "were given inputs of different structure or different non-tensor values"
    elif column < 3 + LEAF_SLOTS:
        what = f"were given {_name(names(), column - 3)} with different shapes or dtypes"
    elif column < 3 + 2 * LEAF_SLOTS:
        what = f"were given different values of {_name(names(), column - 3 - LEAF_SLOTS)}"
    else:
        what = f"were given different inputs after the first {LEAF_SLOTS}"
    raise ValueError(
        f"tensor-parallel ranks {split} {what}: every rank of a tensor-parallel group must get the same batch "
        "(a data loader sharded by global rank instead of by data-parallel rank does this); the check costs one "
        "small all-gather per call, check_inputs=False turns it off"
    )


def _name(names: list[str], index: int) -> str:
    return names[index] if index < len(names) else f"flat input {index}"
