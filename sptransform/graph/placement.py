"""Where a tensor lives on the tensor-parallel axis: replicated, split along a dim, or a partial sum.

Every node of a captured graph gets one ``Placement`` (a tuple of them for ops with several
outputs, ``None`` for non-tensors):

* ``REPLICATED``: every rank holds the whole tensor, equal on all ranks;
* ``DimShard(dim, segments)``: split along ``dim`` (one segment is an even split of the dim,
  several are a fused dim whose every segment is split evenly, see ``DimShard``);
* ``PARTIAL``: every rank holds a tensor of the full shape; the value is their sum.

A placement says what a rank's *local* tensor means. Its gradient has the dual placement:
a split tensor's gradient is split the same way, a partial sum's gradient is replicated,
and a replicated tensor's gradient is either replicated or partial, depending on who reads
it (``graph.gradients`` decides which, from dataflow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union



@dataclass(frozen=True)
class DimShard:
    """Along ``dim``, the index range is cut into ``segments`` ``(start, length)``; each segment
    is split evenly over the ``tp`` ranks, rank r holding ``[start + r*length/tp, start +
    (r+1)*length/tp)`` of every segment. One segment covering the dim is ordinary ``Shard(dim)``;
    k equal segments are torch's ``_StridedShard(dim, split_factor=k)`` (a fused ``[q|k|v]``
    weight split per head inside each of q, k and v)."""

    dim: int
    segments: tuple[tuple[int, int], ...]

    def local_size(self, tp: int) -> int:
        return sum(length for _, length in self.segments) // tp

    def indices(self, rank: int, tp: int) -> list[int]:
        out: list[int] = []
        for start, length in self.segments:
            part = length // tp
            out.extend(range(start + rank * part, start + (rank + 1) * part))
        return out

    def with_dim(self, dim: int) -> "DimShard":
        return DimShard(dim, self.segments)


def whole(dim: int, size: int) -> DimShard:
    """An even split of all ``size`` elements of ``dim``: DTensor's ``Shard(dim)``."""
    return DimShard(dim, ((0, size),))


@dataclass(frozen=True)
class Replicated:
    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True)
class PartialSum:
    def __repr__(self) -> str:
        return "P"


REPLICATED = Replicated()
PARTIAL = PartialSum()

Placement = Union[Replicated, PartialSum, DimShard]


def is_split(placement) -> bool:
    return isinstance(placement, DimShard)


def describe_placement(placement) -> str:
    """``R``, ``P``, ``S(2)`` or ``S(2, 3 segments)`` (``None`` for non-tensors)."""
    if placement is None:
        return "-"
    if isinstance(placement, tuple):
        return "(" + ", ".join(describe_placement(p) for p in placement) + ")"
    if isinstance(placement, DimShard):
        if len(placement.segments) == 1:
            return f"S({placement.dim})"
        return f"S({placement.dim}, {len(placement.segments)} segments)"
    return repr(placement)


@dataclass(frozen=True)
class ParamPlacement:
    """How one parameter is held: split along ``spec`` (None: replicated).
    ``padded_rows``: the local shard is padded to this many rows in the graph (a vocabulary
    that tp does not divide)."""

    spec: DimShard | None
    role: str
    padded_rows: int | None = None
    stored_whole: bool = False
    """Split in the graph in a way DTensor has no placement for (a fused weight of unequal
    segments): the graph cuts the local part from the whole, and the parameter's gradient is
    summed over the group. ``passes.shard_whole`` then stores it in 1/tp pieces (``gathered``),
    all-gathered where read, the sum a reduce-scatter; it stays whole on every rank only where
    tp divides none of its dims."""
    gathered: DimShard | None = None
    """Read whole in the graph (``spec`` None, or ``stored_whole``) but stored split this way,
    all-gathered where a layer reads it (``passes.shard_whole``)."""

    @property
    def storage(self) -> DimShard | None:
        """The split the parameter is stored with (None: whole on every rank)."""
        if self.gathered is not None:
            return self.gathered
        return None if self.stored_whole else self.spec
