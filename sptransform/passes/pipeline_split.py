"""Pipeline split: cut one forward graph into stages at transformer-layer boundaries.

    before:  x1 = add(x0, mlp0(ln(x0)));  x2 = add(x1, mlp1(ln(x1)));  loss = ce(head(ln_f(x2)), y)
    after:   stage 0 (ids)        -> x1 = add(x0, mlp0(ln(x0)))
             stage 1 (x1; ids, y) -> loss = ce(head(ln_f(add(x1, mlp1(ln(x1))))), y)

Three steps, each usable on its own:

* ``find_layer_boundaries`` finds, for every layer l >= 1, the position in graph
  order between layer l-1's last residual add and layer l's first node (layers are
  repeated residual blocks, ``graph.blocks``: found from dataflow, whether or not the
  tensor-parallel analysis recognises their attention) where the fewest bytes of
  activations cross; in a pre-norm transformer that is just after the residual add,
  and one tensor (the residual stream) crosses. ``find_stage_cuts`` adds, for a graph
  with no residual block, cuts at the cheap crossing points that balance the stages
  (``find_balanced_cuts``).
* ``balance_layers`` groups consecutive layers into stages so that the slowest
  stage is as fast as possible; among such groupings it keeps the one with the
  smallest peak of saved activations (a stage's bytes times the microbatches the
  schedule keeps in flight there).
* ``split_graph`` copies the graph into one ``GraphModule`` per stage. A stage
  receives the tensors that cross its first cut and returns those that cross its
  last (the last stage returns the loss). Nodes computed from user inputs,
  buffers, constants and the rank only, with no random draw (position ids, masks,
  rotary tables, shifted labels: *replicable* nodes), are computed again by each
  stage that needs them rather than sent. Only what the loss depends on is kept.

Reads ``node.meta["val"]`` (bytes of crossing tensors); never node names or module
paths. The input graph is not modified.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx

from sptransform.graph.findings import ModelAnalysis
from sptransform.graph.blocks import ResidualBlock, describe_layers, find_residual_blocks, group_layers
from sptransform.graph.cost import node_cost
from sptransform.capture import CapturedGraph
from sptransform.runtime.ops import reference_dropout, reference_native_dropout
from sptransform.runtime.rng import GeneratorOp

from sptransform.torch_internals import OpOverload

aten = torch.ops.aten

_RANDOM_PACKETS = {aten.dropout, aten.native_dropout, aten.feature_dropout, aten.alpha_dropout, aten.bernoulli,
                   aten.rand, aten.rand_like, aten.randn, aten.randn_like, aten.randint, aten.randperm}


@dataclass(frozen=True)
class LayerBoundary:
    """Where ``layer`` begins: nodes before ``position`` (graph order) run before it."""

    layer: int
    position: int
    crossing: tuple[fx.Node, ...]
    """Tensors computed before the cut and read after it (replicable nodes excluded)."""
    nbytes: int


@dataclass
class StageGraph:
    """One stage's graph and what it needs."""

    index: int
    gm: fx.GraphModule
    """Placeholders: received activations, then state (by FQN), user inputs, extra inputs (the rank)."""
    layers: range
    received: list[str] = field(default_factory=list)
    """Names (in the full graph) of the activations it receives, in placeholder order."""
    sent: list[str] = field(default_factory=list)
    """Names of the activations it returns (empty for the last stage, which returns the loss)."""
    state_names: list[str] = field(default_factory=list)
    user_inputs: list[int] = field(default_factory=list)
    """Indices into the flattened user inputs."""
    extra_inputs: list[int] = field(default_factory=list)
    """Indices into the placeholders after the user inputs (the rank)."""
    sent_bytes: int = 0


