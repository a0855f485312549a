"""A fingerprint of a captured graph that is the same in every process that captured the same
program, for checking that the ranks of a job traced one model alike.

Every rank captures the unmodified model on its own; the passes then pair collectives across
ranks by position in the graph. A forward whose code depends on the rank (``if
dist.get_rank() == 0: ...``), on a per-rank config, or on anything else that differs between
processes traces a different graph on some rank, and the parallel model would compute another
function there with no error. Each node is hashed from what it computes (its inputs by their
own hashes), never from where it sits or what it is named:

    %mul : call_function[target=aten.mul.Tensor](args=(%x, 2.0))  val: [2, 8] float32 cuda:1
    ->  ("call_function", "aten.mul.Tensor", (("%", hash(x)), "2.0"), (), ([2, 8], "torch.float32", "cuda"))

Devices count by type only (rank ``r`` runs on ``cuda:r``); objects without a stable text
(a ``repr`` with an address) count by their type's name."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from sptransform.torch_internals import OpOverload

_MASK = (1 << 62) - 1


def _target(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, OpOverload):
        return str(target)
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)  # (a higher-order op: its name)
    return f"{module}.{name}" if isinstance(name, str) else type(target).__qualname__


def _canon(value, index: dict[fx.Node, int]):
    if isinstance(value, fx.Node):
        return ("%", index.get(value, -1))  # (the input's own hash)
    if isinstance(value, (list, tuple, torch.Size)):
        return tuple(_canon(v, index) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _canon(v, index)) for k, v in value.items()))
    if isinstance(value, torch.device):
        return ("device", value.type)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.layout, torch.memory_format)):
        return repr(value)
    if isinstance(value, slice):
        return ("slice", _canon(value.start, index), _canon(value.stop, index), _canon(value.step, index))
    if value is Ellipsis:
        return "..."
    return type(value).__qualname__


def _value(node: fx.Node):
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return (tuple(int(s) if isinstance(s, int) else str(s) for s in value.shape), str(value.dtype), value.device.type)
    return None


def node_fingerprints(gm: fx.GraphModule) -> list[int]:
    """One 62-bit hash per node of ``gm`` (in graph order), of the op, its arguments (each input
    node by its own hash, so a node's hash covers everything it is computed from, and not where it
    sits in the graph) and its value's shape, dtype and device type. Independent of node order:
    a model that builds its masks in a loop over a ``set`` of layer types traces them in another
    order in each process (Python's string hashes differ), the same computation."""
    hashes: dict[fx.Node, int] = {}
    out = []
    for node in gm.graph.nodes:
        parts = (node.op, _target(node.target), _canon(node.args, hashes), _canon(node.kwargs, hashes), _value(node))
        digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
        hashes[node] = int.from_bytes(digest, "little") & _MASK
        out.append(hashes[node])
    return out


def graph_fingerprint(hashes: list[int]) -> int:
    """The whole graph's hash from its nodes' (``node_fingerprints``), as a multiset."""
    digest = hashlib.blake2b(repr(sorted(hashes)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


@dataclass(frozen=True)
class GraphFingerprint:
    """A captured graph's node hashes, and its nodes as captured (to name the first that differs:
    the passes edit the graph afterwards, but an erased node keeps its op, name and stack)."""

    hashes: list[int]
    nodes: list[fx.Node]

    @property
    def digest(self) -> int:
        return graph_fingerprint(self.hashes)


def fingerprint(gm: fx.GraphModule) -> GraphFingerprint:
    return GraphFingerprint(node_fingerprints(gm), list(gm.graph.nodes))
