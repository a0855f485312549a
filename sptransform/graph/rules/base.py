"""What every rule of the registry speaks in: a ``Decision`` (forward), the ``RuleContext`` it
is asked in, ``OpRule`` (one op's entry), and the error a rule raises when a split cannot run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from sptransform.graph.placement import REPLICATED, DimShard

CUT = "cut"
"""A backward answer for an input that cannot carry the split (fewer K/V heads than tp): it is
computed whole and cut where it is read."""


class ShardingError(ValueError):
    """An op cannot run on the local shard as asked; names the op and its source line."""


@dataclass(frozen=True)
class RuleContext:
    tp: int
    is_constant: Callable[[fx.Node], bool]
    """Computed from parameters and buffers only (a weight, its transpose, its cast): a
    matmul keeps such an operand where it is and moves the other one."""


@dataclass(frozen=True)
class Decision:
    needs: dict
    """Tensor input node -> the placement the op reads it in (a redistribution where it differs)."""
    output: object
    """The output's placement (a tuple for ops with several outputs)."""
    source: str = "ours"
    """Which rule decided: ``replicated``, ``ours``, ``dtensor``, ``gather`` or ``routing`` (data-dependent shapes, whole)."""
    note: str | None = None
    """Something the user should know about this decision (a DTensor rule that could not be
    checked by running it), shown by ``explain()``."""


Links = list[tuple[fx.Node, dict[int, int]]]
LinksRule = Callable[[fx.Node], tuple[Links, set[int]]]
"""For each tensor input, ``{out_dim: in_dim}`` of the dims that correspond one to one, and the
output dims that may not be split (reduced, normalized, contracted or sliced)."""
ForwardRule = Callable[[fx.Node, "LinksRule | None", dict, RuleContext], "Decision | None"]
"""(node, its links rule, current placement of each tensor input, context) -> a decision, or
None: no rule of ours applies to these placements (DTensor is asked next)."""
BackwardRule = Callable[[fx.Node, "LinksRule | None", DimShard, int], "list | None"]
"""(node, its links rule, the output's wanted split, tp) -> ``[(input, split | None | CUT)]``
(None for an input read whole), or None: no rule of ours for this call (DTensor is asked next).
Raises ``ShardingError`` when the output cannot be split so."""


@dataclass(frozen=True)
class OpRule:
    """Everything we know of one op: both directions read the same entry."""

    links: LinksRule | None = None
    forward: ForwardRule | None = None
    """None: DTensor's strategies decide forward."""
    backward: BackwardRule | None = None
    """None: DTensor's strategies answer backward."""
    moves_data_only: bool = False
    """The op only moves or casts data (views, transposes, copies): a partial sum passes
    through it unreduced."""


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued inputs, in order of first appearance."""
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def replicated_like(node: fx.Node):
    """REPLICATED for a tensor output, a tuple of them for several outputs, None for none."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return tuple(REPLICATED if isinstance(v, torch.Tensor) else None for v in value)
    return REPLICATED if isinstance(value, torch.Tensor) else None


def same_for_each_output(node: fx.Node, placement):
    """``placement`` for every tensor output (native_dropout: ``(out, mask)`` share the split)."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return tuple(placement if isinstance(v, torch.Tensor) else None for v in value)
    return placement
