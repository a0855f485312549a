"""The *find* half of the rematerialisation pass: which forward values to save.

``analyze_joint`` classifies a joint forward+backward graph once (forward nodes, what the
backward needs, bytes each value keeps alive, the cost of recomputing it, layer regions);
``policy_constraints`` turns a policy into must-recompute / may-not-recompute sets; ``MinCut``
solves the s-t min cut those constraints leave; ``plan_remat`` picks the cut for a policy
(for a budget: the cheapest candidate under it, filled greedily). Nothing here edits a graph;
``passes.remat.apply_plan`` is the rewrite. See ``passes.remat`` for the method.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Sequence

import networkx as nx
import torch
import torch.fx as fx
from networkx.algorithms.flow import boykov_kolmogorov

from sptransform.logs import logger
from sptransform.options import REMAT_POLICIES as POLICIES  # noqa: F401  (re-exported)
from sptransform.options import RematOptions, RematPolicy  # noqa: F401  (re-exported)
from sptransform.graph.cost import Cost, node_cost
from sptransform.graph.regions import GraphRegions, classify_regions
from sptransform.torch_internals import OpOverload, partitioners as torch_partitioners
from sptransform.graph.nodes import (
    ALL_GATHERS,
    is_tangent,
    packet,
    is_collective,
    is_multi_output,
    is_random,
    is_view,
    storage_nbytes,
    storage_root,
    val,
)

log = logger(__name__)
aten = torch.ops.aten

_MAX_HULL_SOLVES = 400
_MAX_FILL_STEPS = 64


# ---------------------------------------------------------------------------
# find


@dataclass
class JointAnalysis:
    """What the partitioner needs to know about a joint graph, computed once."""

    joint: fx.GraphModule
    num_fwd_outputs: int
    forward: list[fx.Node]
    """Forward-side nodes: everything that does not depend on a tangent."""
    needed_by_backward: set[fx.Node]
    required_fw: set[fx.Node]
    """Nodes the forward outputs depend on (recomputing one of them is extra work)."""
    regions: GraphRegions
    save_bytes: dict[fx.Node, int]
    cost: dict[fx.Node, Cost]
    free: set[fx.Node]
    """Recomputed at no cost: views, constants, and values only the backward reads."""
    unsaveable: set[fx.Node]
    fusible: set[fx.Node] = field(default_factory=set)
    """Memory-bound ops (``is_fusible``) that cost no matmul, collective or random draw to run again."""

    def weighted_cost(self, node: fx.Node, options: RematOptions) -> float:
        c = self.cost[node]
        return float(c.matmul_flops + c.elementwise + options.flops_per_comm_byte * c.comm_bytes)


def analyze_joint(
    joint: fx.GraphModule, *, num_fwd_outputs: int, state_indices: Sequence[int]
) -> JointAnalysis:
    """Classify the joint graph's nodes. ``state_indices``: which primals are parameters or buffers."""
    info = torch_partitioners.classify_nodes(joint, list(state_indices), num_fwd_outputs)
    backward = set(info.tangents_closure)
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and not is_tangent(n)]
    state = {p for i, p in enumerate(primals) if i in set(state_indices)}
    forward = [n for n in joint.graph.nodes if n.op != "output" and n not in backward and not is_tangent(n)]
    outputs = next(iter(joint.graph.find_nodes(op="output"))).args[0]
    bwd_outputs = {o for o in outputs[num_fwd_outputs:] if isinstance(o, fx.Node)}
    forward_set = set(forward)
    needed = {n for n in forward if any(u in backward and u.op != "output" for u in n.users) or n in bwd_outputs}
    regions = classify_regions(joint.graph, state=state, outputs=outputs[:num_fwd_outputs], ignore=backward)
    required_fw = {n for n in info.required_fw_nodes if n in forward_set}
    save_bytes, cost, free, unsaveable, fusible = {}, {}, set(), set(), set()
    for n in forward:
        cost[n] = node_cost(n)
        if n.op == "placeholder":
            save_bytes[n] = 0 if n in state else storage_nbytes(n)
            continue
        if is_multi_output(n) or not isinstance(val(n), (torch.Tensor, torch.SymInt, int, float)):
            unsaveable.add(n)
            save_bytes[n] = 0
        else:
            root = storage_root(n)
            save_bytes[n] = 0 if root in state or isinstance(val(n), (torch.SymInt, int, float)) else storage_nbytes(n)
        expensive = cost[n].matmul_flops or cost[n].comm_bytes or is_random(n)
        # Free to recompute: views; what the forward outputs do not need; constants; and a
        # dropout's scaling of its own mask (what native_dropout_backward does in-kernel).
        cheap = (n in regions.constant or n in regions.random_sourced) and not expensive
        if is_view(n) or n not in required_fw or cheap:
            free.add(n)
        elif not expensive and is_fusible(n):
            fusible.add(n)
    return JointAnalysis(
        joint=joint,
        num_fwd_outputs=num_fwd_outputs,
        forward=forward,
        needed_by_backward=needed,
        required_fw=required_fw,
        regions=regions,
        save_bytes=save_bytes,
        cost=cost,
        free=free,
        unsaveable=unsaveable,
        fusible=fusible,
    )


