"""Why the analysis leaves what it does whole, in the user's words.

Two questions, each answered from the facts ``graph.analysis.analyze`` already found:

* which rule leaves a parameter whole on every rank (``whole_reasons``: its linear runs whole
  and is cut inside a block, it runs split per head with its weight shared by the heads, its
  linear is neither column- nor row-parallel and what stopped it each way, it is read in pieces
  that no split fits, or no linear reads it), kept in
  ``ModelAnalysis.whole_reasons`` for ``explain()`` to name the largest;
* what ``tp`` fails to divide when a block's walk succeeds at tp=1 but not at the asked tp
  (``divisibility_message``: the attention heads and the model's own K/V heads, or the MLP
  width, and the tp that would work), the ``ShardingError`` ``analyze`` raises.

Nothing here decides a split; nothing reads module paths or node names.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from sptransform.capture import CapturedGraph
from sptransform.graph.findings import EmbeddingMatch, LinearMatch, Region
from sptransform.graph.nodes import MOVES_ONLY, describe, forward_closure, packet, shape_of
from sptransform.graph.rules import ShardingError

aten = torch.ops.aten


def whole_reasons(captured: CapturedGraph, linears: dict[fx.Node, LinearMatch], regions: list[Region],
                  head: LinearMatch | None, vocab_embeddings: list[EmbeddingMatch],
                  failures: dict[fx.Node, ShardingError], notes: list[str], kept_whole: set[str]) -> dict[str, str]:
    """Parameter -> the rule that leaves it whole, for every parameter no region, head or
    vocabulary embedding splits. Read off the same facts the analysis used: how the linears
    reading it were placed, else which ops read it."""
    split: set[str] = set()
    for region in regions:
        split.update(lm.weight_name for lm in region.rows)
        for lm in region.column_linears.values():
            split.update(n for n in (lm.weight_name, lm.bias_name) if n)
    if head is not None:
        split.update(n for n in (head.weight_name, head.bias_name) if n)
    split.update(e.weight_name for e in vocab_embeddings)
    cut = {n: r for r in regions for n, _ in r.cuts if n in linears}
    per_row = {n: r for r in regions for n in r.specs
               if n in linears and n not in r.columns and n not in {lm.node for lm in r.rows}}
    reasons: dict[str, str] = {}
    for name in sorted(kept_whole):
        reasons[name] = next((n.split(": ", 1)[1] for n in notes if n.startswith(f"parameter {name!r}, read in pieces")),
                             "read in pieces that no split fits")
    for node, lm in linears.items():
        for name in (lm.weight_name, lm.bias_name):
            if not name or name in split or name in reasons:
                continue
            if node in per_row:
                reasons[name] = (f"its linear runs split along a dim it maps row by row (per head) inside the "
                                 f"{per_row[node].kind} block of {per_row[node].row.weight_name!r}: every piece "
                                 "reads the whole weight")
            elif node in cut:
                reasons[name] = (f"its linear runs whole and its output is cut inside the {cut[node].kind} block of "
                                 f"{cut[node].row.weight_name!r} (fewer heads than tp, or a split the walk cannot carry)")
            elif lm.weight_piece is None:
                reasons[name] = _neither_reason(node, failures)
    for node in captured.state_placeholders:
        name = captured.param_of(node)
        if not name or name in split or name in reasons:
            continue
        readers = sorted({str(packet(u)).rsplit(".", 1)[-1] for u in _readers_through_views(node)})
        if not readers:
            others = [n for n in captured.tied.get(name, ()) if n != name]
            reasons[name] = (f"tied to {others[0]!r}: one tensor, stored as that name" if others else
                             "read by nothing in this graph: a parameter the forward does not use")
            continue
        reasons[name] = (f"no linear reads it: read by {', '.join(readers)} (elementwise, norm, router "
                         "or lookup ops run on whole parameters)")
    return reasons


def _neither_reason(node: fx.Node, failures: dict[fx.Node, ShardingError]) -> str:
    """Why a linear is in no region: what stopped it as a row-parallel linear, and what stopped the
    walk back from the first linear it feeds (which would have made it column-parallel)."""
    why = [f"as a row-parallel linear, {failures[node]}"] if node in failures else []
    fed = [n for n in forward_closure([node]) if n is not node and n in failures]
    if fed:
        position = {n: i for i, n in enumerate(node.graph.nodes)}
        first = min(fed, key=position.__getitem__)
        why.append(f"as a column-parallel one feeding {describe(first)}, {failures[first]}")
    return "its linear is neither column- nor row-parallel" + (f" ({'; '.join(why)})" if why else "")


def _readers_through_views(node: fx.Node) -> list[fx.Node]:
    """The ops that read ``node``, looking through views and casts of it."""
    found, stack = [], list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "call_function" and packet(user) in MOVES_ONLY:
            stack.extend(user.users)
        else:
            found.append(user)
    return found


def divisibility_message(structure: Region, tp: int, err: ShardingError, workable: list[int]) -> str:
    """Why ``tp`` cannot split the block ``structure`` (its walk at tp=1), in the user's words:
    the heads or MLP width it does not divide, the block's output projection, and the ``tp``
    for which the walk succeeds (``workable``)."""
    return (
        f"tp={tp} does not divide the {_sizes(structure)} of the {structure.kind} block whose output "
        f"projection is {structure.row.weight_name!r} ({err}); use tp in {{{', '.join(map(str, workable))}}}"
    )


def _sizes(region: Region) -> str:
    """What the split must divide, in the user's words: heads or MLP width."""
    for node in region.specs:
        if packet(node) is aten.scaled_dot_product_attention:
            q, k = node.args[:2]
            return f"{shape_of(q)[-3]} attention heads / {_kv_heads(k)} K/V heads"
        if packet(node) in (aten.softmax, aten._softmax):
            return f"{shape_of(node)[-3]} attention heads (or their K/V heads)"
    return f"MLP width {region.row.in_features}"


_HEAD_REPEATS = (aten.reshape, aten.view, aten._unsafe_view, aten.expand, aten.unsqueeze, aten.repeat_interleave,
                 aten.clone, aten.slice)
"""Ops by which model code (HF's ``repeat_kv``: unsqueeze, expand, reshape) or our
``repeat_grouped_kv`` repeats grouped K/V heads up to the query's count before attention."""


def _kv_heads(k: fx.Node) -> int:
    """The K/V heads the model has, not the repeated count attention reads: the fewest heads of
    the 4-D tensors ``k`` is made from through head repeats (a message that said "4 K/V heads"
    for a model with 2 would send the user to the wrong fix)."""
    heads, node = shape_of(k)[-3], k
    while isinstance(node, fx.Node) and packet(node) in _HEAD_REPEATS and node.args:
        node = node.args[0]
        shape = shape_of(node) if isinstance(node, fx.Node) else None
        if shape is not None and len(shape) == 4:
            heads = min(heads, shape[-3])
    return heads