class GraphFlow:
    """The forward graph as the split sees it: placeholder kinds, what the loss needs,
    which nodes are replicable, and where each node sits in graph order."""

    def __init__(self, captured: CapturedGraph, output: fx.Node):
        self.captured = captured
        self.nodes = [n for n in captured.gm.graph.nodes if n.op != "output"]
        self.position = {n: i for i, n in enumerate(self.nodes)}
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        num_state, num_user = len(captured.state_names), captured.num_user_inputs
        self.state = dict(zip(placeholders[:num_state], captured.state_names))
        self.user = {n: i for i, n in enumerate(placeholders[num_state : num_state + num_user])}
        self.extra = {n: i for i, n in enumerate(placeholders[num_state + num_user :])}
        self.params = {n for n, name in self.state.items() if name in captured.param_names}
        self.output = output
        self.needed = _ancestors(output) | {output}
        self.replicable = self._replicable()
        self.anchor = {n: self._anchor(n) for n in self.nodes}
        self.last_use = self._last_uses()

    def _replicable(self) -> set[fx.Node]:
        """Nodes computed from user inputs (and buffers, constants, the rank) only, or from
        parameters (and buffers, constants, the rank) only, with no random draw."""
        sources: dict[fx.Node, frozenset[str]] = {}
        free: set[fx.Node] = set()
        for n in self.nodes:
            if n.op == "placeholder":
                sources[n] = frozenset({"param"} if n in self.params else {"input"} if n in self.user else ())
                continue
            inputs = n.all_input_nodes
            sources[n] = frozenset().union(*(sources[a] for a in inputs)) if inputs else frozenset()
            if n.op == "get_attr" or (
                n.op == "call_function" and not _is_random(n) and len(sources[n]) < 2
                and all(a in free or a.op == "placeholder" for a in inputs)
            ):
                free.add(n)
        return free

    def _anchor(self, n: fx.Node) -> int:
        """A getitem sits with its (non-replicable) producer: tuples never cross a cut."""
        while n.op == "call_function" and n.target is operator.getitem and n.args[0] not in self.replicable:
            n = n.args[0]
        return self.position[n]

    def computed(self, n: fx.Node) -> bool:
        """Computed by exactly one stage (not a placeholder, not replicable) and needed by the loss."""
        return n.op == "call_function" and n not in self.replicable and n in self.needed

    def _last_uses(self) -> dict[fx.Node, int]:
        last = {}
        for n in self.nodes:
            if not self.computed(n):
                continue
            uses = [self.anchor[u] for u in n.users if u in self.needed and u.op != "output"]
            last[n] = max(uses, default=self.anchor[n])
        return last

    def crossing(self, position: int) -> list[fx.Node]:
        """Tensors computed before ``position`` and read at or after it."""
        return [n for n, last in self.last_use.items() if self.anchor[n] < position <= last]

    def crossing_costs(self) -> list[tuple[int, int]]:
        """(bytes, count) of the crossing tensors at every position, by one sweep."""
        size = len(self.nodes) + 2
        nbytes, count = [0] * size, [0] * size
        for n, last in self.last_use.items():
            start = self.anchor[n] + 1
            if start <= last:
                b = _nbytes(n)
                nbytes[start] += b
                nbytes[last + 1] -= b
                count[start] += 1
                count[last + 1] -= 1
        out, b, c = [], 0, 0
        for i in range(len(self.nodes) + 1):
            b, c = b + nbytes[i], c + count[i]
            out.append((b, c))
        return out

    def layer_of(self, n: fx.Node, boundaries: Sequence[LayerBoundary]) -> int:
        return bisect.bisect_right([b.position for b in boundaries], self.anchor[n])


# ---------------------------------------------------------------------------
# find


def find_layer_boundaries(flow: GraphFlow, analysis: ModelAnalysis | None = None) -> list[LayerBoundary]:
    """For each layer l >= 1 of the repeated residual blocks (``graph.blocks``), the cut between
    layers l-1 and l that the fewest bytes cross (then the fewest tensors; then the earliest).
    Attention regions of ``analysis`` count as attention where no attention core is recognised."""
    return _layer_cuts(flow, group_layers(_residual_blocks(flow, analysis)))


@dataclass(frozen=True)
class StageCuts:
    """Where a pipeline may be cut, and what was found to cut at."""

    boundaries: list[LayerBoundary]
    num_layers: int
    found: str
    """In words: the residual blocks and layers found, or the cheap cut points."""