# Ops that are one pass over memory: inductor fuses them into the kernels that read their
# inputs, so running them again in the backward costs no extra pass over their output. Besides
# ATen's pointwise-tagged ops: the composite ops inductor decomposes into a reduction plus
# pointwise ops (torch's default partitioner recomputes their pointwise part from saved
# statistics; recomputing the whole op keeps no more bytes than that), casts and copies, and
# the gathers an embedding lowers to. Not a bare reduction (``sum``, ``mean``, ``amax``,
# ``var_mean``): its output is a statistic far smaller than its input, so saving it costs
# little, and running it again in the backward is a second pass over the input that the
# backward would not otherwise read (torch's partitioner bans recomputing reductions too,
# ``ban_recompute_reductions``). Measured on an H200 (``benchmarks/one_gpu.py``): a loss's
# log-softmax recomputed with its reductions took the backward's loss kernel from 0.32 to 0.66 ms.
_MEMORY_BOUND = frozenset({
    aten.native_layer_norm, aten._softmax, aten._safe_softmax, aten._log_softmax, aten._to_copy, aten.clone, aten.embedding,
    aten.cat, aten.index, aten.gather,
})


def is_fusible(node: fx.Node) -> bool:
    """A deterministic memory-bound op (pointwise, a norm, a softmax, a cast, a copy) or an item
    of one; views, matmuls, collectives and random ops are not."""
    if node.op != "call_function" or is_random(node) or is_collective(node) or node.is_impure():
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and is_fusible(node.args[0])
    target = node.target
    return isinstance(target, OpOverload) and (
        torch.Tag.pointwise in target.tags or target.overloadpacket in _MEMORY_BOUND)


@dataclass
class Constraints:
    """A policy, as constraints on the cut."""

    must_recompute: set[fx.Node] = field(default_factory=set)
    """May not be saved."""
    banned: set[fx.Node] = field(default_factory=set)
    """May not be recomputed."""
    notes: list[str] = field(default_factory=list)


def policy_constraints(analysis: JointAnalysis, options: RematOptions) -> Constraints:
    """Translate ``options`` into must-recompute and banned node sets."""
    regions = analysis.regions
    out = Constraints()
    for n in analysis.forward:
        if n.op == "placeholder":
            out.banned.add(n)
        elif is_random(n) and not (options.replay_rng and replayable(n)):
            out.banned.add(n)
        elif is_collective(n) and not options.recompute_collectives and n not in analysis.free:
            out.banned.add(n)
        elif n.op == "call_function" and n.is_impure(impure_random=False) and not is_collective(n):
            out.banned.add(n)
    if options.regather_sequence_shards:
        out.must_recompute |= _sequence_gathers(analysis)
        out.banned -= out.must_recompute
    policy = options.policy
    if policy == "budget":
        return out
    wanted: set[fx.Node] = set()
    if policy == "selective":
        wanted = _selective_nodes(analysis, out.notes)
    elif policy == "full":
        wanted = {n for sub in regions.sublayers for n in sub.body} - set(regions.boundaries)
        out.banned |= set(regions.boundaries) & set(analysis.forward)
    elif policy == "norm_upproj":
        wanted = {n for n in regions.norms if regions.layer.get(n) is not None} | regions.up_projections
    elif policy == "blocks":
        chosen = [sub for sub in regions.sublayers if ("attention" if sub.core is not None else "mlp") in options.blocks]
        inputs = {sub.skip for sub in chosen}
        wanted = {n for sub in chosen for n in sub.body} - inputs - set(regions.boundaries)
        out.banned |= inputs & set(analysis.forward)
    wanted |= {u for n in wanted for u in n.users if u.target is operator.getitem}
    kept = {n for n in wanted if n in out.banned and n.op != "placeholder"}
    if kept:
        out.notes.append(_describe_kept(kept))
    wanted -= out.banned
    wanted -= {u for n in kept for u in n.users if u.target is operator.getitem}  # a kept op's outputs are saved
    out.must_recompute |= wanted
    # saving a view would keep the storage alive all the same
    out.must_recompute |= {n for n in analysis.forward if is_view(n) and storage_root(n) in out.must_recompute}
    # "Nothing with a cost" means no matmul, collective or random draw: with recompute_fusible
    # the memory-bound ops stay free to recompute where that keeps fewer bytes (what torch's
    # default partitioner does), so no policy keeps more than torch.compile would
    allowed = analysis.free | (analysis.fusible if options.recompute_fusible else set())
    out.banned |= {n for n in analysis.forward if n not in out.must_recompute and n not in allowed}
    out.banned -= out.must_recompute
    return out


