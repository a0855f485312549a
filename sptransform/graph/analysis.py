"""What each part of a captured graph *is*, read from dataflow and shapes alone.

* a **linear** is a matmul-like op (``linear``, ``addmm``, ``mm``, ``matmul``) one of
  whose operands is a parameter, possibly through ``t``/``transpose``/``permute``;
* an **embedding** is ``aten.embedding`` of a parameter;
* a **tensor-parallel region** pairs a row-parallel linear with the column-parallel
  linears feeding it: walking back from the row linear's input, asking at each op
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

Nothing here reads module paths or node names.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx as fx

from sptransform.capture import CapturedGraph
from sptransform.torch_internals import pytree
from sptransform.graph.sharding import (
    DimShard,
    NoRuleError,
    ShardingError,
    describe,
    input_specs_for_output,
    is_getitem,
    is_split,
    packet,
    shape_of,
    split_input_spec,
    whole,
)

aten = torch.ops.aten

_WEIGHT_VIEWS = {aten.t, aten.transpose, aten.permute, aten.alias, aten.detach}


@dataclass(frozen=True)
class LinearMatch:
    node: fx.Node
    input: fx.Node
    """The activation operand."""
    weight: fx.Node
    """The parameter placeholder."""
    weight_name: str
    out_dim: int
    """Dim of the parameter that indexes output features."""
    bias: fx.Node | None
    bias_name: str | None
    in_features: int
    out_features: int


@dataclass(frozen=True)
class EmbeddingMatch:
    node: fx.Node
    weight: fx.Node
    weight_name: str
    num_embeddings: int


@dataclass
class Region:
    """Column-parallel linears feeding one row-parallel linear."""

    row: LinearMatch
    columns: dict[fx.Node, DimShard]
    """Each column linear's node -> how its output features are split."""
    specs: dict[fx.Node, object]
    """Every node inside -> its output split (a list for ``split`` nodes)."""
    cuts: list[tuple[fx.Node, DimShard]]
    """Replicated tensors entering the region that are cut to the local part."""
    column_linears: dict[fx.Node, LinearMatch] = field(default_factory=dict)
    kind: Literal["attention", "mlp"] = "mlp"
    layer: int = 0


@dataclass
class ModelAnalysis:
    linears: dict[fx.Node, LinearMatch]
    embeddings: list[EmbeddingMatch]
    regions: list[Region]
    head: LinearMatch | None
    loss: fx.Node | None
    vocab_embeddings: list[EmbeddingMatch]
    norms: list[fx.Node] = field(default_factory=list)
    dropouts: list[fx.Node] = field(default_factory=list)
    seq_len: int | None = None
    """The attention's query length (None without attention)."""

    @property
    def num_layers(self) -> int:
        return 1 + max((r.layer for r in self.regions), default=-1)


# ---------------------------------------------------------------------------
# finders


def _param_through_views(node, captured: CapturedGraph):
    """If ``node`` is a parameter (maybe transposed), return (placeholder, dim permutation)."""
    perm = None
    while isinstance(node, fx.Node) and node.op == "call_function" and packet(node) in _WEIGHT_VIEWS:
        shape = shape_of(node)
        p = packet(node)
        if p in (aten.alias, aten.detach):
            step = list(range(len(shape)))
        elif p is aten.t or p is aten.transpose:
            step = list(range(len(shape)))
            a, b = (0, 1) if p is aten.t else [d % len(shape) for d in node.args[1:3]]
            step[a], step[b] = step[b], step[a]
        else:
            step = [d % len(shape) for d in node.args[1]]
        perm = step if perm is None else [step[i] for i in perm]
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "placeholder" and captured.param_of(node):
        return node, perm
    return None, None


