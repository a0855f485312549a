"""Tensor-parallel rewrite: make the graph run on local shards, as ``graph.propagate`` placed it.

Each rewrite follows from a placement, not from the op's role in the model:

* a node whose output is split gets local size arguments (``view``, ``reshape``, ``expand``,
  ``split``; ``localize``);
* a mean over a split dim has its input scaled by 1/tp (each rank's mean of its part, a partial
  sum of the whole mean);
* an embedding reading a vocabulary-split weight becomes ``vocab_parallel_embedding`` (a
  partial sum: each rank looks up the ids it holds), a cross-entropy of vocabulary-split
  logits ``vocab_parallel_cross_entropy``; a vocabulary tp does not divide is padded;
* every edge where a reader needs another placement than its input has gets one
  redistribution, shared by all readers wanting the same:

      partial -> replicated      reduce_from_tp  (f̄: all-reduce; backward identity)
      partial -> split           scatter_seq     (ḡ: reduce-scatter; backward all-gather)
      split   -> replicated      gather_seq      (g: all-gather; backward reduce-scatter) when every
                                                  reader sends back a partial sum, else gather_output
                                                  (backward keeps the local slice)
      replicated -> split        take_local      (a cut; backward puts the gradient in place)

  Splits of several segments (a fused ``[q|k|v]``, tokens merged with the batch) are gathered
  and scattered through a permutation into rank order;
* the gradient reductions ``graph.gradients`` found: an f (``copy_to_tp``) for readers that
  send back partial sums, and one bucketed ``sync_grads`` per layer for parameters whose
  whole gradient is partial;
* outputs split along their last dim (vocabulary-parallel logits) are returned as DTensors
  (``plan.output_specs``), with the padding of an uneven vocabulary dropped.

    before:  h = layer_norm(x); q = linear(h, Wq); ...; o = linear(a, Wo); y = add(o, b); r = add(x, y)
    after:   h = layer_norm(x_s); hg = gather_seq(h, 1); q = linear(hg, Wq_r); ...(local heads)...;
             o = linear(a_r, Wo_r); os = scatter_seq(o, 1); y = add(os, b); r = add(x_s, y)

The finders only match: ``find_local_rewrite`` (which rewrite a node's placement asks for) and
``find_redistributions`` (which inputs need another placement, for which readers);
``apply_placements`` rewrites what they found. Edits ``gm`` in place; reads
``node.meta["val"]``, which keeps global shapes; writes ``node.meta["sptransform_spec"]`` (the
split) on every node whose output is split.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

from sptransform.graph.gradients import GradientPlan
from sptransform.graph.placement import PARTIAL, REPLICATED, DimShard, ParamPlacement
from sptransform.graph.plan import ParallelPlan
from sptransform.graph.propagate import Propagation, move_kind
from sptransform.graph.rules import ShardingError, is_split, local_slice_bounds, slice_bounds
from sptransform.graph.nodes import data_dependent, describe, packet, routes, shape_of, size_of
from sptransform.torch_internals import op_schema
from sptransform.passes.base import insert_bucket
from sptransform.passes.localize import index_table, localize, localize_split
from sptransform.runtime.collectives import copy_to_tp, gather_output, gather_seq, reduce_from_tp, scatter_seq, sync_grads
from sptransform.runtime.ops import (
    narrow_vocab, pad_last, pad_rows, take_local, vocab_parallel_cross_entropy, vocab_parallel_embedding,
)

aten = torch.ops.aten


def add_rank_input(gm: fx.GraphModule) -> fx.Node:
    """A 0-dim int64 placeholder ``tp_rank``, after the last placeholder."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        rank = gm.graph.placeholder("tp_rank")
    rank.meta["val"] = None
    return rank


