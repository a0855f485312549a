"""Placement propagation: every node of a captured graph gets a placement, from seeds.

    seeds (parameters: column / row / vocabulary splits; everything else replicated)
      -> in graph order, ``rules.forward_rule`` for each op
      -> where an input's placement differs from what the op reads, a redistribution

The result, ``Propagation``, says for every node where its output lives and, for every
(user, input) edge, where the user reads it. The rewrite (``passes.tensor_parallel``) turns
each differing edge into a collective or a cut; ``graph.gradients`` derives the gradient
reductions from the same maps. Nothing is rewritten here.

Partial sums are reduced where an op is not linear in them. How is a choice made here,
by the bytes each option moves: an all-reduce to replicated, or, with sequence
parallelism, a reduce-scatter to the sequence split (``SequenceSplit``) and local cuts of
the replicated operands. That choice, applied at the partial sums that leave attention
and MLP blocks, is Megatron's sequence parallelism: the residual stream between blocks
stays split along the sequence and blocks are entered by an all-gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Container

import torch
import torch.fx as fx

from sptransform.graph.nodes import data_dependent, describe, routes, shape_of, unbacked_dims
from sptransform.graph.placement import PARTIAL, REPLICATED, DimShard, whole
from sptransform.graph.rules import Decision, RuleContext, ShardingError, forward_rule, gather_all, tensor_inputs
from sptransform.torch_internals import GuardOnDataDependentSymNode

# Relative cost of moving a tensor of B bytes (ring algorithms): what a placement change costs.
_COST = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "cut": 0.25, "all_to_all": 1.25}


@dataclass
class SequenceSplit:
    """Sequence parallelism: how long the sequence is, and the sequence splits seen so far."""

    seq_len: int
    by_tokens: dict[tuple[int, ...], DimShard] = field(default_factory=dict)
    """Token-dims shape (the shape without the feature dim) -> its sequence split, recorded where a
    split activation is gathered to enter a block: the block's output has the same token dims."""

    def spec_for(self, node: fx.Node) -> DimShard | None:
        shape = shape_of(node)
        if shape is None or len(shape) < 2:
            return None
        known = self.by_tokens.get(tuple(shape[:-1]))
        if known is not None:
            return known
        dims = [d for d in range(len(shape) - 1) if shape[d] == self.seq_len]
        return whole(dims[-1], self.seq_len) if dims else None

    def record(self, node: fx.Node, spec: DimShard) -> None:
        shape = shape_of(node)
        if spec.dim < len(shape) - 1:
            self.by_tokens.setdefault(tuple(shape[:-1]), spec)


@dataclass
class Propagation:
    tp: int
    placement: dict[fx.Node, object] = field(default_factory=dict)
    """Every node -> where its output lives (a tuple for several outputs, None for non-tensors)."""
    reads: dict[fx.Node, dict[fx.Node, object]] = field(default_factory=dict)
    """User -> {tensor input: the placement the user reads it in}."""
    source: dict[fx.Node, str] = field(default_factory=dict)
    """Which rule placed the node: replicated, ours, dtensor, gather, seed."""
    cut_seeds: dict[fx.Node, object] = field(default_factory=dict)
    notes: dict[fx.Node, str] = field(default_factory=dict)
    """Node -> what the user should know about its decision (a DTensor rule used unchecked)."""

    def as_read(self, node: fx.Node):
        """The placement rules see: a placeholder stored whole but read split looks split."""
        return self.cut_seeds.get(node, self.placement[node])

    def changes(self) -> list[tuple[fx.Node, fx.Node, object, object]]:
        """(input, user, from, to) of every edge where the user reads another placement."""
        out = []
        for user, reads in self.reads.items():
            for node, wanted in reads.items():
                have = self.placement.get(node)
                if wanted != have:
                    out.append((node, user, have, wanted))
        return out

    def gathered_ops(self) -> list[fx.Node]:
        """Ops that run whole on every rank because no rule could split them (rule 4), though
        an input was split or partial: correct, but their inputs are gathered."""
        return [n for n, s in self.source.items() if s == "gather"]

    def routing_ops(self) -> list[fx.Node]:
        """Ops computed whole because their shapes depend on the data (``graph.nodes.data_dependent``)."""
        return [n for n, s in self.source.items() if s == "routing"]


def move_kind(have, want) -> str:
    if have == want:
        return "none"
    if have == PARTIAL:
        return "all_reduce" if want == REPLICATED else "reduce_scatter"
    if have == REPLICATED:
        return "cut"
    if want == REPLICATED:
        return "all_gather"
    return "all_to_all"


def _nbytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return math.prod(shape_of(node)) * value.element_size() if isinstance(value, torch.Tensor) else 0


def decision_cost(decision: Decision, placement_of, constant) -> float:
    total = 0.0
    for node, want in decision.needs.items():
        kind = move_kind(placement_of(node), want)
        if kind == "none" or (kind == "cut" and node in constant):
            continue
        total += _COST[kind] * _nbytes(node)
    return total


