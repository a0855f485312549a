"""Activation memory measured on a partitioned graph, and the paper's formulas beside it.

``memory_report(fw, bw, ...)`` reads what the forward graph returns for the
backward, keeps one entry per storage (a saved view keeps its base alive; two views
of one base count once), leaves out parameters and views of parameters, and
attributes each storage to a layer and a region (``regions.REGIONS``). It also
replays the backward graph's allocation order to find the peak of live activation
bytes during backward: saved tensors until their last use, every tensor the
backward computes (recomputed values and activation gradients) from its op until
its last use; gradients of parameters are counted apart (``param_grad_bytes``).

``paper_layer_bytes`` is Korthikanti et al.'s Table 2 for one layer, split by the
same regions (its text: each norm keeps its 2sbh input; Q/K/V projection input 2,
Q and K 4, V 2, output projection input 2; MLP inputs 2 and 8, GELU input 8;
softmax output and dropout output 2as/h each, masks 1 byte per element), for any
element size ``e`` (the paper's 16-bit case is e=2: 34 = 16e + 2 mask bytes).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.fx as fx

from sptransform.planner.presets import ModelShape

from sptransform.graph.regions import REGIONS, classify_regions
from sptransform.torch_internals import run_and_save_rng_state
from sptransform.graph.nodes import is_multi_output, is_view, joint_id, storage_nbytes, storage_root, tensor_val
from sptransform.passes.remat_rng import generator_state

RNG_STATE_REGION = "dropout_masks"
"""A replayed dropout saves its RNG state instead of its mask; it is counted with the masks."""


@dataclass(frozen=True)
class SavedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    region: str
    layer: int | None
    before_layers: bool = False
    """Outside the layers and computed before the first one (embeddings): on a pipeline's first
    stage; the rest outside the layers (final norm, head, loss) is on its last."""


@dataclass
class MemoryReport:
    saved: list[SavedTensor]
    """One entry per storage kept for backward (parameters excluded)."""
    num_layers: int
    peak_backward: int
    """Peak live activation bytes while the backward runs (saved + computed in backward)."""
    param_grad_bytes: int
    parameters_excluded: int
    """Bytes of saved parameters / parameter views (not activations; not in ``total``)."""
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.saved)

    def by_region(self, layer: int | None | Literal["all"] = "all") -> dict[str, int]:
        out = {r: 0 for r in REGIONS}
        for t in self.saved:
            if layer == "all" or t.layer == layer:
                out[t.region] += t.nbytes
        return out

    def layer_bytes(self, layer: int) -> int:
        return sum(t.nbytes for t in self.saved if t.layer == layer)

    def per_layer(self) -> dict[str, float]:
        """Bytes per region averaged over the layers (what one layer keeps)."""
        if not self.num_layers:
            return {r: 0.0 for r in REGIONS}
        totals = defaultdict(float)
        for t in self.saved:
            if t.layer is not None:
                totals[t.region] += t.nbytes / self.num_layers
        return {r: totals[r] for r in REGIONS}

    def outside_layers(self) -> dict[str, int]:
        return self.by_region(None)

    def embedding_and_head_bytes(self) -> tuple[int, int]:
        """Bytes outside the layers (before the first layer, after the last one)."""
        before = sum(t.nbytes for t in self.saved if t.layer is None and t.before_layers)
        return before, sum(t.nbytes for t in self.saved if t.layer is None) - before


def saved_nodes(fw: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """What the forward graph hands to the backward (its outputs after the user's)."""
    outputs = next(iter(fw.graph.find_nodes(op="output"))).args[0]
    return [o for o in outputs[num_fwd_outputs:] if isinstance(o, fx.Node) and tensor_val(o) is not None]


def memory_report(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    state_indices: Sequence[int],
    notes: Sequence[str] = (),
) -> MemoryReport:
    placeholders = list(fw.graph.find_nodes(op="placeholder"))
    state = {placeholders[i] for i in state_indices if i < len(placeholders)}
    forward_outputs = next(iter(fw.graph.find_nodes(op="output"))).args[0][:num_fwd_outputs]
    regions = classify_regions(fw.graph, state=state, outputs=forward_outputs)
    saved, excluded, seen = [], 0, set()
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    first_layer_input = order[regions.boundaries[0]] if regions.boundaries else -1
    for node in saved_nodes(fw, num_fwd_outputs):
        root = storage_root(node)
        if root in seen:
            continue
        seen.add(root)
        region, layer = regions.saved_region(node)
        if _is_rng_state(root):
            region, layer = RNG_STATE_REGION, _layer_of_rng(root, regions)
        if region == "parameters":
            excluded += storage_nbytes(root)
            continue
        value = tensor_val(node)
        saved.append(SavedTensor(node.name, tuple(value.shape), str(value.dtype).replace("torch.", ""),
                                 storage_nbytes(root), region, layer,
                                 before_layers=layer is None and _before(root, order, first_layer_input)))
    fw_roots = {joint_id(n): storage_root(n) for n in saved_nodes(fw, num_fwd_outputs) if joint_id(n) is not None}
    peak, grads = backward_peak(bw, fw_roots=fw_roots, state=state, num_primals=len(placeholders),
                                state_indices=set(state_indices))
    return MemoryReport(saved=saved, num_layers=regions.num_layers, peak_backward=peak,
                        param_grad_bytes=grads, parameters_excluded=excluded, notes=list(notes))


def _before(root: fx.Node, order: dict[fx.Node, int], first_layer_input: int) -> bool:
    """Computed before the first layer's input, or an input only read before it (token ids for
    the embedding's backward; labels read by the loss are not)."""
    if root.op == "placeholder":
        return all(order[user] <= first_layer_input for user in root.users)
    return order[root] <= first_layer_input


def _is_rng_state(node: fx.Node) -> bool:
    """A generator state the forward saves so the backward can replay a dropout."""
    if node.op == "call_function" and node.target is generator_state:
        return True
    parent = node.args[0] if node.target is operator.getitem else None
    return isinstance(parent, fx.Node) and parent.target is run_and_save_rng_state


def _layer_of_rng(node: fx.Node, regions) -> int | None:
    if node.target is operator.getitem:
        return regions.layer.get(node.args[0])
    draw = next(iter(node.users), None)  # the random op right after the saved state
    return regions.layer.get(node.next) if draw is not None else None


def backward_peak(bw: fx.GraphModule, *, fw_roots: dict, state: set, num_primals: int,
                  state_indices: set[int]) -> tuple[int, int]:
    """(peak live activation bytes, bytes of parameter gradients) while ``bw`` runs in order."""
    state_roots = set(state)
    nodes = list(bw.graph.nodes)
    output = nodes[-1]
    grads = output.args[0]
    param_grads = {g for i, g in enumerate(grads) if i in state_indices and isinstance(g, fx.Node)}

    def key(node):
        root = storage_root(node)
        return fw_roots.get(joint_id(root), root) if root.op == "placeholder" else root

    last_use: dict = {}
    for i, n in enumerate(nodes):
        for p in n.all_input_nodes:
            last_use[key(p)] = i
    live: dict = {}
    peak = grad_bytes = 0
    for i, n in enumerate(nodes):
        if n.op == "placeholder" or (n.op == "call_function" and not is_view(n) and not is_multi_output(n)):
            k = key(n)
            if k not in live and k not in state_roots and tensor_val(n) is not None:
                if n in param_grads:
                    grad_bytes += storage_nbytes(n)
                else:
                    live[k] = storage_nbytes(n)
        peak = max(peak, sum(live.values()))
        for p in set(n.all_input_nodes):
            k = key(p)
            if last_use.get(k) == i and k in live and p not in grads:
                del live[k]
    return peak, grad_bytes


# ---------------------------------------------------------------------------
# the paper's numbers


def paper_layer_bytes(
    shape: ModelShape,
    *,
    seq: int,
    batch: int,
    tp: int = 1,
    sp: bool = False,
    policy: str = "none",
    element_size: int = 2,
) -> dict[str, float] | None:
    """Korthikanti et al. Table 2 for one layer, by region; ``None`` for policies the paper has
    no row for and for layers other than the paper's (``is_paper_layer``).

    Rows: no parallelism (tp=1), tensor parallel, tensor+sequence parallel, each with
    ``none`` or ``selective``, and ``full`` (the layer input only, 2sbh whatever t)."""
    if not is_paper_layer(shape):
        return None
    s, b, h, a, t, e = seq, batch, shape.hidden, shape.num_heads, tp, element_size
    sbh, as2b = s * b * h, a * s * s * b
    split = t if sp else 1  # what SP also divides: norms, residual dropouts, projection inputs
    if policy == "full":
        return {**{r: 0.0 for r in REGIONS}, "norms": e * sbh / split}
    if policy not in ("none", "selective"):
        return None
    out = {r: 0.0 for r in REGIONS}
    out["norms"] = 2 * e * sbh / split
    out["attention_projections"] = (e / split + 4 * e / t) * sbh  # QKV input, Q K V, out-proj input
    out["mlp"] = (e / split + 8 * e / t) * sbh  # fc1 input, GELU input, fc2 input
    out["dropout_masks"] = 2 * sbh / split
    if policy == "none":
        out["attention_internals"] = 2 * e * as2b / t
        out["dropout_masks"] += as2b / t
    return out


def is_paper_layer(shape: ModelShape) -> bool:
    """The layer the paper counts: explicit softmax attention with dropout, LayerNorm, GELU MLP of 4h."""
    return (shape.attention == "explicit" and shape.norm == "layernorm" and shape.activation == "gelu"
            and shape.ffn == 4 * shape.hidden and shape.kv_heads == shape.num_heads and shape.dropout > 0)


def paper_row_name(tp: int, sp: bool, policy: str) -> str:
    if policy == "full":
        return "full activation recomputation"
    base = "no parallelism" if tp == 1 else ("tensor + sequence parallel" if sp else "tensor parallel (baseline)")
    return base + (" + selective activation recomputation" if policy == "selective" else "")


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
