"""What each part of a captured graph *is*, read from dataflow and shapes alone.

* a **linear** is a matmul-like op (``linear``, ``addmm``, ``mm``, ``matmul``, the weight on
  either side; a two-operand ``einsum`` of an activation by a parameter) one of
  whose operands is a parameter, possibly through ``t``/``transpose``/``permute``, or
  consecutive rows of one along its output features (a fused projection taken apart with
  ``split``/``chunk``/``slice``, as ``nn.MultiheadAttention`` does for cross-attention); such a
  parameter is split as its pieces are, side by side, when every piece is column-parallel;
  experts are linears per expert: a grouped matmul of a 3-D parameter, or a ``bmm`` by one
  gathered per token-expert pair (``W[expert_ids]``);
* an **embedding** is ``aten.embedding`` of a parameter;
* a **tensor-parallel region** pairs a row-parallel linear (or several: experts on the chunks
  of one split, or a linear that contracts the block's split tensor midway, Mamba's ``x_proj``)
  with the column-parallel linears feeding it: walking back from the row linear's input, asking at each op
  how its inputs must be split for the row linear's input features to be split
  contiguously, reaches the column linears' outputs without crossing anything that
  mixes features (a norm, a reduction over the hidden size). Attention (fused or
  separate Q/K/V, SDPA or explicit softmax, grouped K/V heads) and MLPs (fc-act-fc,
  gate/up/down) are the regions found in transformers; the walk also derives how a
  fused QKV weight must be split (``[q|k|v]`` needs three segments, a per-head
  interleaved layout one);
* the **head** is the linear left over whose output reaches the loss or the
  outputs, and the **loss** is ``aten.cross_entropy_loss`` downstream of it;
* **norms** are ``layer_norm``/``rms_norm`` or the decomposed RMSNorm
  ``x * rsqrt(mean(x**2, -1) + eps)``.

The records found are ``graph.findings``; the words for what stays whole, and for a ``tp`` that
a block's sizes do not allow, are ``graph.reasons``. Nothing here reads module paths or node names.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Container

import torch
import torch.fx as fx

from sptransform.capture import CapturedGraph
from sptransform.graph.findings import EmbeddingMatch, LinearMatch, ModelAnalysis, Region
from sptransform.graph.nodes import (
    MOVES_ONLY, describe, forward_closure, is_grouped_mm, packet, routes, shape_of, tensor_nbytes,
)
from sptransform.graph.placement import DimShard, ParamPlacement, whole
from sptransform.graph.reasons import divisibility_message, whole_reasons
from sptransform.graph.walk import (
    ReadOnItsFeatures, non_overlapping_regions, rows_on_one_split, walk_with_inner_rows, walks, trace_region,
)
from sptransform.graph.rules.links import einsum_subscripts, is_depthwise
from sptransform.graph.rules import (
    ShardingError, is_getitem, is_split, slice_bounds,
    split_chunks, split_dim,
)
from sptransform.torch_internals import pytree

aten = torch.ops.aten

_WEIGHT_VIEWS = {aten.t, aten.transpose, aten.permute, aten.alias, aten.detach, aten.numpy_T, aten.mT}
_REVERSED = {aten.t, aten.numpy_T, aten.mT}  # on a 2-D weight: the two dims swap


# ---------------------------------------------------------------------------
# finders


class _NotAPiece(Exception):
    """Pieces taken along two different dims: not rows of one fused projection."""


def _view_step(node: fx.Node) -> list[int]:
    """Of a weight view: output dim -> input dim."""
    shape, p = shape_of(node), packet(node)
    step = list(range(len(shape)))
    if len(shape) < 2:
        return step
    if p in _REVERSED or p is aten.transpose:
        a, b = (0, 1) if p in _REVERSED else [d % len(shape) for d in node.args[1:3]]
        step[a], step[b] = step[b], step[a]
    elif p is aten.permute:
        step = [d % len(shape) for d in node.args[1]]
    return step


def _piece_of(node: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """If ``node`` takes consecutive indices of another tensor along one dim (a chunk of a
    ``split``/``chunk``, a step-1 ``slice``; ``narrow`` is one after ``canonicalize.narrow_as_slice``):
    (that tensor, dim, start, length)."""
    if is_getitem(node) and is_split(node.args[0]) and packet(node.args[0]) is not aten.unbind:
        split = node.args[0]
        start, length = split_chunks(split)[node.args[1]]
        return split.args[0], split_dim(split), start, length
    if packet(node) is aten.slice:
        d, start, end, step = slice_bounds(node)
        if step == 1:
            return node.args[0], d, start, end - start
    return None


def _param_through_views(node, captured: CapturedGraph):
    """If ``node`` is a parameter, or consecutive rows of one along one dim (pieces of pieces
    add up), maybe transposed: (placeholder, dim permutation, piece); ``piece`` is
    ``(dim of the parameter, start, length)`` or None for all of it. (None, None, None) if not."""
    perm, piece = None, None  # perm: the operand's dim -> the current node's dim
    try:
        while isinstance(node, fx.Node) and node.op == "call_function":
            if packet(node) in _WEIGHT_VIEWS:
                step = _view_step(node)
                perm = step if perm is None else [step[i] for i in perm]
                piece = None if piece is None else (step[piece[0]], *piece[1:])
                node = node.args[0]
                continue
            found = _piece_of(node)
            if found is None:
                break
            node, d, start, length = found
            if piece is not None and piece[0] != d:
                raise _NotAPiece
            piece = (d, start, length) if piece is None else (d, start + piece[1], piece[2])
    except _NotAPiece:
        return None, None, None
    if isinstance(node, fx.Node) and node.op == "placeholder" and captured.param_of(node):
        return node, perm, piece
    return None, None, None


def _gathered_experts(node, captured: CapturedGraph) -> tuple[fx.Node, list[int]] | None:
    """If ``node`` is ``index(W, [ids])`` of a 3-D parameter (maybe through views) by one 1-D
    index tensor on its first dim, one ``[N, K]`` weight per row of ``ids``: (placeholder, the
    dim permutation from the indexed tensor's dims to the parameter's). Else None."""
    if not isinstance(node, fx.Node) or packet(node) is not aten.index:
        return None
    table, indices = node.args[0], list(node.args[1])
    if len(shape_of(table) or ()) != 3 or len(indices) != 1 or len(shape_of(indices[0]) or ()) != 1:
        return None
    placeholder, perm, piece = _param_through_views(table, captured)
    if placeholder is None or piece is not None:
        return None
    return placeholder, perm if perm is not None else [0, 1, 2]


def _stacked_experts(node, captured: CapturedGraph) -> tuple[fx.Node, list[int]] | None:
    """If ``node`` is a 3-D parameter (maybe through views) read whole, one ``[N, K]`` weight per
    batch entry (the experts' dim): (placeholder, the dim permutation). Else None."""
    placeholder, perm, piece = _param_through_views(node, captured)
    if placeholder is None or piece is not None or len(shape_of(placeholder) or ()) != 3:
        return None
    return placeholder, perm if perm is not None else [0, 1, 2]


def _selected_expert(node, captured: CapturedGraph) -> tuple[fx.Node, list[int]] | None:
    """If ``node`` is one expert's 2-D weight ``W[i]`` (``select(W, 0, i)``, maybe transposed) of a
    3-D parameter: (placeholder, the map from the weight's two dims to the parameter's). JetMoE's
    and ScatterMoE-style ``[E, out, in]`` experts run one by one on their rows (``F.linear(rows,
    W[i])``); every expert's slice is split alike, so the parameter splits along that dim."""
    perm = [0, 1]
    while isinstance(node, fx.Node) and packet(node) in _WEIGHT_VIEWS and len(shape_of(node) or ()) == 2:
        step = _view_step(node)
        perm = [step[d] for d in perm]
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target is not aten.select.int or node.args[1] % 3 != 0:
        return None
    placeholder, inner, piece = _param_through_views(node.args[0], captured)
    if placeholder is None or piece is not None or inner is not None or len(shape_of(placeholder)) != 3:
        return None
    return placeholder, [d + 1 for d in perm]


def _batched_experts(node: fx.Node, captured: CapturedGraph) -> LinearMatch | None:
    """``bmm`` of an activation by experts' weights, one linear per expert: gathered per token, as
    transformers' ``experts_implementation="batched_mm"`` runs its experts, or the 3-D parameter
    itself with the experts as the batch dim (Llama 4's experts on tokens laid out ``[E, T, K]``).

        bmm(W[ids] [S, N, K], x [S, K, 1]) -> [S, N, 1]   (W stored [E, N, K])
        bmm(x [S, 1, K], W[ids] [S, K, N]) -> [S, 1, N]   (W stored [E, K, N], ``is_transposed``)
        bmm(x [E, T, K], W [E, K, N]) -> [E, T, N]
    """
    a, b = node.args[:2]
    for weight, x, feature_dims, input_dim, output_dim in ((a, b, (1, 2), 1, 1), (b, a, (2, 1), 2, 2)):
        found = _gathered_experts(weight, captured)
        if found is None:
            found = _stacked_experts(weight, captured)
        if found is None or _gathered_experts(x, captured) is not None or _stacked_experts(x, captured) is not None:
            continue
        placeholder, perm = found
        out_dim, in_dim = (perm[d] for d in feature_dims)
        wshape = shape_of(placeholder)
        return LinearMatch(
            node=node, input=x, weight=placeholder, weight_name=captured.param_of(placeholder), out_dim=out_dim,
            bias=None, bias_name=None, in_features=wshape[in_dim], out_features=wshape[out_dim], in_dim=in_dim,
            per_group=True, input_dim=input_dim, output_dim=output_dim,
        )
    return None


def _einsum_linear(node: fx.Node, captured: CapturedGraph) -> LinearMatch | None:
    """``einsum("bsd,dnh->bnsh", x, W)`` with ``W`` a parameter read as it is: a linear whose input
    features are the letters ``x`` and ``W`` share and the output drops, and whose output
    features are ``W``'s letters the output keeps; it is split along the outermost of each (the
    heads ``n`` of ``W[d, n, h]``). A letter in ``x``, ``W`` and the output (a batch of weights,
    experts) is not a linear of this kind."""
    found = einsum_subscripts(node)
    if found is None or routes(node):
        return None
    subscripts, out = found
    for w_side in (1, 0):
        placeholder = node.args[1][w_side]
        if captured.param_of(placeholder) is None:
            continue
        x, xs, ws = node.args[1][1 - w_side], subscripts[1 - w_side], subscripts[w_side]
        if _param_through_views(x, captured)[0] is not None or any(c in xs and c in out for c in ws):
            return None
        outs = [c for c in ws if c in out]
        ins = [c for c in ws if c in xs]
        if not outs or not ins or len(outs) + len(ins) != len(ws):
            return None
        shape = shape_of(placeholder)
        return LinearMatch(
            node=node, input=x, weight=placeholder, weight_name=captured.param_of(placeholder),
            out_dim=ws.index(outs[0]), bias=None, bias_name=None,
            in_features=shape[ws.index(ins[0])], out_features=shape[ws.index(outs[0])],
            in_dim=ws.index(ins[0]), input_dim=xs.index(ins[0]), output_dim=out.index(outs[0]),
        )
    return None


def find_linears(captured: CapturedGraph) -> dict[fx.Node, LinearMatch]:
    """Every matmul-like op with a parameter operand, or a piece of one along its output features
    (a fused projection taken apart: torch's ``nn.MultiheadAttention`` cross-attention splits
    ``in_proj_weight`` into ``[q]`` and ``[k|v]``, and with ``kdim`` chunks ``in_proj_bias`` in 3),
    and the experts' matmuls (a grouped matmul of a 3-D parameter, a ``bmm`` of one gathered per token)."""
    found: dict[fx.Node, LinearMatch] = {}
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        p = packet(node)
        sides = -1  # the dim of input and output that holds the features
        if p is aten.bmm:
            match = _batched_experts(node, captured)
            if match is not None:
                found[node] = match
            continue
        if p is aten.einsum:
            match = _einsum_linear(node, captured)
            if match is not None:
                found[node] = match
            continue
        if p is aten.linear:
            x, w = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else None
            out_dim = 0
        elif p is aten.addmm:
            bias, x, w = node.args[:3]
            out_dim = 1
        elif p in (aten.mm, aten.matmul):
            x, w = node.args[:2]
            bias = None
            out_dim = 1
            if _param_through_views(w, captured)[0] is None and _param_through_views(x, captured)[0] is not None:
                # the weight on the left, ``W @ x`` with x [..., in, n] (Mamba's ``dt_proj.weight @ t``):
                # features along the second-to-last dims of input and output
                x, w = w, x
                out_dim, sides = 0, -2
        elif is_grouped_mm(node):  # x [S, K] by w [E, K, N]: one linear per expert
            x, w = node.args[:2]
            bias = None
            out_dim = 2
        else:
            continue
        if routes(node):
            continue  # a linear deciding a routing value: computed whole (propagation keeps it so)
        grouped = is_grouped_mm(node)
        placeholder, perm, piece = _param_through_views(w, captured)
        selected = None if grouped or placeholder is not None else _selected_expert(w, captured)
        if selected is not None:  # one expert's slice: the parameter's dims through the select
            placeholder, perm = selected
        elif placeholder is None or (p in (aten.mm, aten.matmul) and len(shape_of(placeholder)) != 2):
            continue
        if grouped and piece is not None:
            continue  # some rows of each expert's weight: not a layout we split
        in_dim = 1 if grouped else (1 - out_dim if selected is not None else None)
        if perm is not None:
            out_dim = perm[out_dim]
            in_dim = perm[in_dim] if in_dim is not None else None
        if piece is not None and piece[0] != out_dim:
            continue  # a piece along the input features: no column split of it to derive
        bias_node, bias_piece = None, None
        if isinstance(bias, fx.Node):
            bias_node, _, bias_piece = _param_through_views(bias, captured)
            if bias_node is None or (bias_piece is not None and len(shape_of(bias_node)) != 1):
                continue  # a bias that is not a parameter (or rows of one): not a layer we know how to split
        wshape = list(shape_of(placeholder))
        if piece is not None:
            wshape[out_dim] = piece[2]
        found[node] = LinearMatch(
            node=node,
            input=x,
            weight=placeholder,
            weight_name=captured.param_of(placeholder),
            out_dim=out_dim,
            bias=bias_node,
            bias_name=captured.param_of(bias_node) if bias_node is not None else None,
            in_features=wshape[1 - out_dim if in_dim is None else in_dim],
            out_features=wshape[out_dim],
            weight_piece=piece[1:] if piece is not None else None,
            bias_piece=bias_piece[1:] if bias_piece is not None else None,
            in_dim=in_dim,
            per_group=grouped or selected is not None,
            input_dim=sides,
            output_dim=sides,
        )
    return found


def find_embeddings(captured: CapturedGraph) -> list[EmbeddingMatch]:
    found = []
    for node in captured.gm.graph.nodes:
        if node.op == "call_function" and packet(node) is aten.embedding:
            w = node.args[0]
            name = captured.param_of(w) if isinstance(w, fx.Node) else None
            if name:
                found.append(EmbeddingMatch(node, w, name, shape_of(w)[0]))
    return found


def find_norms(graph: fx.Graph) -> list[fx.Node]:
    """``layer_norm``/``rms_norm`` nodes and the ``rsqrt`` of a decomposed RMSNorm."""
    norms = []
    for node in graph.nodes:
        p = packet(node)
        if p in (aten.layer_norm, aten.rms_norm, aten.native_layer_norm):
            norms.append(node)
        elif p is aten.rsqrt and _is_rms_rsqrt(node):
            norms.append(node)
    return norms


def _is_rms_rsqrt(node: fx.Node) -> bool:
    add = node.args[0]
    if packet(add) is not aten.add:
        return False
    mean = add.args[0]
    if packet(mean) is not aten.mean:
        return False
    square = mean.args[0]
    return packet(square) is aten.pow and square.args[1] == 2 or (
        packet(square) is aten.mul and square.args[0] is square.args[1]
    )


def find_loss(graph: fx.Graph, head: fx.Node | None) -> fx.Node | None:
    if head is None:
        return None
    for node in forward_closure([head]):
        if packet(node) is aten.cross_entropy_loss:
            return node
    return None


def analyze(captured: CapturedGraph, tp: int, exits: Container[fx.Node] = ()) -> ModelAnalysis:
    """Find linears, regions, embeddings, head and loss; errors name what was not recognized.
    ``exits``: outputs returned split, which may read a region's split tensors."""
    graph = captured.gm.graph
    linears = find_linears(captured)
    derived = set(forward_closure(list(linears)))
    regions: list[Region] = []
    failures: dict[fx.Node, ShardingError] = {}
    indivisible: list[str] = []
    for node, lm in linears.items():
        if lm.weight_piece is not None:
            continue  # rows of a fused weight: split along its output features (a column) or not at all
        try:
            structure = trace_region(graph, lm, linears, derived, 1, exits)
        except ShardingError as err:
            failures[node] = err
            continue
        try:
            regions.append(trace_region(graph, lm, linears, derived, tp, exits))
        except ShardingError as err:
            workable = [c for c in range(1, 65) if walks(graph, lm, linears, derived, c)]
            indivisible.append(divisibility_message(structure, tp, err, workable))
    for node, err in list(failures.items()):
        if node not in failures or not isinstance(err, ReadOnItsFeatures):
            continue
        region = walk_with_inner_rows(graph, linears[node], err, linears, derived, tp, exits)
        if region is not None:
            regions.append(region)
            for lm in region.rows:
                failures.pop(lm.node, None)
    for group in rows_on_one_split(graph, [linears[n] for n in failures]):
        try:
            trace_region(graph, group, linears, derived, 1, exits)
            region = trace_region(graph, group, linears, derived, tp, exits)
        except ShardingError:
            continue  # each keeps its own reason
        regions.append(region)
        for lm in group:
            failures.pop(lm.node)
    if indivisible:  # every block that tp does not divide, at once
        raise ShardingError(indivisible[0] if len(indivisible) == 1 else
                            f"{len(indivisible)} blocks cannot be split over tp={tp}:\n  " + "\n  ".join(indivisible))
    regions = non_overlapping_regions(regions, failures)
    assigned = {lm.node for r in regions for lm in r.rows} | {c for r in regions for c in r.columns}
    seen_columns: set[fx.Node] = set()
    for r in regions:
        if seen_columns & set(r.columns):
            raise ShardingError(f"{describe(r.row.node)}: a column-parallel linear feeds two regions")
        seen_columns |= set(r.columns)
    leftovers = [lm for n, lm in linears.items() if n not in assigned]
    head = _pick_head([lm for lm in leftovers if lm.weight_piece is None])
    whole_ones: dict[str, list[LinearMatch]] = defaultdict(list)  # one note per parameter (experts: one per loop)
    for lm in leftovers:
        if lm is not head and lm.weight_piece is None:
            whole_ones[lm.weight_name].append(lm)
    notes = [
        f"the linear {describe(lms[0].node)} (parameter {name!r}"
        f"{f', and {len(lms) - 1} more linears reading it' if len(lms) > 1 else ''}) runs replicated on every rank: "
        f"it is neither column- nor row-parallel (as a row-parallel linear, {failures.get(lms[0].node, 'n/a')})"
        for name, lms in whole_ones.items()
    ]
    fused, kept_whole, read_whole_rows = _fused_parameters(linears, regions, notes, head)
    for region in regions:
        whole_ones = [n for n, spec in region.cuts if n in linears]
        if whole_ones:
            notes.append(f"{region.kind} block of {region.row.weight_name!r}: "
                         f"{', '.join(linears[n].weight_name for n in whole_ones)} run replicated and are cut "
                         f"(fewer heads than tp=" f"{tp}, or a split that cannot reach them)")
    _assign_layers(graph, regions)
    loss = find_loss(graph, head.node if head else None)
    embeddings = find_embeddings(captured)
    vocab = head.out_features if head else None
    vocab_embeddings = [
        e for e in embeddings
        if head is not None and (e.weight is head.weight or (e.num_embeddings == vocab and _reads_user_ids(e, captured)))
    ]
    dropouts = [n for n in graph.nodes if packet(n) is aten.dropout]
    return ModelAnalysis(
        param_bytes={captured.param_of(n): tensor_nbytes(n) for n in captured.state_placeholders
                     if captured.param_of(n) and not _tied_alias(n, captured)},
        whole_reasons=whole_reasons(captured, linears, regions, head, vocab_embeddings, failures, notes, kept_whole),
        seq_len=_query_length(graph),
        linears=linears,
        embeddings=embeddings,
        regions=regions,
        head=head,
        loss=loss,
        vocab_embeddings=vocab_embeddings,
        norms=find_norms(graph),
        dropouts=dropouts,
        notes=notes,
        fused=fused,
        kept_whole=kept_whole,
        read_whole_rows=read_whole_rows,
    )


def _tied_alias(node: fx.Node, captured: CapturedGraph) -> bool:
    """A tied tensor's name that nothing in the graph reads: its bytes are its other name's."""
    return not node.users and captured.param_of(node) in captured.tied


def _fused_parameters(linears: dict[fx.Node, LinearMatch], regions: list[Region],
                      notes: list[str], head: LinearMatch | None = None
                      ) -> tuple[dict[str, DimShard], set[str], dict[str, tuple[tuple[int, int], ...]]]:
    """The split of each parameter that linears read in pieces: every piece's column split, moved
    to where the piece starts. Such a parameter stays whole unless its pieces tile it, each read
    by column-parallel linears that split it alike, or by linears that run replicated (a
    multi-query projection's one K/V head: those rows are not in the split's segments, and are
    read whole), at least one piece split, and no linear reads it whole; then the
    linears reading it as their weight leave their regions (they run replicated, their
    outputs cut where the row-parallel linear reads them) and a note says why. Leaving a region
    can unsettle another parameter (the bias pieces of those linears): repeated until none does.
    Returns (the settled splits, the parameters kept whole, the rows of settled ones read whole)."""
    uses: dict[str, list[tuple[LinearMatch, tuple[int, int] | None, int, fx.Node]]] = defaultdict(list)
    for lm in linears.values():
        uses[lm.weight_name].append((lm, lm.weight_piece, lm.out_dim, lm.weight))
        if lm.bias_name:
            uses[lm.bias_name].append((lm, lm.bias_piece, 0, lm.bias))
    pieced = {name: found for name, found in uses.items() if any(piece is not None for _, piece, _, _ in found)}
    settled: dict[str, DimShard] = {}
    whole_rows: dict[str, tuple[tuple[int, int], ...]] = {}
    changed = True
    while changed:
        changed, settled, whole_rows = False, {}, {}
        columns = {c: spec for r in regions for c, spec in r.columns.items()}
        placed = set(columns) | {lm.node for r in regions for lm in r.rows} | ({head.node} if head else set())
        for name, found in pieced.items():
            spec, problem = _tile(found, columns, placed)
            if spec is not None:
                settled[name] = spec
                whole_rows[name] = _rows_outside(spec, shape_of(found[0][3])[spec.dim])
                continue
            for lm, _, _, node in found:
                for region in regions:
                    if node is lm.weight and lm.node in region.columns:
                        del region.columns[lm.node]
                        region.column_linears.pop(lm.node, None)
                        changed = True
            note = f"parameter {name!r}, read in pieces, stays whole on every rank: {problem}"
            if note not in notes:
                notes.append(note)
    return settled, set(pieced) - set(settled), {name: rows for name, rows in whole_rows.items() if rows}


def _rows_outside(spec: DimShard, size: int) -> tuple[tuple[int, int], ...]:
    """The runs of ``[0, size)`` in no segment of ``spec`` (rows read whole), as ``(start, length)``."""
    runs, at = [], 0
    for a, n in sorted(spec.segments):
        if a > at:
            runs.append((at, a - at))
        at = a + n
    if at < size:
        runs.append((at, size - at))
    return tuple(runs)


def _tile(found, columns: dict[fx.Node, DimShard], placed: Container[fx.Node] = ()) -> tuple[DimShard | None, str | None]:
    """(the parameter's split from its pieces' column splits, None) or (None, why there is none).
    A piece read by a linear that runs replicated (in no region: not in ``placed``) is read
    whole: its rows are in no segment of the split."""
    dims = {dim for _, _, dim, _ in found}
    if len(dims) != 1:
        return None, "its pieces are taken along different dims"
    (dim,) = dims
    size = shape_of(found[0][3])[dim]
    by_piece: dict[tuple[int, int], DimShard | None] = {}
    for lm, piece, _, _ in found:
        if piece is None:
            return None, f"{describe(lm.node)} reads all of it"
        if lm.node not in columns and lm.node in placed:
            return None, f"rows [{piece[0]}, {piece[0] + piece[1]}) are read by {describe(lm.node)}, which is not column-parallel"
        spec = columns.get(lm.node)  # None: read whole by a linear that runs replicated
        if piece in by_piece and (by_piece[piece] is None) != (spec is None):
            return None, f"rows [{piece[0]}, {piece[0] + piece[1]}) are read whole by one linear and split by another"
        if by_piece.setdefault(piece, spec) is not None and by_piece[piece].segments != spec.segments:
            return None, f"rows [{piece[0]}, {piece[0] + piece[1]}) are read by linears that split them differently"
    if all(spec is None for spec in by_piece.values()):
        first = next(lm for lm, _, _, _ in found)
        return None, f"rows [{found[0][1][0]}, {found[0][1][0] + found[0][1][1]}) are read by {describe(first.node)}, which is not column-parallel"
    segments, at = [], 0
    for (start, length), spec in sorted(by_piece.items()):
        if start != at:
            return None, f"rows [{min(at, start)}, {max(at, start)}) are read by no linear, or by two overlapping pieces"
        if spec is not None:
            segments.extend((start + a, n) for a, n in spec.segments)
        at = start + length
    if at != size:
        return None, f"rows [{at}, {size}) are read by no linear"
    return DimShard(dim, tuple(segments)), None


def _reads_user_ids(embedding: EmbeddingMatch, captured: CapturedGraph) -> bool:
    """Token ids come from a user input (maybe reshaped); positions are made in the graph."""
    node = embedding.node.args[1]
    while node.op == "call_function" and packet(node) in (aten.view, aten.reshape, aten.to, aten._to_copy, aten.contiguous):
        node = node.args[0]
    return node in captured.user_placeholders


def _query_length(graph: fx.Graph) -> int | None:
    """The sequence length as attention sees it: rows of the score matrix of the first attention
    (a fused kernel, or a softmax over a square-ish score matrix). A model with no attention
    (Mamba, the state-space halves of hybrids) has it as the length a short convolution slides
    over: a depthwise 1-D convolution's input ``[batch, channels, time]``."""
    for node in graph.nodes:
        if packet(node) is aten.scaled_dot_product_attention:
            return shape_of(node.args[0])[-2]
        if packet(node) in (aten.softmax, aten._softmax) and len(shape_of(node) or ()) >= 3:
            return shape_of(node)[-2]
    for node in graph.nodes:
        if packet(node) in (aten.convolution, aten.conv1d) and len(shape_of(node.args[1]) or ()) == 3 \
                and is_depthwise(node):
            return shape_of(node.args[0])[-1]
    return None


def _pick_head(leftovers: list[LinearMatch]) -> LinearMatch | None:
    """The head: the last leftover linear whose output reaches a cross-entropy, or else reaches a
    graph output through data movement only (logits returned as they are)."""
    def reaches_loss(lm: LinearMatch) -> bool:
        return any(packet(n) is aten.cross_entropy_loss for n in forward_closure([lm.node]))

    def returned(lm: LinearMatch) -> bool:
        stack, seen = [lm.node], set()
        while stack:
            node = stack.pop()
            for user in node.users:
                if user.op == "output":
                    return True
                if user not in seen and user.op == "call_function" and packet(user) in MOVES_ONLY:
                    seen.add(user)
                    stack.append(user)
        return False

    for test in (reaches_loss, returned):
        found = [lm for lm in leftovers if test(lm)]
        if found:
            return found[-1]
    return None


def _assign_layers(graph: fx.Graph, regions: list[Region]) -> None:
    position = {n: i for i, n in enumerate(graph.nodes)}
    regions.sort(key=lambda r: position[r.row.node])
    layer = -1
    for r in regions:
        if r.kind == "attention" or layer < 0:
            layer += 1
        r.layer = layer


def find_loss_output(captured: CapturedGraph, analysis: ModelAnalysis) -> fx.Node:
    """The graph output that is the loss: the cross-entropy the analysis found, or a scalar computed from it."""
    outputs = pytree.tree_leaves(captured.gm.graph.find_nodes(op="output")[0].args[0])
    if analysis.loss is not None:
        for out in outputs:
            if not isinstance(out, fx.Node):
                continue
            value = out.meta.get("val")
            if out is analysis.loss or (isinstance(value, torch.Tensor) and value.dim() == 0 and _reaches(analysis.loss, out)):
                return out
    raise ValueError(
        "pipeline parallelism trains on a loss the model computes, and this forward returns none "
        "(no cross-entropy of the head's logits among its outputs): pass the labels in example_inputs "
        "(e.g. labels= for HF models, targets for nanoGPT)"
    )


def _reaches(source: fx.Node, target: fx.Node) -> bool:
    stack, seen = [target], set()
    while stack:
        n = stack.pop()
        if n is source:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def parameter_placements(analysis: ModelAnalysis, tp: int) -> dict[str, ParamPlacement]:
    """The seeds of the placement propagation: column-parallel weights split along their output
    features (in the segments the region walk derived; a weight read in pieces, in its pieces'
    segments side by side), row-parallel weights along their input features, the vocabulary
    split for the head and the embeddings tied to it or reading token ids. Everything else is
    replicated."""
    placements: dict[str, ParamPlacement] = {}

    def place(name: str, placement: ParamPlacement) -> None:
        old = placements.get(name)
        if old is not None and old.spec != placement.spec:
            raise ShardingError(
                f"parameter {name!r} is used as {old.role} and as {placement.role}, which need "
                f"different splits ({old.spec} vs {placement.spec}); sptransform cannot shard it"
            )
        placements[name] = placement

    for region in analysis.regions:
        for column, spec in region.columns.items():
            lm = region.column_linears[column]
            whole_storage = not _has_dtensor_placement(spec)
            if lm.weight_piece is None:
                role = "column-parallel experts' weight" if lm.per_group else "column-parallel weight"
                place(lm.weight_name, ParamPlacement(spec.with_dim(lm.out_dim), role,
                                                     stored_whole=whole_storage))
            if lm.bias_name and lm.bias_piece is None:
                place(lm.bias_name, ParamPlacement(spec.with_dim(0), "column-parallel bias", stored_whole=whole_storage))
        for row in region.rows:
            place(row.weight_name, ParamPlacement(whole(row.weight_in_dim, row.in_features),
                                                  "row-parallel experts' weight" if row.per_group else "row-parallel weight"))
    for name, spec in analysis.fused.items():
        whole_rows = analysis.read_whole_rows.get(name, ())
        place(name, ParamPlacement(spec, "column-parallel, in pieces",
                                   stored_whole=bool(whole_rows) or not _has_dtensor_placement(spec)))
    head = analysis.head
    if head is not None:
        per_rank = -(-head.out_features // tp)
        padded = per_rank if head.out_features % tp else None
        vocab = DimShard(0, ((0, per_rank * tp),))
        place(head.weight_name, ParamPlacement(vocab.with_dim(head.out_dim), "vocab-parallel head", padded))
        if head.bias_name:
            place(head.bias_name, ParamPlacement(vocab, "vocab-parallel head bias", padded))
        for emb in analysis.vocab_embeddings:
            place(emb.weight_name, ParamPlacement(vocab, "vocab-parallel embedding", padded))
    for name in analysis.kept_whole:  # read in pieces that no split fits, and whole by a linear placed above
        placements.pop(name, None)
    return placements


def _has_dtensor_placement(spec: DimShard) -> bool:
    """One segment (``Shard``) or equal segments from 0 (``_StridedShard``)."""
    if len(spec.segments) == 1:
        return True
    length = spec.segments[0][1]
    return all(start == i * length and n == length for i, (start, n) in enumerate(spec.segments))


def constant_nodes(gm: fx.GraphModule, state: set[fx.Node]) -> set[fx.Node]:
    """Nodes computed from parameters, buffers and constants only, with no random draw."""
    from sptransform.graph.nodes import is_random

    constant: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node in state:
                constant.add(node)
        elif node.op == "get_attr":
            constant.add(node)
        elif node.op == "call_function" and not is_random(node):
            if all(a in constant for a in node.all_input_nodes):  # a factory (arange, zeros) too
                constant.add(node)
    return constant