def propagate(
    gm: fx.GraphModule,
    seeds: dict[fx.Node, object],
    *,
    tp: int,
    constant: set[fx.Node],
    sequence: SequenceSplit | None,
    cut_seeds: dict[fx.Node, object] | None = None,
    keep_outputs: Container[fx.Node] = (),
) -> Propagation:
    """Placements of every node of ``gm`` from ``seeds`` (placeholders not seeded are replicated).

    ``constant``: nodes computed from parameters and buffers only. ``sequence``: sequence
    parallelism (None without it). ``cut_seeds``: placeholders stored whole but read split
    (each reader reads a cut). ``keep_outputs``: output nodes returned in their own even
    split, not gathered. Raises ``ShardingError`` naming every op that cannot run."""
    result = Propagation(tp)
    result.cut_seeds = dict(cut_seeds or {})
    ctx = RuleContext(tp=tp, is_constant=lambda n: n in constant)
    problems: list[str] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            value = node.meta.get("val")
            result.placement[node] = seeds.get(node, REPLICATED) if isinstance(value, torch.Tensor) else None
            result.source[node] = "seed" if node in seeds else "replicated"
            continue
        if node.op == "output":
            result.reads[node] = {a: _output_placement(a, result.placement.get(a), a in keep_outputs)
                                  for a in tensor_inputs(node)}
            continue
        try:
            decision = _decide(node, result, ctx, constant, sequence)
        except ShardingError as err:
            problems.append(str(err))
            decision = gather_all(node, tensor_inputs(node))
        result.placement[node] = decision.output
        result.reads[node] = dict(decision.needs)
        result.source[node] = decision.source
        if decision.note is not None:
            result.notes[node] = decision.note
        if sequence is not None:
            for a, want in decision.needs.items():
                have = result.placement.get(a)
                if isinstance(have, DimShard) and want == REPLICATED:
                    sequence.record(a, have)
    if problems:
        raise ShardingError("; ".join(problems))
    return result


def _output_placement(node: fx.Node, placement, keep: bool = False):
    """What the user gets back: partial sums reduced, split tensors gathered, except tensors split
    evenly along their last dim (vocabulary-parallel logits), which return as a sharded DTensor,
    and, with ``keep``, tensors split evenly along any dim."""
    if placement is None or placement == REPLICATED:
        return placement
    last = len(shape_of(node)) - 1
    if isinstance(placement, DimShard) and len(placement.segments) == 1:
        if placement.dim == last or (keep and placement.segments == ((0, shape_of(node)[placement.dim]),)):
            return placement
    return REPLICATED


def _decide(node: fx.Node, result: Propagation, ctx: RuleContext, constant, sequence) -> Decision:
    if not data_dependent(node):
        return _decide_by_rules(node, result, ctx, constant, sequence)
    # Routing with data-dependent shapes (``nonzero``, a boolean mask, ``.tolist()`` of counts) is
    # computed whole from whole inputs, so every rank routes every token alike (tokens split by SP
    # are gathered first, partial sums reduced) and no size of it is ever split. An op that only
    # reads such a tensor (an expert's linears on its rows ``x[idx]``) is split like any other,
    # along dims of static size only.
    if not routes(node):
        try:
            decision = _decide_by_rules(node, result, ctx, constant, sequence)
        except GuardOnDataDependentSymNode:  # a rule that asks something of a run-time size: whole
            decision = None
        if decision is not None and _static_splits(node, decision):
            return decision
    decision = gather_all(node, tensor_inputs(node))
    return Decision(decision.needs, decision.output, "routing")


def _static_splits(node: fx.Node, decision: Decision) -> bool:
    """Whether every split the decision reads or makes is along a dim of static size."""
    wanted = [(a, p, None) for a, p in decision.needs.items()]
    if isinstance(decision.output, (list, tuple)):  # a split's chunks
        wanted += [(node, p, i) for i, p in enumerate(decision.output)]
    else:
        wanted.append((node, decision.output, None))
    return all(not isinstance(p, DimShard) or p.dim not in unbacked_dims(a, i) for a, p, i in wanted)


def _decide_by_rules(node: fx.Node, result: Propagation, ctx: RuleContext, constant, sequence) -> Decision:
    placement_of = result.as_read
    decision = forward_rule(node, placement_of, ctx)
    if decision is not None:
        return decision
    # Partial inputs the op is not linear in: reduce them, the cheapest way.
    partial = [a for a in tensor_inputs(node) if result.placement[a] == PARTIAL]
    options = [{a: REPLICATED for a in partial}]
    if sequence is not None:
        split = {a: sequence.spec_for(a) for a in partial}
        if all(spec is not None for spec in split.values()):
            options.insert(0, split)
    best = None
    for option in options:
        candidate = forward_rule(node, lambda n, option=option: option.get(n, result.as_read(n)), ctx)
        if candidate is None:
            continue
        needs = {**candidate.needs}
        for a in partial:  # the op reads what the reduction made; the reduction is the move
            needs[a] = option[a] if needs.get(a) == option[a] else needs.get(a, option[a])
        cost = sum(_COST[move_kind(PARTIAL, option[a])] * _nbytes(a) for a in partial)
        cost += decision_cost(Decision({k: v for k, v in needs.items() if k not in partial}, candidate.output),
                              placement_of, constant)
        cost += sum(_COST[move_kind(option[a], needs[a])] * _nbytes(a) for a in partial if needs[a] != option[a])
        if best is None or cost < best[0]:
            best = (cost, Decision(needs, candidate.output, candidate.source, candidate.note))
    if best is None:
        raise ShardingError(f"{describe(node)} reads a partial sum and no reduction of it can run")
    return best[1]
