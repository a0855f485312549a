"""Gradient reductions, derived from placements and dataflow.

A split tensor's gradient is split alike and a partial sum's gradient is replicated; neither
needs a reduction. A *replicated* tensor's gradient is the sum of what its readers send back,
and a reader sends back only a part of it (a partial sum) when the reader's output is split
or partial: a norm weight read by a sequence-split norm, learned positions cut to this
rank's rows, the input of a column-parallel linear. Such a reader is a *partial edge*.
The gradient arriving over any other edge is whole on every rank (*full*), provided the
reader's own gradient is full.

``gradient_plan`` walks the graph backwards and decides, for every replicated tensor that
needs a gradient:

* an activation with partial edges: an ``f`` (identity forward, all-reduce backward) feeding
  those readers, so its gradient is full before it flows further back (Megatron's f). A
  tensor gathered from a split one whose readers are all partial edges needs no f: the
  gather's backward is a reduce-scatter (Megatron's g); with any full reader it is a slice.
* a tensor computed from parameters only (``1 + w``, a cast, a transpose): its gradient may
  stay partial on the way back, since every op between it and the parameter is replicated
  and so linear in the gradient with equal coefficients on every rank; a parameter whose
  whole gradient is partial is summed in one bucketed all-reduce per layer. Where partial
  and full contributions meet, the partial edges get an f.

Nothing here depends on what the model is: only placements, who reads whom, and dtypes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from sptransform.graph.placement import PARTIAL, REPLICATED
from sptransform.graph.propagate import Propagation
from sptransform.graph.placement import DimShard
from sptransform.graph.nodes import packet
from sptransform.graph.rules.geometry import VIEWS, is_getitem, is_split

aten = torch.ops.aten


@dataclass
class GradientPlan:
    f_edges: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    """Replicated tensor -> the readers whose gradient contributions an f sums (one f per tensor)."""
    gathered_f_edges: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    """Split tensor gathered to replicated -> readers of the gathered copy needing an f."""
    gather_backward: dict[fx.Node, str] = field(default_factory=dict)
    """Split tensor gathered to replicated -> ``"reduce_scatter"`` (its readers send partial sums) or
    ``"slice"`` (full gradients)."""
    reduced_f_edges: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    """Partial sum all-reduced to replicated -> readers of the reduced copy needing an f."""
    partial_params: list[fx.Node] = field(default_factory=list)
    """Parameters whose gradient arrives partial on every rank: summed over the group."""


def _floating(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _split_or_partial(placement) -> bool:
    if isinstance(placement, tuple):
        return any(_split_or_partial(p) for p in placement if p is not None)
    return isinstance(placement, DimShard) or placement == PARTIAL


_MADE_FROM_METADATA = frozenset({aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.new_zeros,
                                 aten.new_ones, aten.new_empty, aten.new_full, aten.rand_like, aten.randn_like})

_GATHERS = frozenset({aten.index, aten.index_select})
_PICKS = frozenset({aten.select, aten.slice})
_REGATHERS = _GATHERS | _PICKS | {aten.unsqueeze, aten.squeeze} | VIEWS


def _regathers(node: fx.Node, through_gathers: bool = True) -> bool:
    """A chunk of a ``split``, rows gathered by indices (``x[idx]``, ``index_select``), a view, or
    a slice or ``select`` of its input: its gradient is laid into its input's gradient as it is (a
    linear map with the same coefficients on every rank). A slice's input may be far larger than
    the slice (the last position of a sequence): its f stays on the slice unless the picks of
    the input read, together, at least as many elements as it holds (``_unpicked``)."""
    if is_getitem(node):
        return is_split(node.args[0])
    if node.op != "call_function" or not through_gathers and packet(node) in _GATHERS:
        return False
    return packet(node) in _REGATHERS


def _numel(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.numel() if isinstance(value, torch.Tensor) else 0


def _unpicked(node: fx.Node, readers: list[fx.Node], plan: GradientPlan, state: dict, deferred: dict) -> None:
    """Slices of ``node`` that left their partial gradients for ``node`` to sum get their own f
    when together they read fewer elements than ``node`` holds: one f on ``node`` would move
    more bytes than theirs. A scan over time that picks every step (``into[:, i]``) keeps one
    f on the whole tensor instead of one per step."""
    picked = [u for u in readers if u in deferred and packet(u) in _PICKS]
    if picked and sum(_numel(u) for u in picked) < _numel(node):
        for u in picked:
            plan.f_edges[u] = deferred.pop(u)
            state[u] = "full"


def needs_gradient(gm: fx.GraphModule, sources: set[fx.Node]) -> set[fx.Node]:
    """Floating nodes computed from ``sources`` (parameters, floating user inputs)."""
    found = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and packet(node) in _MADE_FROM_METADATA:
            continue  # zeros_like(x): no gradient reaches x
        if node in sources or any(a in found for a in node.all_input_nodes):
            if _floating(node) or isinstance(node.meta.get("val"), (tuple, list)):
                found.add(node)
    return found


def gradient_plan(
    gm: fx.GraphModule, prop: Propagation, *, params: set[fx.Node], constant: set[fx.Node], inputs: set[fx.Node],
    through_gathers: bool = True,
) -> GradientPlan:
    """Where the gradient reductions go. ``params``: parameter placeholders; ``constant``: nodes
    computed from parameters and buffers only; ``inputs``: floating user-input placeholders.
    ``through_gathers``: partial gradients may be deferred back through row gathers (``x[idx]``);
    off under expert parallelism, whose dispatch region reads the f where the rows are gathered
    (deferred, it exchanged the experts' activations instead of the tokens: 8.5x the bytes)."""
    plan = GradientPlan()
    grad = needs_gradient(gm, params | inputs)
    state: dict[fx.Node, str] = {}  # replicated node -> "full" / "partial" (its gradient on arrival)
    deferred: dict[fx.Node, list[fx.Node]] = {}  # node left "partial" -> its partial readers (an f may go there)

    def edge(user: fx.Node, node: fx.Node) -> str:
        if user.op == "output":
            return "full"
        if prop.reads.get(user, {}).get(node, REPLICATED) != REPLICATED:
            return "partial"  # read through a cut to a split: its backward scatters a part
        if _split_or_partial(prop.placement.get(user)):
            return "partial"
        return state.get(user, "full")

    for node in reversed(list(gm.graph.nodes)):
        if node not in grad or node.op == "output":
            continue
        placement = prop.placement.get(node)
        if isinstance(placement, tuple):  # several outputs: gradient arrives through the getitems
            items = [u for u in node.users if u.target is operator.getitem]
            if not all(p in (REPLICATED, None) for p in placement):
                for item in items:  # no deferral past a split that is not replicated throughout
                    if state.get(item) == "partial" and item in deferred:
                        plan.f_edges[item] = deferred.pop(item)
                        state[item] = "full"
            else:
                kinds = {state.get(u, "full") for u in items}
                if kinds == {"partial"}:
                    state[node] = "partial"
                else:
                    # Partial and full parts meet (a fused [q|kv] weight split, q read by the
                    # sequence-split stream, kv by a whole memory): the partial parts are summed
                    # before they join the full ones.
                    for item in items:
                        if state.get(item) == "partial":
                            plan.f_edges[item] = deferred.pop(item)
                            state[item] = "full"
                    state[node] = "full"
            continue
        if placement != REPLICATED:
            continue
        readers = [u for u in node.users if prop.reads.get(u, {}).get(node, REPLICATED) is not None]
        _unpicked(node, readers, plan, state, deferred)
        kinds = {u: edge(u, node) for u in readers}
        partial = [u for u, k in kinds.items() if k == "partial"]
        if not partial:
            state[node] = "full"
        elif (node in constant or _regathers(node, through_gathers)) and len(partial) == len(kinds):
            # Stays partial back to the parameters (replicated ops are linear), or back through the
            # split it is a chunk of or the gather of rows it is: the partial gradients of every
            # expert's rows meet at the tensor they were taken from, where one f sums them all
            # instead of one per expert.
            state[node] = "partial"
            deferred[node] = partial
        else:
            plan.f_edges[node] = partial
            state[node] = "full"
        if node.op == "placeholder" and node in params and state[node] == "partial":
            plan.partial_params.append(node)
    _redistributed(gm, prop, plan, state, grad)
    return plan


def _redistributed(gm: fx.GraphModule, prop: Propagation, plan: GradientPlan, state: dict, grad: set) -> None:
    """Copies the rewrite makes: a split tensor gathered to replicated, a partial sum reduced to
    replicated. Their readers decide the gather's backward, and which readers need an f."""
    for node in gm.graph.nodes:
        if node not in grad:
            continue
        have = prop.placement.get(node)
        readers = [u for u in node.users if prop.reads.get(u, {}).get(node) == REPLICATED]
        if not readers or have == REPLICATED or not (isinstance(have, DimShard) or have == PARTIAL):
            continue
        kinds = {}
        for user in readers:
            if user.op == "output":
                kinds[user] = "full"
            elif _split_or_partial(prop.placement.get(user)):
                kinds[user] = "partial"
            else:
                kinds[user] = state.get(user, "full")
        partial = [u for u, k in kinds.items() if k == "partial"]
        if isinstance(have, DimShard):
            if partial and len(partial) == len(kinds):
                plan.gather_backward[node] = "reduce_scatter"
            else:
                plan.gather_backward[node] = "slice"
                if partial:
                    plan.gathered_f_edges[node] = partial
        elif partial:
            plan.reduced_f_edges[node] = partial