def apply_placements(
    gm: fx.GraphModule,
    prop: Propagation,
    grads: GradientPlan,
    plan: ParallelPlan,
    *,
    params: dict[fx.Node, str],
    layer_rows: list[tuple[fx.Node, int]],
) -> fx.GraphModule:
    """Rewrite ``gm`` to run on local shards (see module docstring). ``params``: parameter
    placeholders -> FQN; ``layer_rows``: (row-parallel linear, its layer) for gradient buckets."""
    originals = [n for n in gm.graph.nodes]
    _pad_vocabulary(gm, prop, plan, params)
    for node in originals:
        if node.op == "call_function":
            _localize(gm, node, prop, plan)
    moved = _redistribute(gm, prop, grads, plan)
    check_local_shapes(gm, prop, [n for n in originals if n.op == "call_function"], plan)
    _add_fs(gm, grads, moved, plan)
    _bucket_parameters(gm, grads.partial_params, params, plan, layer_rows)
    _outputs(gm, prop, plan)
    gm.graph.lint()
    gm.recompile()
    return gm


# ---------------------------------------------------------------------------
# the safety net


def _local_value(value, placement, tp: int):
    """A fake tensor of the local shape ``placement`` gives ``value`` (a global fake tensor)."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = [size_of(s) for s in value.shape]
    if isinstance(placement, DimShard):
        shape[placement.dim] = placement.local_size(tp)
    return torch.empty(shape, dtype=value.dtype, device=value.device)


def check_local_shapes(gm: fx.GraphModule, prop: Propagation, nodes: list[fx.Node], plan: ParallelPlan) -> None:
    """Run each op of ``nodes`` alone on fake tensors of the local shapes its inputs have after the
    rewrite, and compare its output with the local shape its placement promises. An op whose
    size arguments still hold global sizes fails here, by name, instead of computing on the
    wrong elements. Raises ``ShardingError`` listing every such op."""
    from sptransform.torch_internals import FakeTensorMode, maybe_disable_local_tensor_mode

    def placement_of(n: fx.Node):
        if n in prop.placement:
            return prop.placement[n]
        return n.meta.get("sptransform_spec", REPLICATED)  # a redistribution: its target

    problems = []
    with maybe_disable_local_tensor_mode(), FakeTensorMode(allow_non_fake_inputs=True):
        for node in nodes:
            expected = prop.placement.get(node)
            if expected is None or node.target in _SKIP_SHAPE_CHECK or routes(node):
                continue  # routing: whole on every rank (propagation), no fake run without a shape env
            if data_dependent(node) and not any(_splits(placement_of(a)) for a in (node, *node.all_input_nodes)):
                continue  # no split read or made: local shapes are global ones, nothing to check (and a run-time
                # size's stand-in, which knows nothing of sums of such sizes that equal a static one, might
                # not even run it)
            # Sizes known only at run time (the rows routed to an expert) run as their stand-ins.

            def local(a):
                if not isinstance(a, fx.Node):
                    return a
                if a.op == "get_attr":
                    return getattr(gm, a.target)
                if a is plan.rank:
                    return torch.zeros((), dtype=torch.long)
                value = a.meta.get("val")
                if isinstance(value, (tuple, list)):
                    return [_local_value(v, p, plan.tp) for v, p in zip(value, placement_of(a))]
                if isinstance(value, torch.SymInt):
                    return size_of(value)
                return _local_value(value, placement_of(a), plan.tp)

            try:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), local)
                args = _split_on_stand_ins(node, args)
                out = node.target(*args, **kwargs)
            except Exception as err:  # the op cannot even run on the local shapes
                problems.append(f"{describe(node)}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                continue
            values = out if isinstance(out, (tuple, list)) else [out]
            wanted = expected if isinstance(expected, tuple) else [expected]
            globals_ = node.meta.get("val")
            globals_ = globals_ if isinstance(globals_, (tuple, list)) else [globals_]
            for got, placement, value in zip(values, wanted, globals_):
                if not isinstance(got, torch.Tensor) or not isinstance(value, torch.Tensor):
                    continue
                want = list(_local_value(value, placement, plan.tp).shape)
                if list(got.shape) != want:
                    why = ("a size argument sptransform does not localize" if _has_size_argument(node) else
                           "the placement rule for this op disagrees with what the op computes: a bug in "
                           "sptransform's rule, please report it; sp=False or another tp may avoid it")
                    problems.append(f"{describe(node)}: its local output has shape {list(got.shape)}, its placement "
                                    f"{placement} needs {want} ({why})")
                    break  # one line per op, not one per output
    if problems:
        raise ShardingError("the parallel graph would compute on wrong shapes; no rule covers:\n  " + "\n  ".join(problems))


def _resized(x: torch.Tensor, d: int, size) -> torch.Tensor:
    shape = list(x.shape)
    shape[d % x.dim()] = size
    return x.new_empty(shape)


def _splits(placement) -> bool:
    if isinstance(placement, (tuple, list)):
        return any(_splits(p) for p in placement)
    return isinstance(placement, DimShard)


def _split_on_stand_ins(node: fx.Node, args: tuple) -> tuple:
    """Run-time sizes that add up to a static one (tokens cut into per-expert groups and laid
    back): on the stand-ins they no longer add up, so ``split_with_sizes(x, [u0, u1, u2])``
    runs on ``x`` resized along the split dim to their sum, and ``index_add(x, d, ids, rows)``
    on ``rows`` resized along ``d`` to the number of ids. The dims the check is about (the
    others) are untouched."""
    if not data_dependent(node):
        return args
    if packet(node) is aten.split_with_sizes:
        x, sizes, *rest = args
        d = rest[0] if rest else node.kwargs.get("dim", 0)
        return (_resized(x, d, sum(sizes)), sizes, *rest)
    if packet(node) is aten.index_add:
        x, d, ids, rows, *rest = args
        return (x, d, ids, _resized(rows, d, ids.numel()), *rest)
    return args


def _has_size_argument(node: fx.Node) -> bool:
    """Whether the op takes sizes (``view``'s shape, ``expand``'s sizes, ``split``'s lengths): a list of
    ints among its arguments, or a single int it reads as a size."""
    schema = op_schema(node.target)
    if schema is None:
        return False
    return any(str(a.type) in ("List[int]", "int", "Optional[int]") and not a.name.startswith("dim")
               for a in schema.arguments)


_SKIP_SHAPE_CHECK = (narrow_vocab,)  # rank-dependent width: checked by the output's DTensor


# ---------------------------------------------------------------------------
# local shapes, vocabulary


def _pad_vocabulary(gm: fx.GraphModule, prop: Propagation, plan: ParallelPlan, params: dict[fx.Node, str]) -> None:
    """A vocabulary tp does not divide: the last ranks' shards are padded to equal rows."""
    for node, name in params.items():
        placement = plan.placements.get(name)
        if placement is None or placement.padded_rows is None:
            continue
        users = list(node.users)
        dim = placement.spec.dim
        pad = pad_last if dim == len(shape_of(node)) - 1 else pad_rows  # a 1-D bias pads its only dim
        with gm.graph.inserting_after(_after_placeholders(gm, node)):
            padded = gm.graph.call_function(pad, (node, placement.padded_rows))
        padded.meta["val"] = node.meta.get("val")
        prop.placement[padded] = prop.placement[node]
        for user in users:
            user.replace_input_with(node, padded)
            reads = prop.reads.get(user)
            if reads is not None and node in reads:
                reads[padded] = reads.pop(node)


LocalRewrite = Literal["vocab_embedding", "vocab_loss", "fused_slice", "split", "local_sizes"]


def find_local_rewrite(node: fx.Node, prop: Propagation) -> LocalRewrite | None:
    """Which rewrite ``node`` needs to run on local shards, from its placement and the
    placements it reads (matching only; ``_localize`` rewrites):

    * ``vocab_embedding``: an embedding reading a vocabulary-split weight, its output partial;
    * ``vocab_loss``: a cross-entropy of vocabulary-split logits;
    * ``fused_slice``: a slice along the split dim of its input (a piece of a fused weight);
    * ``split``: a ``split`` of a split input (several outputs);
    * ``local_sizes``: any other op with a split output (its size arguments, if any, go local).
    """
    out = prop.placement.get(node)
    reads = prop.reads.get(node, {})
    p = packet(node)
    first = reads.get(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    if p is aten.embedding and isinstance(first, DimShard) and out == PARTIAL:
        return "vocab_embedding"
    if p is aten.cross_entropy_loss and isinstance(first, DimShard):
        return "vocab_loss"
    if p is aten.slice and isinstance(first, DimShard) and first.dim == slice_bounds(node)[0]:
        return "fused_slice"
    if p is aten.mean and isinstance(first, DimShard) and out == PARTIAL:
        return "partial_mean"
    if isinstance(out, tuple):
        return "split" if is_split(node) and isinstance(first, DimShard) else None
    return "local_sizes" if isinstance(out, DimShard) else None


def _localize(gm: fx.GraphModule, node: fx.Node, prop: Propagation, plan: ParallelPlan) -> None:
    kind = find_local_rewrite(node, prop)
    if kind == "vocab_embedding":
        _vocab_embedding(node, plan)
    elif kind == "vocab_loss":
        _vocab_loss(node, plan)
    elif kind == "fused_slice":  # a piece of a fused dim: its bounds in the local tensor
        spec = prop.reads[node][node.args[0]]
        d, start, end, step = slice_bounds(node)
        if step != 1:  # every k-th from start to the end (geometry.strided_slice_step): the same on each part
            local_start, local_end = start, sum(n // plan.tp for _, n in spec.segments)
        else:
            local_start, local_end = local_slice_bounds(spec, start, end, plan.tp)
        node.args = (node.args[0], d, local_start, local_end, step)
        node.kwargs = {}
        node.meta["sptransform_spec"] = prop.placement.get(node)
    elif kind == "split":
        localize_split(node, prop.reads[node][node.args[0]], plan.tp)
    elif kind == "partial_mean":
        _partial_mean(gm, node, prop, plan.tp)
    elif kind == "local_sizes":
        localize(node, prop.placement[node], plan.tp)


def _partial_mean(gm: fx.GraphModule, node: fx.Node, prop: Propagation, tp: int) -> None:
    """A mean over a split dim: each rank averages its 1/tp of the elements, so the mean is the
    sum over ranks of the local means divided by tp; the input is scaled (exact for a power-of-2
    tp) so the op's output is that partial sum, reduced where it is read:

        before:  m = mean(x, [-1], True)             # x split along -1; m: partial
        after:   xs = div(x, tp); m = mean(xs, [-1], True)
    """
    x = node.args[0]
    spec = prop.reads[node][x]
    with gm.graph.inserting_before(node):
        scaled = gm.graph.call_function(aten.div.Tensor, (x, tp))
    scaled.meta["val"] = x.meta.get("val")
    scaled.meta["sptransform_spec"] = spec
    prop.placement[scaled] = spec
    prop.reads[scaled] = {x: spec}
    node.args = (scaled, *node.args[1:])
    prop.reads[node] = {scaled: spec}


def _vocab_embedding(node: fx.Node, plan: ParallelPlan) -> None:
    args = list(node.args) + [None] * (5 - len(node.args))
    weight, ids, padding_idx, scale_grad_by_freq, sparse = args[:5]
    if scale_grad_by_freq or sparse:
        raise ShardingError(f"{describe(node)}: an embedding with scale_grad_by_freq or sparse=True cannot be "
                            "split along its vocabulary; use dense gradients without frequency scaling")
    padding_idx = -1 if padding_idx is None else padding_idx
    node.target = vocab_parallel_embedding
    node.args = (weight, ids, plan.rank, plan.vocab_per_rank, padding_idx)
    node.kwargs = {}


def _vocab_loss(node: fx.Node, plan: ParallelPlan) -> None:
    args = list(node.args) + [None] * (6 - len(node.args))
    logits, target, weight, reduction, ignore_index, smoothing = args[:6]
    reduction = node.kwargs.get("reduction", 1 if reduction is None else reduction)
    ignore_index = node.kwargs.get("ignore_index", -100 if ignore_index is None else ignore_index)
    node.target = vocab_parallel_cross_entropy
    node.args = (logits, target, plan.rank, plan.vocab_per_rank, plan.vocab, ignore_index, reduction, plan.group)
    node.kwargs = {}


# ---------------------------------------------------------------------------
# redistributions


def _after_placeholders(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """Where to insert after ``node``: placeholders stay together, so after the last one."""
    if node.op != "placeholder":
        return node
    return [n for n in gm.graph.nodes if n.op == "placeholder"][-1]


@dataclass(frozen=True)
class Redistribution:
    """An input whose readers need another placement than it has: one collective or cut."""

    node: fx.Node
    have: object
    want: object
    readers: tuple[fx.Node, ...]

    @property
    def kind(self) -> str:
        """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``cut`` or ``all_to_all`` (``move_kind``)."""
        return move_kind(self.have, self.want)


def find_redistributions(prop: Propagation) -> list[Redistribution]:
    """Every (input, wanted placement) some reader needs, with all readers wanting it (matching
    only; ``_redistribute`` inserts the collectives)."""
    groups: dict[tuple[fx.Node, object], list[fx.Node]] = defaultdict(list)
    for user, reads in prop.reads.items():
        for node, want in reads.items():
            if want is not None and prop.placement.get(node) != want:
                groups[(node, want)].append(user)
    return [Redistribution(node, prop.placement[node], want, tuple(users)) for (node, want), users in groups.items()]


def _redistribute(gm: fx.GraphModule, prop: Propagation, grads: GradientPlan, plan: ParallelPlan) -> dict:
    """One collective or cut per redistribution; returns {(input, wanted): new node}."""
    moved = {}
    for r in find_redistributions(prop):
        new = _move(gm, r, grads, plan)
        moved[(r.node, r.want)] = new
        for user in r.readers:
            user.replace_input_with(r.node, new)
    return moved


def _move(gm: fx.GraphModule, r: Redistribution, grads: GradientPlan, plan: ParallelPlan) -> fx.Node:
    node, have, want, kind = r.node, r.have, r.want, r.kind
    graph = gm.graph
    at = _after_placeholders(gm, node)
    value = node.meta.get("val")

    def emit(target, args, after, spec=None) -> fx.Node:
        with graph.inserting_after(after):
            new = graph.call_function(target, args)
        new.meta["val"] = value
        if spec is not None:
            new.meta["sptransform_spec"] = spec
        return new

    if kind == "all_reduce":
        return emit(reduce_from_tp, (node, plan.group), at)
    if kind == "reduce_scatter" and isinstance(want, DimShard):
        ordered = _to_rank_order(gm, node, want, plan, at)
        return emit(scatter_seq, (ordered, want.dim, plan.group), ordered, want)
    if kind == "all_gather" and isinstance(have, DimShard):
        return _gather(gm, node, have, grads.gather_backward.get(node, "slice"), plan, at)
    if kind == "cut" and isinstance(want, DimShard):
        table = index_table(gm, at, want, plan.tp)
        return emit(take_local, (node, want.dim, table, plan.rank), table, want)
    if not (kind == "all_to_all" and isinstance(have, DimShard) and isinstance(want, DimShard)):
        raise AssertionError(f"no move from {have} to {want} ({node.name})")
    # One split to another (an all-to-all): gather, then cut. The cut sends back a partial
    # sum, so the gather's backward reduce-scatters it.
    full = _gather(gm, node, have, "reduce_scatter", plan, at)
    table = index_table(gm, full, want, plan.tp)
    return emit(take_local, (full, want.dim, table, plan.rank), table, want)


def _rank_order(spec: DimShard, tp: int) -> list[int]:
    """Global indices along the split dim in the order an all-gather concatenates the shards."""
    return [i for r in range(tp) for i in spec.indices(r, tp)]


def _register(gm: fx.GraphModule, values: list[int], after: fx.Node) -> fx.Node:
    name = f"_sptransform_order_{sum(1 for n in gm.graph.nodes if n.op == 'get_attr')}"
    while hasattr(gm, name):
        name += "_"
    gm.register_buffer(name, torch.tensor(values, dtype=torch.long), persistent=False)
    with gm.graph.inserting_after(after):
        return gm.graph.get_attr(name)


def _to_rank_order(gm: fx.GraphModule, node: fx.Node, spec: DimShard, plan: ParallelPlan, at: fx.Node) -> fx.Node:
    """A full-shape tensor reordered along ``spec.dim`` so that rank r's indices are the r-th chunk
    (what a reduce-scatter hands out); ``node`` itself for a one-segment split."""
    size = shape_of(node)[spec.dim]
    order = _rank_order(spec, plan.tp)
    if order == list(range(size)):
        return node
    by_view = _swap_segments(gm, node, spec, (len(spec.segments), plan.tp), at)
    if by_view is not None:
        return by_view
    table = _register(gm, order, at)
    with gm.graph.inserting_after(table):
        ordered = gm.graph.call_function(aten.index_select.default, (node, spec.dim, table))
    ordered.meta["val"] = node.meta.get("val")
    return ordered


def _swap_segments(gm: fx.GraphModule, node: fx.Node, spec: DimShard, outer: tuple[int, int],
                   after: fx.Node) -> fx.Node | None:
    """Global order to rank order (``outer`` = (segments, tp)) or back (``outer`` = (tp,
    segments)) as ``flatten(transpose(unflatten(x, dim, (*outer, part)), dim, dim + 1))``, when the
    segments are equal and tile the dim (tokens merged with the batch, a fused ``[q|k|v]``);
    ``None`` otherwise (the caller permutes through an index). A transpose's backward is a
    transpose; ``index_select``'s is ``index_put`` into a zero-filled buffer, one ``fill`` per
    reorder and step (measured: 16 per step in a 4-layer GPT-2 with ``sp=True``, tp=2)."""
    lengths = {length for _, length in spec.segments}
    if len(lengths) != 1 or [start for start, _ in spec.segments] != [k * min(lengths) for k in range(len(spec.segments))]:
        return None
    part = min(lengths) // (outer[0] * outer[1] // len(spec.segments))
    dim, x = spec.dim, node
    steps = ((aten.unflatten.int, (dim, [*outer, part])), (aten.transpose.int, (dim, dim + 1)),
             (aten.flatten.using_ints, (dim, dim + 2)))
    for target, rest in steps:
        with gm.graph.inserting_after(after):
            new = gm.graph.call_function(target, (x, *rest))
        value = x.meta.get("val")
        if value is not None:
            new.meta["val"] = target(value, *rest)
        x = after = new
    return x


def _gather(gm: fx.GraphModule, node: fx.Node, spec: DimShard, backward: str, plan: ParallelPlan, at: fx.Node) -> fx.Node:
    """All-gather a split tensor to its full value (in global order, padding dropped)."""
    graph = gm.graph
    with graph.inserting_after(at):
        if backward == "reduce_scatter":
            gathered = graph.call_function(gather_seq, (node, spec.dim, plan.group))
        else:
            gathered = graph.call_function(gather_output, (node, spec.dim, plan.rank, plan.group))
    gathered.meta["val"] = node.meta.get("val")
    size = shape_of(node)[spec.dim]
    order = _rank_order(spec, plan.tp)
    if order == list(range(size)):
        return gathered
    by_view = _swap_segments(gm, gathered, spec, (plan.tp, len(spec.segments)), gathered)
    if by_view is not None:
        return by_view
    position = {index: i for i, index in enumerate(order)}
    table = _register(gm, [position[i] for i in range(size)], gathered)
    with graph.inserting_after(table):
        restored = graph.call_function(aten.index_select.default, (gathered, spec.dim, table))
    restored.meta["val"] = node.meta.get("val")
    return restored


# ---------------------------------------------------------------------------
# gradient reductions


def _add_fs(gm: fx.GraphModule, grads: GradientPlan, moved: dict, plan: ParallelPlan) -> None:
    """An f (identity forward, all-reduce backward) in front of the readers that send back
    partial sums. A reader that reads through a cut: the f goes in front of the cut."""
    for node, readers in grads.f_edges.items():
        _f_for(gm, node, readers, moved, plan)
    for node, readers in grads.gathered_f_edges.items():
        _f_for(gm, moved[(node, REPLICATED)], readers, moved, plan)
    for node, readers in grads.reduced_f_edges.items():
        _f_for(gm, moved[(node, REPLICATED)], readers, moved, plan)


def _f_for(gm: fx.GraphModule, node: fx.Node, readers: list[fx.Node], moved: dict, plan: ParallelPlan) -> None:
    with gm.graph.inserting_after(_after_placeholders(gm, node)):
        f = gm.graph.call_function(copy_to_tp, (node, plan.group))
    f.meta["val"] = node.meta.get("val")
    cuts = {new: src for (src, _), new in moved.items() if src is node}
    for reader in readers:
        if node in reader.all_input_nodes:
            reader.replace_input_with(node, f)
            continue
        for cut, _ in cuts.items():
            if cut in reader.all_input_nodes:
                cut.replace_input_with(node, f)


def _bucket_parameters(gm: fx.GraphModule, partial: list[fx.Node], params: dict[fx.Node, str], plan: ParallelPlan,
                       layer_rows: list[tuple[fx.Node, int]]) -> None:
    """One ``sync_grads`` per layer for the parameters whose whole gradient is partial: identity
    forward, one all-reduce of the bucket's gradients backward. A parameter belongs to the layer
    of the first row-parallel linear after its first use; those used after the last one (the
    final norm) share one more bucket."""
    if not partial:
        return
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    rows = sorted((position[r], layer) for r, layer in layer_rows if r in position)
    buckets: dict[int, list[fx.Node]] = defaultdict(list)
    for param in sorted(partial, key=lambda p: position[p]):
        first_use = min(position[u] for u in param.users)
        layer = next((layer for pos, layer in rows if pos > first_use), rows[-1][1] + 1 if rows else 0)
        buckets[layer].append(param)
        plan.sync_params[params[param]] = layer
    for layer, members in sorted(buckets.items()):
        first_user = min((u for p in members for u in p.users), key=lambda u: position[u])
        users = {p: list(p.users) for p in members}
        with gm.graph.inserting_before(first_user):
            insert_bucket(gm, sync_grads, (plan.group, *members), {"overlap": plan.overlap}, members, users)


# ---------------------------------------------------------------------------
# outputs


def _outputs(gm: fx.GraphModule, prop: Propagation, plan: ParallelPlan) -> None:
    """Outputs still split (along their last dim) are returned as DTensors; an uneven
    vocabulary's padding is dropped first."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    flat = list(output.args[0])
    for i, value in enumerate(flat):
        if not isinstance(value, fx.Node):
            continue
        spec = prop.placement.get(value)
        if not isinstance(spec, DimShard):
            continue
        size = shape_of(value)[spec.dim]
        padded = sum(n for _, n in spec.segments)
        if padded != size:
            with gm.graph.inserting_before(output):
                narrowed = gm.graph.call_function(narrow_vocab, (value, padded // plan.tp, size, plan.static_rank))
            narrowed.meta["val"] = value.meta.get("val")
            flat[i] = narrowed
        plan.output_specs[i] = (spec, size)
    output.args = (tuple(flat),)


__all__ = ["ParamPlacement", "Redistribution", "add_rank_input", "apply_placements", "find_local_rewrite",
           "find_redistributions"]
