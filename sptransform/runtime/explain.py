"""``ParallelModule.explain()``: regions per layer, parameter placements, collectives."""

from __future__ import annotations

import torch
import torch.fx as fx

from sptransform.graph.nodes import tensor_val
from sptransform.graph.placement import describe_placement
from sptransform.runtime.collectives import copy_to_tp, gather_output, gather_seq, reduce_from_tp, scatter_seq, sync_grads
from sptransform.runtime.ops import vocab_parallel_cross_entropy
from sptransform.torch_internals import free_unbacked_symbols
from sptransform.runtime.zero import gather_summed, gather_whole

# A constant table (never written at run time), read by explain().
COLLECTIVE_DIRECTIONS: dict = {
    # graph op: (collectives its forward runs, collectives its backward runs)
    copy_to_tp: ((), ("all-reduce",)),
    reduce_from_tp: (("all-reduce",), ()),
    gather_seq: (("all-gather",), ("reduce-scatter",)),
    scatter_seq: (("reduce-scatter",), ("all-gather",)),
    gather_output: (("all-gather",), ()),
    sync_grads: ((), ("all-reduce",)),
    # parameters stored in 1/tp pieces (shard_whole): gathered; the backward keeps its piece
    gather_whole: (("all-gather",), ()),
    # parameters split in the graph, stored in 1/tp pieces: gathered; their partial gradient summed
    gather_summed: (("all-gather",), ("reduce-scatter",)),
    # each rank's row max, sum of exponentials and shifted target logit: one small all-gather
    vocab_parallel_cross_entropy: (("all-gather",), ()),
}


def collective_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_DIRECTIONS]