def replayable(node: fx.Node) -> bool:
    """A random op whose draws a saved generator state reproduces exactly: one on the
    default generator, or one whose ``generator=`` is a constant of the graph."""
    if not is_random(node):
        return False
    generator = node.kwargs.get("generator")
    return generator is None or (isinstance(generator, fx.Node) and generator.op == "get_attr")


def _own_generator(node: fx.Node) -> bool:
    return node.kwargs.get("generator") is not None


def _selective_nodes(analysis: JointAnalysis, notes: list[str]) -> set[fx.Node]:
    cores = analysis.regions.cores
    explicit = [c for c in cores if not c.fused]
    fused = len(cores) - len(explicit)
    if fused:
        notes.append(
            f"selective: {fused} attention layer(s) use a fused kernel; no s x s tensor is materialized "
            "there, so nothing is worth recomputing (they save what 'none' saves)"
        )
    if not cores:
        notes.append("selective: no attention found in the graph; nothing to recompute")
    return {n for c in explicit for n in c.internals}


def _describe_kept(kept: set[fx.Node]) -> str:
    random = sum(1 for n in kept if is_random(n))
    collectives = sum(1 for n in kept if is_collective(n))
    parts = []
    if random:
        parts.append(f"{random} random op(s) (RNG replay is off or they draw from their own generator, so their masks are saved)")
    if collectives:
        parts.append(f"{collectives} collective(s) (recompute_collectives=False, so their outputs are saved)")
    if len(kept) > random + collectives:
        parts.append(f"{len(kept) - random - collectives} other op(s) that cannot be recomputed")
    return "kept instead of recomputed: " + ", ".join(parts)


_MOVES_DATA = frozenset({aten.cat, aten.clone, aten.contiguous})


def _sequence_gathers(analysis: JointAnalysis) -> set[fx.Node]:
    """All-gathers whose output reaches a weight matmul through data movement only (wait,
    views, the chunk-and-cat of a gather along a non-leading dim), with those movements."""
    found: set[fx.Node] = set()
    matmuls = analysis.regions.weight_matmuls
    for n in analysis.forward:
        if n.target not in ALL_GATHERS:
            continue
        chain, frontier, feeds_matmul = {n}, [n], False
        while frontier:
            for user in frontier.pop().users:
                if user in matmuls:
                    feeds_matmul = True
                elif user not in chain and (is_view(user) or is_collective(user) or packet(user) in _MOVES_DATA):
                    chain.add(user)
                    frontier.append(user)
        if feeds_matmul:
            found |= chain
    return found


@dataclass
class CutSolution:
    saved: list[fx.Node]
    recomputed: list[fx.Node]
    """Required forward nodes the backward runs again."""
    replayed: list[fx.Node]
    """Random ops among them (RNG replay)."""
    saved_bytes: int
    """Unique storages kept for backward, parameters excluded (RNG states not included)."""
    recompute: Cost
    weighted_bytes: float = 0.0
    weighted_cost: float = 0.0