def find_stage_cuts(flow: GraphFlow, analysis: ModelAnalysis | None, num_stages: int) -> StageCuts:
    """The layers of ``find_layer_boundaries``; in a graph with no residual block, ``num_stages``
    stages cut at cheap crossing points balanced by ``find_balanced_cuts`` (fewer layers than
    stages when the graph has fewer such points)."""
    blocks = _residual_blocks(flow, analysis)
    if blocks:
        layers = group_layers(blocks)
        return StageCuts(_layer_cuts(flow, layers), len(layers), describe_layers(blocks, layers))
    boundaries = find_balanced_cuts(flow, num_stages)
    return StageCuts(boundaries, len(boundaries) + 1,
                     f"no residual block; {len(boundaries)} cut(s) at cheap crossing points balancing the stages")


def _residual_blocks(flow: GraphFlow, analysis: ModelAnalysis | None) -> list[ResidualBlock]:
    attention = [] if analysis is None else [
        n for r in analysis.regions if r.kind == "attention" for n in (*(lm.node for lm in r.rows), *r.columns)]
    nodes = [n for n in flow.nodes if n.op == "placeholder" or n in flow.needed]
    return find_residual_blocks(nodes, flow.state, attention=attention)


def _layer_cuts(flow: GraphFlow, layers: list[list[ResidualBlock]]) -> list[LayerBoundary]:
    """Between layer l-1's last residual add and layer l's first computed node, the cheapest cut."""
    costs = flow.crossing_costs()
    boundaries = []
    for layer in range(1, len(layers)):
        lo = flow.anchor[layers[layer - 1][-1].residual] + 1
        hi = min(flow.anchor[n] for n in layers[layer][0].body if flow.computed(n))
        if lo > hi:
            raise ValueError(
                f"layers {layer - 1} and {layer} interleave in the graph (layer {layer} starts at node "
                f"{flow.nodes[hi].name} before layer {layer - 1} ends): the pipeline split needs layers "
                "that run one after the other"
            )
        position = min(range(lo, hi + 1), key=lambda p: (costs[p], p))
        boundaries.append(_boundary(flow, layer, position))
    return boundaries


def _boundary(flow: GraphFlow, layer: int, position: int) -> LayerBoundary:
    crossing = tuple(flow.crossing(position))
    return LayerBoundary(layer, position, crossing, sum(_nbytes(n) for n in crossing))


CUT_FLOPS_PER_BYTE = 989.4e12 / 50e9
"""What sending one byte between stages costs, in FLOPs: an H100's peak over its inter-node
bandwidth (``planner/cluster.py``), the link a pipeline crosses."""

MAX_CUT_CANDIDATES = 256


def find_balanced_cuts(flow: GraphFlow, num_stages: int) -> list[LayerBoundary]:
    """Up to ``num_stages - 1`` cuts (fewer where the graph has fewer cut points) minimising the
    slowest stage, a stage costing 3 x the forward FLOPs of its nodes (``graph.cost.node_cost``)
    plus the bytes it sends, twice (activations forward, their gradients backward), x
    ``CUT_FLOPS_PER_BYTE``; among equals, the fewest bytes sent. Candidates: ``_cut_candidates``."""
    costs = flow.crossing_costs()
    candidates = _cut_candidates(flow, costs)
    work = [0] * len(flow.nodes)
    for n in flow.nodes:
        if flow.computed(n):
            cost = node_cost(n)
            work[flow.anchor[n]] += 3 * (cost.matmul_flops + cost.elementwise)
    points = [0, *candidates, len(flow.nodes)]
    send = [0.0, *(2 * costs[p][0] * CUT_FLOPS_PER_BYTE for p in candidates), 0.0]
    chosen = _min_max_partition(_prefix(work), points, send, min(num_stages - 1, len(candidates)))
    return [_boundary(flow, layer, p) for layer, p in enumerate(chosen, start=1)]