def collective_bytes(node: torch.fx.Node, tp: int) -> int:
    """Bytes of the full (all-gathered / pre-reduction) tensor one call moves. For a tensor whose
    rows are known only at run time (those routed to one expert) a ``SymInt`` (``128*u0``)."""
    if node.target is vocab_parallel_cross_entropy:  # [ranks, 3, *tokens] gathered
        logits = node.args[0].meta["val"]
        return int(tp * 3 * (logits.numel() // logits.shape[-1]) * logits.element_size())
    if node.target is sync_grads:
        return sum(a.meta["val"].numel() * a.meta["val"].element_size() for a in node.args[1:])
    if node.target in (gather_whole, gather_summed):  # its pieces' placeholders carry the whole parameters' shapes
        first = 5 if node.target is gather_whole else 4
        return sum(a.meta["val"].numel() * a.meta["val"].element_size() for a in node.args[first:])
    val = node.meta.get("val")
    if val is None:
        val = node.args[0].meta.get("val")
    if val is None:
        return 0
    nbytes = val.numel() * val.element_size()
    return nbytes if free_unbacked_symbols(nbytes) else int(nbytes)


def _bytes_text(nbytes) -> str:
    return f"{nbytes:>12,} B" if isinstance(nbytes, int) else f"{str(nbytes):>12} B (rows known at run time)"


def collective_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Collectives per forward+backward, by kind, read from the graph."""
    counts: dict[str, int] = {}
    for node in collective_nodes(gm):
        forward, backward = COLLECTIVE_DIRECTIONS[node.target]
        for kind in forward + backward:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def largest_whole(analysis, plan, count: int = 8) -> list[str]:
    """The ``count`` largest parameters every rank holds whole, with their share of the model's
    parameter bytes and the rule that left each whole (``ModelAnalysis.whole_reasons``)."""
    total = sum(analysis.param_bytes.values())
    read_whole = {name: size for name, size in analysis.param_bytes.items()
                  if name not in plan.placements or plan.placements[name].spec is None}
    pieces = {name: size for name, size in read_whole.items()
              if name in plan.placements and plan.placements[name].gathered is not None}
    whole = {name: size for name, size in analysis.param_bytes.items()  # stored whole, split in the graph or not
             if name not in pieces and (name not in plan.placements or plan.placements[name].storage is None)}
    split_pieces = {name: size for name, size in analysis.param_bytes.items() if name in plan.placements
                    and plan.placements[name].stored_whole and plan.placements[name].gathered is not None}
    lines = []
    if total and split_pieces:
        lines.append(f"split in the graph and stored in 1/tp pieces, gathered where read (no DTensor placement holds "
                     f"their segments): {len(split_pieces)} parameters, {sum(split_pieces.values()) / total:.1%} of "
                     "the parameter bytes")
    if total and pieces:
        lines.append(f"computed whole but stored in 1/tp pieces (shard_whole=True), gathered where read: "
                     f"{len(pieces)} parameters, {sum(pieces.values()) / total:.1%} of the parameter bytes")
    if not total or not whole:
        return lines
    lines.append(f"held whole on every rank: {len(whole)} parameters, {sum(whole.values()) / total:.1%} of the "
                 f"parameter bytes; the largest:")
    for name, size in sorted(whole.items(), key=lambda x: (-x[1], x[0]))[:count]:
        placement = plan.placements.get(name)
        why = ("split in the graph, stored whole: no DTensor placement holds its pieces' segments, so each "
               "rank cuts its rows from the whole" if placement is not None and placement.stored_whole
               else analysis.whole_reasons.get(name, "no rule splits it"))
        lines.append(f"  {name:<50} {size:>12,} B {size / total:6.1%}  {why}")
    if not pieces and sum(whole.values()) / total > WHOLE_HINT:
        lines.append("  shard_whole=True would store these in 1/tp pieces (their compute stays whole; one "
                     "all-gather per layer more per forward)")
    return lines


WHOLE_HINT = 0.1
"""Above this share of the parameter bytes held whole, ``explain()`` points to ``shard_whole``."""


def _data_parallel_lines(graph) -> list[str]:
    """At tp=1: what data and expert parallelism did to the captured graph."""
    dp = graph.data_parallel
    if dp is None:
        return ["tp=1: the captured graph runs unchanged"]
    return [f"tp=1: {_dp_line(dp)}", *_expert_lines(graph)]


def _dp_line(dp) -> str:
    return f"data parallelism over {dp.size} ranks, zero={dp.zero}"


def _expert_lines(graph) -> list[str]:
    """The experts this rank stores and the bytes their exchange sends (``ep > 1``)."""
    lines: list[str] = []
    experts = graph.expert_parallel
    if experts is not None:
        names = sorted(experts.experts)
        sent = expert_dispatch_bytes(graph.gm, experts.group, experts.size)
        lines.append(f"expert parallelism over {experts.size} ranks: {len(names)} expert tensors, each rank storing "
                     f"1/{experts.size} of their experts:")
        for name in names:
            per = experts.experts[name] // experts.size
            lines.append(f"  {name}: experts {experts.rank * per}-{(experts.rank + 1) * per - 1} of "
                         f"{experts.experts[name]} on this rank")
        lines.append(f"  sent per forward (and the same back in backward): all-gather of the tokens and routing "
                     f"{sent['gather']:,} B, reduce-scatter of the outputs {sent['scatter']:,} B")
    return lines


def _rows_label(region) -> str:
    names = list(dict.fromkeys(lm.weight_label for lm in region.rows))
    count = f" ({len(region.rows)} linears)" if len(region.rows) > 1 else ""
    return ", ".join(names) + count


def explain(graph, options) -> str:
    plan, analysis = graph.plan, graph.analysis
    lines = [f"sptransform: tp={options.tp} sp={options.sp} dropout_rng={options.dropout_rng}"]
    if analysis is None:
        return "\n".join(lines + _data_parallel_lines(graph))
    lines.append(f"sequence length {analysis.seq_len}; vocab {plan.vocab if plan else '-'}")
    lines.append("regions:")
    for region in analysis.regions:
        cols = ", ".join(dict.fromkeys(region.column_linears[c].weight_label for c in region.columns)) or \
            "none: its inputs cut from whole tensors"  # (experts in a loop: one weight, one linear per expert)
        lines.append(f"  layer {region.layer:>3} {region.kind:<9} columns [{cols}] -> row {_rows_label(region)}")
    if analysis.head is not None:
        lines.append(f"  head {analysis.head.weight_name} (vocab-parallel), loss: {'vocab-parallel cross-entropy' if analysis.loss is not None else 'none'}")
    if plan is None:
        return "\n".join(lines)
    split, total = plan.linears
    lines.append(f"linears split over the ranks: {split} of {total}")
    lines.append("parameters:")
    for name, placement in sorted(plan.placements.items()):
        pad = f", padded to {placement.padded_rows} rows" if placement.padded_rows else ""
        whole = ", stored whole and cut in the graph" if placement.stored_whole else ""
        if placement.gathered is not None:
            whole = f", stored in 1/tp pieces along dim {placement.gathered.dim}, gathered where read"
        lines.append(f"  {name:<50} {describe_placement(placement.spec) if placement.spec else 'replicated':<16} "
                     f"{placement.role}{pad}{whole}")
    for name, layer in sorted(plan.sync_params.items(), key=lambda x: x[1]):
        lines.append(f"  {name:<50} replicated, gradient summed in bucket of layer {layer}")
    lines.extend(largest_whole(analysis, plan))
    lines.append("collectives (forward / backward, bytes of the full tensor per call):")
    for node in collective_nodes(graph.gm):
        fwd, bwd = (" + ".join(k) or "-" for k in COLLECTIVE_DIRECTIONS[node.target])
        lines.append(f"  {node.name:<28} {node.target.__name__:<28} fwd {fwd:<15} bwd {bwd:<15} {_bytes_text(collective_bytes(node, options.tp))}")
    counts = collective_counts(graph.gm)
    lines.append("per step: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if graph.data_parallel is not None:
        lines.append(_dp_line(graph.data_parallel))
    lines.extend(_expert_lines(graph))
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


def expert_dispatch_bytes(gm: fx.GraphModule, group: str, size: int) -> dict[str, int]:
    """Bytes one rank sends per forward in the expert exchanges of ``gm`` (``passes.expert_parallel``'s
    rewrite) over the expert-parallel ``group``, read from the graph's values: ``gather`` (all-gather of the data inputs: this rank's
    piece to each of the other ``size - 1`` ranks) and ``scatter`` (reduce-scatter of the outputs:
    ``(size - 1) / size`` of the stacked tensor). The backward sends the same amounts the other
    way (the conjugate collectives)."""
    sent = {"gather": 0, "scatter": 0}
    for node in gm.graph.nodes:
        value = tensor_val(node)
        if node.op != "call_function" or node.args[2:3] != (group,):
            continue
        if node.target is gather_seq and value is not None:
            sent["gather"] += value.numel() * value.element_size() * (size - 1) // size
        elif node.target is scatter_seq and tensor_val(node.args[0]) is not None:
            stacked = tensor_val(node.args[0])
            sent["scatter"] += stacked.numel() * stacked.element_size() * (size - 1) // size
    return sent
