"""Overlap: functional collectives issued as early, and waited on as late, as dataflow allows.

A traced functional collective is two nodes, the issue and the wait; between them the
communication runs in the background (gloo's worker threads, NCCL's stream). Traced graphs
wait right after issuing; this pass moves the two apart:

    before:  g = mm(a, b); c = cat([view(g), h]); r = all_reduce(c); w = wait_tensor(r)
             s = slice(w, 0, 0, 64); x = mm(p, q); y = relu(x); ...; output((.., view(s), y, ..))
    after:   g = mm(a, b); c = cat([view(g), h]); r = all_reduce(c)
             x = mm(p, q); y = relu(x); ...
             w = wait_tensor(r); s = slice(w, 0, 0, 64); output((.., view(s), y, ..))

* **Issue early.** Each collective, with its *prologue* (the pure ops whose every result feeds
  only it, such as a gradient bucket's views and ``cat``), moves up to just after the last
  of its inputs, but not above the wait of the collective before it: one collective more in
  flight, no more (a ZeRO-3 layer's parameters are gathered while the layer before it runs,
  not every layer's at the start of the graph).
* **Wait late.** Each wait moves down to just before its first reader; with it its *epilogue*
  (pure ops computed from waited results alone, such as a bucket's slices and views) moves
  to just before each op's own first reader, the graph's output for a gradient bucket. The
  rest of the backward runs while a bucket's all-reduce is in flight.

What the pass preserves, so that no rank can deadlock or compute other numbers:
* **Issue order.** No collective moves above another: every rank issues its collectives in the
  order it did (they run the same graph, but ranks of different pipeline stages do not).
* **Values.** No node moves across an op that mutates a tensor or has side effects (a
  *barrier*), nor across its own inputs or readers; random ops, point-to-point ops and
  mutating collectives never move. Only pure ops move, and moving a pure op changes no value.

Edits ``gm`` in place; reads each node's target (op overloads and their schemas) and nothing
of ``node.meta``; lints and recompiles only when something moved. ``find_collectives`` (the
match) is separate from ``schedule_collectives`` (the rewrite); ``overlap_report`` counts the
ops each collective now overlaps.

**Kept through inductor.** Inductor's scheduler orders a graph by its own estimates (peak
memory, locality) and put every wait right behind its collective again (HF GPT-2, tp=2: no
matmul between any all-reduce and its wait in the generated code). ``pin_windows`` makes the
window an ordering inductor keeps: each library kernel in it (``_KERNELS``: matmuls,
convolutions, fused attention) runs after the issue, the wait after all of them
(``window_order`` is the match, ``torch_internals.keep_order`` the rewrite):

    before:  r = all_reduce(dx); dw = mm(xT, dy); w = wait_tensor(r); y = mul(w, g)
    after:   r = all_reduce(dx); dw = control_deps((r,), mm_subgraph, xT, dy)
             w = control_deps((dw,), wait_subgraph, r); y = mul(w, g)

``schedule_for_inductor`` runs both on each graph inductor compiles for ``compile="inductor"``,
after inductor's own post-grad passes.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.fx as fx

from sptransform.logs import logger
from sptransform.torch_internals import OpOverload, keep_order, op_schema

log = logger(__name__)

_functional = torch.ops._c10d_functional
WAIT = _functional.wait_tensor.default
ISSUES = frozenset({
    _functional.all_reduce.default, _functional.all_reduce_coalesced.default,
    _functional.all_gather_into_tensor.default, _functional.all_gather_into_tensor_coalesced.default,
    _functional.reduce_scatter_tensor.default, _functional.reduce_scatter_tensor_coalesced.default,
    _functional.all_to_all_single.default, _functional.broadcast.default,
})
"""Collectives that may be issued earlier: the functional (out-of-place) ones every rank of a
group calls. Point-to-point ops (``isend``, ``irecv``, ``batch_p2p_ops``) pair ranks that run
different graphs, and the in-place variants mutate: neither moves."""


@dataclass
class CollectiveSite:
    """One traced collective: the node that issues it, what only it needs, and its waits."""

    issue: fx.Node
    prologue: list[fx.Node] = field(default_factory=list)
    """Pure ops, in graph order, whose every result is read only by the issue or by each other."""
    waits: list[fx.Node] = field(default_factory=list)
    """``wait_tensor`` nodes of its result (through ``getitem`` for the coalesced ones)."""
    epilogue: list[fx.Node] = field(default_factory=list)
    """Pure ops, in graph order, computed from the waits' results alone."""