def find_linears(captured: CapturedGraph) -> dict[fx.Node, LinearMatch]:
    """Every matmul-like op with a parameter operand."""
    found: dict[fx.Node, LinearMatch] = {}
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        p = packet(node)
        if p is aten.linear:
            x, w = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else None
            placeholder, perm = _param_through_views(w, captured)
            out_dim = 0
        elif p is aten.addmm:
            bias, x, w = node.args[:3]
            placeholder, perm = _param_through_views(w, captured)
            out_dim = 1
        elif p in (aten.mm, aten.matmul):
            x, w = node.args[:2]
            bias = None
            placeholder, perm = _param_through_views(w, captured)
            out_dim = 1
            if placeholder is not None and len(shape_of(placeholder)) != 2:
                placeholder = None
        else:
            continue
        if placeholder is None:
            continue
        if perm is not None:
            out_dim = perm[out_dim]
        bias_node = bias if isinstance(bias, fx.Node) and captured.param_of(bias) else None
        if isinstance(bias, fx.Node) and bias_node is None:
            continue  # a bias that is not a parameter: not a layer we know how to split
        wshape = shape_of(placeholder)
        found[node] = LinearMatch(
            node=node,
            input=x,
            weight=placeholder,
            weight_name=captured.param_of(placeholder),
            out_dim=out_dim,
            bias=bias_node,
            bias_name=captured.param_of(bias_node) if bias_node is not None else None,
            in_features=wshape[1 - out_dim],
            out_features=wshape[out_dim],
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
    for node in _forward_closure([head]):
        if packet(node) is aten.cross_entropy_loss:
            return node
    return None


def _forward_closure(starts) -> list[fx.Node]:
    seen, stack, order = set(), list(starts), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        stack.extend(n.users)
    return order


# ---------------------------------------------------------------------------
# regions


def trace_region(
    graph: fx.Graph, row: LinearMatch, linears: dict[fx.Node, LinearMatch], derived: set[fx.Node], tp: int
) -> Region:
    """Walk back from ``row``'s input; raise ``ShardingError`` if it is not a row-parallel linear."""
    x = row.input
    order = list(graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    pending: dict[fx.Node, DimShard] = {}
    chunk_pending: dict[fx.Node, dict[int, DimShard]] = defaultdict(dict)
    specs: dict[fx.Node, object] = {}
    columns: dict[fx.Node, DimShard] = {}
    cuts: list[tuple[fx.Node, DimShard]] = []

    def require(node: fx.Node, spec: DimShard) -> None:
        for _, length in spec.segments:
            if length % tp:
                raise ShardingError(f"{describe(node)}: a span of {length} along dim {spec.dim} cannot be split over tp={tp}")
        if node in pending and pending[node] != spec:
            raise ShardingError(f"{describe(node)} is needed split in two different ways")
        pending[node] = spec

    require(x, whole(len(shape_of(x)) - 1, shape_of(x)[-1]))
    for node in reversed(order[: position[x] + 1]):
        if is_split(node) and node in chunk_pending:
            spec = split_input_spec(node, chunk_pending.pop(node))
            specs[node] = spec
            if spec is not None:
                require(node.args[0], spec)
            continue
        if node not in pending:
            continue
        spec = pending.pop(node)
        if node in linears and node is not row.node:
            if spec.dim != len(shape_of(node)) - 1:
                raise ShardingError(f"{describe(node)}: needed split along a token dim, not its features")
            columns[node] = spec
            specs[node] = spec
            continue
        if node not in derived:
            if node.op == "placeholder" and _is_param(node):
                raise ShardingError(f"parameter {node.name} would have to be split along dim {spec.dim}")
            cuts.append((node, spec))
            continue
        specs[node] = spec
        if is_getitem(node):
            if not is_split(node.args[0]):
                raise ShardingError(f"{describe(node.args[0])} cannot run on a split input")
            chunk_pending[node.args[0]][node.args[1]] = spec
            continue
        for arg, arg_spec in input_specs_for_output(node, spec, tp):
            if arg_spec is not None:
                require(arg, arg_spec)
    if pending:
        raise ShardingError(f"{describe(next(iter(pending)))} could not be reached walking back")
    if not columns:
        raise ShardingError(f"{describe(row.node)}: no column-parallel linear feeds it")
    inside = set(specs) | {row.node}
    for node in specs:
        for user in node.users:
            if user not in inside:
                raise ShardingError(
                    f"{describe(node)} is used outside the tensor-parallel region by {describe(user)}"
                )
    kind = "attention" if any(
        packet(n) in (aten.scaled_dot_product_attention, aten.softmax, aten._softmax) for n in specs
    ) else "mlp"
    return Region(
        row=row, columns=columns, specs=specs, cuts=cuts, kind=kind,
        column_linears={n: linears[n] for n in columns},
    )


def _is_param(node: fx.Node) -> bool:
    return bool(node.meta.get("sptransform_param"))


def analyze(captured: CapturedGraph, tp: int) -> ModelAnalysis:
    """Find linears, regions, embeddings, head and loss; errors name what was not recognized."""
    graph = captured.gm.graph
    for node in captured.state_placeholders:
        if captured.param_of(node):
            node.meta["sptransform_param"] = captured.param_of(node)
    linears = find_linears(captured)
    derived = set(_forward_closure(list(linears)))
    regions: list[Region] = []
    failures: dict[fx.Node, ShardingError] = {}
    for node, lm in linears.items():
        try:
            structure = trace_region(graph, lm, linears, derived, 1)
        except ShardingError as err:
            failures[node] = err
            continue
        try:
            regions.append(trace_region(graph, lm, linears, derived, tp))
        except ShardingError as err:
            raise ShardingError(_divisibility_message(graph, lm, linears, derived, tp, structure, err)) from None
    assigned = {r.row.node for r in regions} | {c for r in regions for c in r.columns}
    seen_columns: set[fx.Node] = set()
    for r in regions:
        if seen_columns & set(r.columns):
            raise ShardingError(f"{describe(r.row.node)}: a column-parallel linear feeds two regions")
        seen_columns |= set(r.columns)
    leftovers = [lm for n, lm in linears.items() if n not in assigned]
    head = _pick_head(leftovers)
    unrecognized = [lm for lm in leftovers if lm is not head]
    if unrecognized:
        # Prefer a linear whose walk failed on an op over one that merely hit a norm.
        lm = min(unrecognized, key=lambda m: not isinstance(failures.get(m.node), NoRuleError))
        raise ShardingError(
            f"the linear {describe(lm.node)} (parameter {lm.weight_name!r}) was not recognized as "
            f"column- or row-parallel: as a row-parallel linear, {failures.get(lm.node, 'n/a')}"
        )
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
        seq_len=_query_length(regions),
        linears=linears,
        embeddings=embeddings,
        regions=regions,
        head=head,
        loss=loss,
        vocab_embeddings=vocab_embeddings,
        norms=find_norms(graph),
        dropouts=dropouts,
    )


def _reads_user_ids(embedding: EmbeddingMatch, captured: CapturedGraph) -> bool:
    """Token ids come from a user input (maybe reshaped); positions are made in the graph."""
    node = embedding.node.args[1]
    while node.op == "call_function" and packet(node) in (aten.view, aten.reshape, aten.to, aten._to_copy, aten.contiguous):
        node = node.args[0]
    return node in captured.user_placeholders


def _divisibility_message(graph, lm, linears, derived, tp, structure: Region, err) -> str:
    workable = []
    for candidate in range(1, 65):
        try:
            trace_region(graph, lm, linears, derived, candidate)
            workable.append(candidate)
        except ShardingError:
            pass
    return (
        f"tp={tp} does not divide the {_sizes(structure)} of the {structure.kind} block whose output "
        f"projection is {structure.row.weight_name!r} ({err}); use tp in {{{', '.join(map(str, workable))}}}"
    )


def _sizes(region: Region) -> str:
    """What the split must divide, in the user's words: heads or MLP width."""
    for node in region.specs:
        if packet(node) is aten.scaled_dot_product_attention:
            q, k = node.args[:2]
            return f"{shape_of(q)[-3]} attention heads / {shape_of(k)[-3]} K/V heads"
        if packet(node) in (aten.softmax, aten._softmax):
            return f"{shape_of(node)[-3]} attention heads (or their K/V heads)"
    return f"MLP width {region.row.in_features}"


def _query_length(regions: list[Region]) -> int | None:
    """The sequence length as attention sees it: rows of the score matrix."""
    for region in regions:
        for node in region.specs:
            if packet(node) is aten.scaled_dot_product_attention:
                return shape_of(node.args[0])[-2]
            if packet(node) in (aten.softmax, aten._softmax):
                return shape_of(node)[-2]
    return None


def _pick_head(leftovers: list[LinearMatch]) -> LinearMatch | None:
    """The head is the last leftover linear whose output is not consumed by another linear."""
    if not leftovers:
        return None
    return max(leftovers, key=lambda lm: lm.out_features)


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