class MinCut:
    """The s-t cut graph of one joint graph under one set of constraints; solve for any lambda."""

    def __init__(self, analysis: JointAnalysis, constraints: Constraints, options: RematOptions):
        self.analysis, self.options = analysis, options
        self.graph = nx.DiGraph()
        self.cost_edges: dict[fx.Node, float] = {}
        self.state_bytes: dict[fx.Node, float] = {}
        forward = set(analysis.forward)
        layers = analysis.regions.layer
        for n in analysis.forward:
            name_in, name_out = ("in", n), ("out", n)
            if n in analysis.unsaveable or n in constraints.must_recompute:
                self.graph.add_edge(name_in, name_out)  # no capacity attribute: infinite
            else:
                self.graph.add_edge(name_in, name_out, capacity=float(analysis.save_bytes[n]))
            if n in constraints.banned:
                self.graph.add_edge("source", name_in)
            elif n in analysis.required_fw and not is_view(n):
                # Identical layers would tie; scaling each layer's cost a little makes
                # them switch one at a time as lambda moves, so budgets between two
                # per-layer choices are met by mixing layers.
                tie_break = 1.0 + 1e-5 * ((layers.get(n) or 0) + 1)
                self.cost_edges[n] = analysis.weighted_cost(n, options) * tie_break
                self.graph.add_edge("source", name_in, capacity=0.0)
                if is_random(n):  # a replay saves the generator's state instead
                    self.state_bytes[n] = float(_rng_state_nbytes())
            for user in n.users:
                if user in forward:
                    self.graph.add_edge(name_out, ("in", user))
            if n in analysis.needed_by_backward:
                self.graph.add_edge(name_out, "sink")
        if "sink" not in self.graph:
            self.graph.add_node("sink")
        if "source" not in self.graph:
            self.graph.add_node("source")
        # only what can reach the backward is ever saved or recomputed (a min cut may put
        # an unconnected node on either side)
        self.relevant = nx.ancestors(self.graph, "sink")
        self.total_cost = sum(self.cost_edges.values())
        self.total_bytes = float(sum(analysis.save_bytes.values()))
        positive = [c for c in self.cost_edges.values() if c > 0]
        self.min_cost = min(positive) if positive else 1.0
        self._cache: dict[float, CutSolution] = {}

    def solve(self, lam: float) -> CutSolution:
        if lam in self._cache:
            return self._cache[lam]
        for n, c in self.cost_edges.items():
            self.graph["source"][("in", n)]["capacity"] = lam * c + self.state_bytes.get(n, 0.0)
        try:
            _, (source_side, _) = nx.minimum_cut(self.graph, "source", "sink", flow_func=boykov_kolmogorov)
        except nx.NetworkXUnbounded as err:
            raise ValueError(
                "the recompute policy is infeasible on this graph: a value the backward needs can neither "
                "be saved nor recomputed (a random op without RNG replay or a collective inside a region "
                "that must be recomputed); set replay_rng=True or recompute_collectives=True"
            ) from err
        solution = self._decode(source_side)
        self._cache[lam] = solution
        return solution

    def _decode(self, source_side: set) -> CutSolution:
        a = self.analysis
        saved, recomputed = [], []
        for n in a.forward:
            if ("out", n) not in self.relevant:
                continue
            if ("in", n) in source_side and ("out", n) not in source_side:
                saved.append(n)
            elif ("in", n) not in source_side and n in a.required_fw and a.cost[n] != Cost():
                recomputed.append(n)
        roots = {storage_root(n) for n in saved}
        saved_bytes = sum(storage_nbytes(r) for r in roots if r not in a.regions.state)
        recompute = Cost()
        for n in recomputed:
            recompute = recompute + a.cost[n]
        return CutSolution(
            saved=saved,
            recomputed=recomputed,
            replayed=[n for n in recomputed if is_random(n)],
            saved_bytes=saved_bytes,
            recompute=recompute,
            weighted_bytes=sum(a.save_bytes[n] for n in saved) + sum(self.state_bytes.get(n, 0.0) for n in recomputed),
            weighted_cost=sum(self.cost_edges.get(n, 0.0) for n in recomputed),
        )

    def cheapest(self) -> CutSolution:
        """Least recompute (ties: fewest bytes)."""
        return self.solve(10.0 * (self.total_bytes + 1.0) / self.min_cost)

    def smallest(self) -> CutSolution:
        """Fewest bytes (ties: least recompute)."""
        return self.solve(0.1 / (self.total_cost + 1.0))

    def frontier(self) -> list[CutSolution]:
        """Vertices of the lower convex hull of (saved bytes, recompute cost), by bytes."""
        low, high = self.smallest(), self.cheapest()
        points = {id(low): low, id(high): high}
        span_cost = max(low.weighted_cost - high.weighted_cost, 0.0)
        span_bytes = max(high.weighted_bytes - low.weighted_bytes, 0.0)
        stack = [(low, high)]
        while stack and len(self._cache) < _MAX_HULL_SOLVES:
            a, b = stack.pop()
            # vertices closer than 1e-4 of the whole range in either axis are not worth a cut
            if (a.weighted_cost - b.weighted_cost <= 1e-4 * span_cost
                    or b.weighted_bytes - a.weighted_bytes <= 1e-4 * span_bytes):
                continue
            lam = (b.weighted_bytes - a.weighted_bytes) / (a.weighted_cost - b.weighted_cost)
            m = self.solve(lam)
            edge = a.weighted_bytes + lam * a.weighted_cost
            if m.weighted_bytes + lam * m.weighted_cost < edge * (1 - 1e-9) - 1e-6:
                points[id(m)] = m
                stack += [(a, m), (m, b)]
        if stack:
            log.warning("remat frontier truncated after %d min-cut solves", len(self._cache))
        return sorted(points.values(), key=lambda s: (s.saved_bytes, s.recompute.matmul_flops))