def _cut_candidates(flow: GraphFlow, costs: list[tuple[int, int]]) -> list[int]:
    """Positions right after a computed node, with a computed node after them, that tensors
    cross and where crossing bytes are a local minimum; the cheapest ``MAX_CUT_CANDIDATES``."""
    anchored = sorted({flow.anchor[n] for n in flow.nodes if flow.computed(n)})
    if len(anchored) < 2:
        return []
    after_a_node = {p + 1 for p in anchored}
    found = [
        p for p in range(anchored[0] + 1, anchored[-1] + 1)
        if costs[p][1] and p in after_a_node and costs[p][0] <= min(costs[p - 1][0], costs[p + 1][0])
    ]
    return sorted(sorted(found, key=lambda p: (costs[p][0], p))[:MAX_CUT_CANDIDATES])


def _min_max_partition(work: list[float], points: list[int], send: list[float], cuts: int) -> list[int]:
    """``cuts`` of ``points[1:-1]`` whose slowest stage is fastest, a stage from points[i] to
    points[j] costing ``work[points[j]] - work[points[i]] + send[j]``; among those, the one
    sending least in total. Two dynamic programs over (stage, end point), as ``balance_layers``:
    O(cuts x points^2)."""
    end = len(points) - 1

    def stage(i: int, j: int) -> float:
        return work[points[j]] - work[points[i]] + send[j]

    def solve(combine, admissible) -> tuple[list[list[float]], list[list[int]]]:
        best = [[float("inf")] * len(points) for _ in range(cuts + 2)]
        choice = [[-1] * len(points) for _ in range(cuts + 2)]
        best[0][0] = 0.0
        for s in range(1, cuts + 2):
            for j in ([end] if s == cuts + 1 else range(1, end)):
                for i in range(j):
                    if best[s - 1][i] == float("inf") or not admissible(i, j):
                        continue
                    candidate = combine(best[s - 1][i], i, j)
                    if candidate < best[s][j]:
                        best[s][j], choice[s][j] = candidate, i
        return best, choice

    slowest, _ = solve(lambda before, i, j: max(before, stage(i, j)), lambda i, j: True)
    limit = slowest[cuts + 1][end]
    _, choice = solve(lambda before, i, j: before + send[j], lambda i, j: stage(i, j) <= limit)
    chosen, j = [], end
    for s in range(cuts + 1, 1, -1):
        j = choice[s][j]
        chosen.append(points[j])
    return chosen[::-1]


# ---------------------------------------------------------------------------
# balance


def balance_layers(
    times: Sequence[float],
    num_stages: int,
    *,
    activation_bytes: Sequence[float] | None = None,
    inflight: Sequence[int] | None = None,
) -> list[int]:
    """First layer of each stage: consecutive layers grouped so that the slowest stage
    (sum of ``times``) is as fast as possible; among those groupings, the one whose
    largest ``stage activation bytes x inflight[stage]`` is smallest.

    Dynamic programming over (stage, last layer): O(stages x layers^2)."""
    layers = len(times)
    if num_stages > layers:
        raise ValueError(f"{num_stages} stages need at least {num_stages} layers; the model has {layers}")
    memory = list(activation_bytes) if activation_bytes is not None else [0] * layers
    inflight = list(inflight) if inflight is not None else [1] * num_stages
    time_prefix, memory_prefix = _prefix(times), _prefix(memory)
    inf = float("inf")

    def span(prefix, i, j):
        return prefix[j] - prefix[i]

    slowest = [[inf] * (layers + 1) for _ in range(num_stages + 1)]
    slowest[0][0] = 0
    for s in range(1, num_stages + 1):
        for j in range(s, layers + 1):
            slowest[s][j] = min(max(slowest[s - 1][i], span(time_prefix, i, j)) for i in range(s - 1, j))
    limit = slowest[num_stages][layers]

    peak = [[inf] * (layers + 1) for _ in range(num_stages + 1)]
    choice = [[-1] * (layers + 1) for _ in range(num_stages + 1)]
    peak[0][0] = 0
    for s in range(1, num_stages + 1):
        for j in range(s, layers + 1):
            for i in range(s - 1, j):
                if peak[s - 1][i] == inf or span(time_prefix, i, j) > limit:
                    continue
                candidate = max(peak[s - 1][i], span(memory_prefix, i, j) * inflight[s - 1])
                if candidate < peak[s][j]:
                    peak[s][j], choice[s][j] = candidate, i
    starts, j = [], layers
    for s in range(num_stages, 0, -1):
        j = choice[s][j]
        starts.append(j)
    return starts[::-1]