def _mutates(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, OpOverload):
        return op_schema(target).is_mutable
    return node.op == "call_function" and node.is_impure()


def is_barrier(node: fx.Node) -> bool:
    """Whether nothing may move across ``node``: it mutates a tensor, has side effects, or is a
    call the pass cannot see into (a module or method call, a Python function that is not an
    ATen op, except ``getitem``)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return False
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return False
    if not isinstance(node.target, OpOverload):
        return True
    return _mutates(node)


def _movable(node: fx.Node) -> bool:
    """A pure, deterministic ATen op (or ``getitem``) that is no collective: moving it changes no value."""
    if node.op != "call_function" or is_barrier(node) or node.target in ISSUES or node.target is WAIT:
        return False
    target = node.target
    if isinstance(target, OpOverload):
        if target.namespace in ("_c10d_functional", "c10d", "_dtensor"):
            return False
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False
    return True


def _prologue(issue: fx.Node) -> list[fx.Node]:
    """The ops whose every result is read only by ``issue`` or by other such ops."""
    inside: set[fx.Node] = {issue}
    stack = list(issue.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in inside or not _movable(node):
            continue
        if all(user in inside for user in node.users):
            inside.add(node)
            stack.extend(node.all_input_nodes)
    inside.discard(issue)
    return [n for n in issue.graph.nodes if n in inside]


def _waits(issue: fx.Node) -> list[fx.Node]:
    out, stack = [], list(issue.users)
    while stack:
        node = stack.pop()
        if node.target is WAIT:
            out.append(node)
            stack.extend(node.users)  # a wait of a wait (traced twice) is waited too
        elif node.target is operator.getitem:
            stack.extend(node.users)
    return out


def _epilogue(waits: list[fx.Node]) -> list[fx.Node]:
    """Pure ops computed from the waited results alone (every input node a wait or another such
    op): a bucket's slices and views, a gather's reassembly; never work that also reads other
    tensors, which stays where the program put it."""
    inside = set(waits)
    frontier = [u for w in waits for u in w.users]
    while frontier:
        node = frontier.pop()
        if node in inside or not _movable(node):
            continue
        if all(i in inside for i in node.all_input_nodes):
            inside.add(node)
            frontier.extend(node.users)
    return [n for n in (waits[0].graph.nodes if waits else ()) if n in inside and n.target is not WAIT]


def find_collectives(gm: fx.GraphModule) -> list[CollectiveSite]:
    """Every movable collective of ``gm``, in graph order, with its prologue, waits and epilogue."""
    sites = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ISSUES:
            waits = _waits(node)
            sites.append(CollectiveSite(node, _prologue(node), waits, _epilogue(waits)))
    return sites


class _Order:
    """Node positions as exact fractions, kept in step with the graph's linked list, so a node
    moved between two others gets a position between theirs without renumbering."""

    def __init__(self, graph: fx.Graph):
        self.pos = {n: Fraction(i) for i, n in enumerate(graph.nodes)}
        self.end = Fraction(len(self.pos))

    def move_after(self, node: fx.Node, anchor: fx.Node) -> None:
        after = anchor.next
        upper = self.pos.get(after, self.end) if after.op != "root" else self.end
        self.pos[node] = (self.pos[anchor] + upper) / 2
        anchor.append(node)

    def move_before(self, node: fx.Node, anchor: fx.Node) -> None:
        before = anchor.prev
        lower = self.pos[before] if before.op != "root" else Fraction(-1)
        self.pos[node] = (lower + self.pos[anchor]) / 2
        anchor.prepend(node)


def schedule_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Issue each collective early and wait on it late (see the module docstring)."""
    sites = find_collectives(gm)
    if not sites:
        return gm
    graph = gm.graph
    before = overlap_report(gm) if log.isEnabledFor(logging.DEBUG) else None
    order = _Order(graph)
    barriers = [n for n in graph.nodes if is_barrier(n)]
    moved = 0

    def last_barrier_before(node: fx.Node) -> fx.Node | None:
        here = order.pos[node]
        earlier = [b for b in barriers if order.pos[b] < here]
        return max(earlier, key=order.pos.__getitem__) if earlier else None

    def hoist(node: fx.Node, floor: fx.Node | None) -> None:
        nonlocal moved
        anchors = [*node.all_input_nodes, last_barrier_before(node), floor]
        anchors = [a for a in anchors if a is not None]
        if not anchors:  # reads no node: first in the graph, after the placeholders
            anchors = [n for n in graph.nodes if n.op == "placeholder"][-1:]
        if not anchors:
            return
        anchor = max(anchors, key=order.pos.__getitem__)
        if anchor.next is not node and order.pos[anchor] < order.pos[node]:
            order.move_after(node, anchor)
            moved += 1

    floor = None
    for site in sites:  # graph order: each collective stays after the one before and its wait
        for node in site.prologue:
            hoist(node, None)
        hoist(site.issue, floor)
        floor = max([site.issue, *site.waits], key=order.pos.__getitem__)

    late = [n for site in sites for n in (*site.waits, *site.epilogue)]
    for node in sorted(set(late), key=order.pos.__getitem__, reverse=True):  # readers first
        readers = [u for u in node.users]
        later = [b for b in barriers if order.pos[b] > order.pos[node]]
        stops = readers + ([min(later, key=order.pos.__getitem__)] if later else [])
        if not stops:
            continue
        stop = min(stops, key=order.pos.__getitem__)
        if stop.prev is not node:
            order.move_before(node, stop)
            moved += 1

    if moved:
        graph.lint()
        gm.recompile()
    if before is not None:
        after = overlap_report(gm)
        log.debug("schedule_collectives: %d collectives, %d nodes moved; overlapped %d -> %d, ops between "
                  "issue and wait %d -> %d", len(sites), moved, before.overlapped, after.overlapped,
                  before.ops_between, after.ops_between, extra={"overlap": (before, after)})
    return gm