@dataclass
class RematPlan:
    """The find step's answer: what the forward saves and what the backward recomputes."""

    policy: RematPolicy
    solution: CutSolution
    notes: list[str] = field(default_factory=list)
    frontier: list[CutSolution] = field(default_factory=list)
    """For ``"budget"``: every hull point considered."""
    minimum_feasible_bytes: int | None = None

    @property
    def saved(self) -> list[fx.Node]:
        return self.solution.saved

    @property
    def recomputed(self) -> list[fx.Node]:
        return self.solution.recomputed


def plan_remat(analysis: JointAnalysis, options: RematOptions) -> RematPlan:
    """Choose the saved set for ``options.policy`` (the find step)."""
    constraints = policy_constraints(analysis, options)
    cut = MinCut(analysis, constraints, options)
    if options.policy != "budget":
        # the policy fixed what may be saved and recomputed; of the rest (views, constants,
        # mask scalings) recompute whatever saves bytes
        plan = RematPlan(options.policy, cut.smallest(), notes=constraints.notes)
    else:
        plan = _plan_budget(analysis, cut, options, constraints.notes)
    for note in plan.notes:
        log.info("remat: %s", note)
    return plan


def _plan_budget(analysis: JointAnalysis, cut: MinCut, options: RematOptions, notes: list[str]) -> RematPlan:
    # The Lagrangian hull misses the points above it (saving is all or nothing per
    # tensor: the logits, one layer's attention). Candidates: the hull; the hull with
    # everything outside the layers kept ("recompute inside the layers only"); and the
    # named policies. The cheapest candidate under the budget wins.
    layers_only = policy_constraints(analysis, options)
    layers_only.banned |= {
        n for n in analysis.forward
        if analysis.regions.layer.get(n) is None and n not in analysis.free and n not in layers_only.must_recompute
    }
    candidates = cut.frontier() + MinCut(analysis, layers_only, options).frontier()
    named = {}
    for policy in ("none", "selective", "full", "norm_upproj"):
        policy_options = replace(options, policy=policy, budget=None)
        named[policy] = MinCut(analysis, policy_constraints(analysis, policy_options), policy_options).smallest()
    candidates += named.values()
    minimum = min(_with_states(s) for s in candidates)
    budget = budget_bytes(options.budget, minimum=minimum, none=_with_states(named["none"]))
    best = best_within_budget(analysis, candidates, budget, options)
    if best is None:
        raise ValueError(
            f"budget={budget} bytes is below the minimum feasible budget of {minimum} bytes for this graph "
            f"(saving only inputs and RNG states and recomputing everything else); use budget >= {minimum}"
        )
    frontier = pareto(candidates, options)
    notes = notes + [f"budget {budget} bytes: saving {best.saved_bytes} bytes, {len(frontier)} frontier points"]
    return RematPlan("budget", best, notes=notes, frontier=frontier, minimum_feasible_bytes=minimum)