def stage_costs(values: Sequence[float], starts: Sequence[int]) -> list[float]:
    """Sum of ``values`` over each stage's layers."""
    ends = list(starts[1:]) + [len(values)]
    return [sum(values[a:b]) for a, b in zip(starts, ends)]


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


# ---------------------------------------------------------------------------
# split


def split_graph(flow: GraphFlow, boundaries: Sequence[LayerBoundary], num_layers: int) -> list[StageGraph]:
    """One ``StageGraph`` per stage; stage k runs layers [boundaries[k-1].layer, boundaries[k].layer)."""
    cuts = [b.position for b in boundaries]
    starts = [0] + [b.layer for b in boundaries]
    ends = starts[1:] + [num_layers]
    live = [[]] + [flow.crossing(c) for c in cuts] + [[]]
    stages = []
    for k in range(len(cuts) + 1):
        own = [n for n in flow.nodes if flow.computed(n) and bisect.bisect_right(cuts, flow.anchor[n]) == k]
        stages.append(_stage_graph(flow, k, own, live[k], live[k + 1], range(starts[k], ends[k]), last=k == len(cuts)))
    return stages


def _stage_graph(flow: GraphFlow, index: int, own: list[fx.Node], received: list[fx.Node], sent: list[fx.Node],
                 layers: range, *, last: bool) -> StageGraph:
    own_set = set(own)
    replicated = _replicable_closure(flow, own)
    inputs = {a for n in own_set | replicated for a in n.all_input_nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def placeholder(n: fx.Node) -> None:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)

    for n in received:
        placeholder(n)
    state = [n for n in flow.state if n in inputs]
    user = [n for n in flow.user if n in inputs]
    extra = [n for n in flow.extra if n in inputs]
    for n in state + user + extra:
        placeholder(n)
    for n in flow.nodes:
        if n in own_set or n in replicated:
            env[n] = graph.node_copy(n, env.__getitem__)
    if last:
        graph.output(env[flow.output])
    else:
        outs = []
        for n in sent:
            value = env[n]
            if n in received:  # passes through: a fresh tensor, so each stage owns what it sends
                value = graph.call_function(aten.clone.default, (value,))
                value.meta = dict(n.meta)
            outs.append(value)
        graph.output(tuple(outs))
    graph.lint()
    gm = fx.GraphModule(flow.captured.gm, graph)
    return StageGraph(
        index=index, gm=gm, layers=layers,
        received=[n.name for n in received], sent=[n.name for n in sent],
        state_names=[flow.state[n] for n in state], user_inputs=[flow.user[n] for n in user],
        extra_inputs=[flow.extra[n] for n in extra], sent_bytes=sum(_nbytes(n) for n in sent),
    )


def _replicable_closure(flow: GraphFlow, own: list[fx.Node]) -> set[fx.Node]:
    """Replicable call/get_attr nodes that ``own`` reads, directly or through others."""
    found: set[fx.Node] = set()
    stack = [a for n in own for a in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n in found or n not in flow.replicable or n.op == "placeholder":
            continue
        found.add(n)
        stack.extend(n.all_input_nodes)
    return found


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _is_random(node: fx.Node) -> bool:
    target = node.target
    if target in (reference_dropout, reference_native_dropout) or isinstance(target, GeneratorOp):
        return True  # the dropout pass's ops (``GeneratorOp``: drawing from the module's generators)
    if isinstance(target, OpOverload):
        return target.overloadpacket in _RANDOM_PACKETS or torch.Tag.nondeterministic_seeded in target.tags
    return False


def _nbytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0