@dataclass(frozen=True)
class OverlapReport:
    collectives: int
    """Movable collectives in the graph."""
    overlapped: int
    """Of those, how many have at least one compute op between issue and (first) wait."""
    ops_between: int
    """Compute ops between issue and first wait, summed over the collectives."""


def overlap_report(gm: fx.GraphModule) -> OverlapReport:
    """How much work each collective of ``gm`` can hide behind: the ATen ops (not views, waits
    or collectives) that run between its issue and its first wait."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = list(gm.graph.nodes)
    sites = find_collectives(gm)
    overlapped = between = 0
    for site in sites:
        if not site.waits:
            continue
        first_wait = min(position[w] for w in site.waits)
        work = sum(1 for n in nodes[position[site.issue] + 1: first_wait] if _is_compute(n))
        overlapped += work > 0
        between += work
    return OverlapReport(len(sites), overlapped, between)


def _is_compute(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, OpOverload) or target.namespace == "_c10d_functional":
        return False
    return not target.is_view


_KERNELS = frozenset({
    torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten._grouped_mm,
    torch.ops.aten.convolution, torch.ops.aten.convolution_backward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
    torch.ops.aten._scaled_dot_product_flash_attention, torch.ops.aten._scaled_dot_product_flash_attention_backward,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward,
    torch.ops.aten._scaled_dot_product_cudnn_attention, torch.ops.aten._scaled_dot_product_cudnn_attention_backward,
})
"""Ops inductor runs as library kernels of their own, not fused with their neighbours: the work a
window holds, and ordering them costs no fusion."""


def _is_kernel(node: fx.Node) -> bool:
    return isinstance(node.target, OpOverload) and node.target.overloadpacket in _KERNELS


def window_order(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """The ordering that keeps each collective's window as the graph has it: every library kernel
    between an issue and its first wait after the issue, the wait after all of them. A dict in
    graph order, node -> the nodes it must follow; every pair already in graph order, so no cycle."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    after: dict[fx.Node, list[fx.Node]] = {}
    for site in find_collectives(gm):
        if not site.waits:
            continue
        first = min(site.waits, key=position.__getitem__)
        kernels = [n for n in nodes[position[site.issue] + 1: position[first]] if _is_kernel(n)]
        for kernel in kernels:
            after.setdefault(kernel, []).append(site.issue)
        if kernels:
            after.setdefault(first, []).extend(kernels)
    return {n: after[n] for n in nodes if n in after}


def pin_windows(gm: fx.GraphModule) -> fx.GraphModule:
    """Keep the windows ``window_order`` reads through inductor's scheduler (module docstring)."""
    order = window_order(gm)
    if order:
        keep_order(gm.graph, order)
        gm.graph.lint()
        gm.recompile()
    return gm


OVERLAP_FOR_INDUCTOR_KEY = "sptransform overlap: schedule_collectives, pin_windows v1"


def schedule_for_inductor(graph: fx.Graph) -> None:
    """Inductor's post-grad pass of ``compile="inductor"``: ``schedule_collectives`` on the graph
    as inductor's decompositions left it, then ``pin_windows``."""
    gm = graph.owning_module
    schedule_collectives(gm)
    pin_windows(gm)