def budget_bytes(budget: int | float, *, minimum: int, none: int) -> int:
    """Bytes a budget allows: an int as given; a fraction f of the way from the smallest feasible
    partition to "none", ``minimum + f * (none - minimum)``. Being linear in the two ends, a
    fraction splits exactly over the graphs of one call (dynamo's graph breaks): each graph's
    share adds up to the same fraction of the whole call, and no graph's share is infeasible."""
    if isinstance(budget, float):
        return minimum + int(budget * max(none - minimum, 0))
    return budget


def best_within_budget(
    analysis: JointAnalysis, candidates: list[CutSolution], budget: int, options: RematOptions
) -> CutSolution | None:
    """The cheapest candidate that fits ``budget`` (RNG states included), filled up greedily."""
    fitting = [s for s in candidates if _with_states(s) <= budget]
    if not fitting:
        return None
    best = min(fitting, key=lambda s: (analysis_cost(s, options), s.saved_bytes))
    return fill_budget(analysis, best, budget, options)


def fill_budget(analysis: JointAnalysis, start: CutSolution, budget: int, options: RematOptions) -> CutSolution:
    """Greedy knapsack from a cut under the budget: save one more recomputed value at a time (the
    one that removes the most recompute per byte added) while the budget allows; the points
    between two hull vertices that no lambda reaches."""
    current = start
    for _ in range(_MAX_FILL_STEPS):
        best, best_gain = None, 0.0
        for node in _save_moves(analysis, current):
            trial = solution_from_saved(analysis, set(current.saved) | {node})
            extra = _with_states(trial) - _with_states(current)
            saved_cost = analysis_cost(current, options) - analysis_cost(trial, options)
            if _with_states(trial) > budget or saved_cost <= 0:
                continue
            gain = saved_cost / max(extra, 1)
            if gain > best_gain:
                best, best_gain = trial, gain
        if best is None:
            break
        current = best
    return current


def _save_moves(analysis: JointAnalysis, solution: CutSolution) -> list[fx.Node]:
    """Recomputed values that could be saved instead: saveable outputs of recomputed ops (a
    multi-output op, such as a replayed dropout, through its items)."""
    moves = []
    for node in solution.recomputed:
        if not analysis.weighted_cost(node, RematOptions()):
            continue
        outputs = [u for u in node.users if u.target is operator.getitem] if node in analysis.unsaveable else [node]
        moves += [o for o in outputs if not is_view(o) and o in analysis.save_bytes and o not in analysis.unsaveable]
    return moves


def _with_states(solution: CutSolution) -> int:
    return solution.saved_bytes + _rng_state_nbytes() * len(solution.replayed)


def solution_from_saved(analysis: JointAnalysis, saved: set[fx.Node]) -> CutSolution:
    """The cut that saves ``saved`` (those the backward still reads) and recomputes the rest it needs."""
    forward = set(analysis.forward)
    used, recomputed, stack = set(), set(), list(analysis.needed_by_backward)
    while stack:
        node = stack.pop()
        if node in saved:
            used.add(node)
        elif node not in recomputed:
            recomputed.add(node)
            stack.extend(p for p in node.all_input_nodes if p in forward)
    recomputed_work = [n for n in analysis.forward if n in recomputed and n in analysis.required_fw
                       and analysis.cost[n] != Cost()]
    roots = {storage_root(n) for n in used}
    total = Cost()
    for n in recomputed_work:
        total = total + analysis.cost[n]
    return CutSolution(
        saved=[n for n in analysis.forward if n in used],
        recomputed=recomputed_work,
        replayed=[n for n in recomputed_work if is_random(n)],
        saved_bytes=sum(storage_nbytes(r) for r in roots if r not in analysis.regions.state),
        recompute=total,
    )


def pareto(solutions: list[CutSolution], options: RematOptions) -> list[CutSolution]:
    """The solutions no other beats in both saved bytes and recompute cost, by bytes."""
    front, best = [], math.inf
    for s in sorted(solutions, key=lambda s: (s.saved_bytes, analysis_cost(s, options))):
        cost = analysis_cost(s, options)
        if cost < best:
            front.append(s)
            best = cost
    return front


def analysis_cost(solution: CutSolution, options: RematOptions) -> float:
    c = solution.recompute
    return c.matmul_flops + c.elementwise + options.flops_per_comm_byte * c.comm_bytes


def _rng_state_nbytes() -> int:
    return torch.get_rng_state().numel()
