"""Which region of which transformer layer each forward node belongs to, from dataflow alone.

The finders read op types, shapes and which operands descend from parameters; never
node names or module paths:

* a **weight matmul** multiplies an activation by something computed from
  parameters only (a weight, its transpose, its bf16 cast, its shard);
* an **attention core** is a pair of activation-by-activation matmuls, scores
  ``S = Q K^T`` and values ``A V``, with S flowing into A V through no other matmul
  (softmax, mask, dropout in between), or one fused attention kernel;
* a **sublayer** is a residual ``r = skip + branch`` whose branch descends from the
  skip through a weight matmul; its body is everything between skip and branch.
  A sublayer holding an attention core starts a new layer; the sublayers after it
  (the MLP) belong to the same layer;
* in a body, the **norm** is what lies between the skip and the body's first weight
  matmuls; the **up-projections** are an MLP body's first weight matmuls.

``classify_regions`` labels every forward node with one of ``REGIONS`` and a layer
index (``None`` outside the layers: embeddings, final norm, head, loss), and
``GraphRegions.saved_region`` attributes a tensor saved for backward the way the
paper does: a layer's input to that layer's first norm (also when an embedding or
a reduce-scatter produced it), a matmul's input to that matmul, a norm's input to
the norm, otherwise to the op that produced it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterable, Literal, get_args

import torch
import torch.fx as fx

from sptransform.graph.nodes import (
    is_collective,
    is_fused_attention,
    is_matmul,
    is_random,
    is_view,
    packet,
    storage_root,
    tensor_val,
)

aten = torch.ops.aten

Region = Literal[
    "attention_internals",
    "attention_projections",
    "mlp",
    "norms",
    "dropout_masks",
    "collectives",
    "embedding_head_loss",
    "constants",
]
REGIONS: tuple[Region, ...] = get_args(Region)


@dataclass(frozen=True)
class AttentionCore:
    """QK^T through attention-over-V, or one fused kernel."""

    values: fx.Node
    """The attention-over-V matmul, or the fused attention op."""
    scores: fx.Node | None
    """The QK^T matmul (``None`` when fused)."""
    internals: frozenset[fx.Node]

    @property
    def fused(self) -> bool:
        return self.scores is None


@dataclass(frozen=True)
class Sublayer:
    skip: fx.Node
    residual: fx.Node
    """The add that closes the sublayer."""
    body: frozenset[fx.Node]
    core: AttentionCore | None


@dataclass
class GraphRegions:
    region: dict[fx.Node, Region]
    layer: dict[fx.Node, int | None]
    cores: list[AttentionCore]
    sublayers: list[Sublayer]
    weight_matmuls: dict[fx.Node, fx.Node]
    """Weight matmul -> its activation operand."""
    norms: set[fx.Node]
    up_projections: set[fx.Node]
    boundaries: list[fx.Node]
    """Layer inputs, and the last layer's output: what full recomputation keeps."""
    constant: set[fx.Node]
    """Nodes computed from parameters, buffers and constants only."""
    random_sourced: set[fx.Node] = field(default_factory=set)
    """Nodes computed from random draws and constants only (a dropout's mask and scaling)."""
    num_layers: int = 0
    state: set[fx.Node] = field(default_factory=set)

    def saved_region(self, node: fx.Node) -> tuple[Region | Literal["parameters"], int | None]:
        """Region and layer a tensor saved for backward is counted in."""
        root = storage_root(node)
        if root in self.state or (root in self.constant and root.op == "placeholder"):
            return "parameters", None
        for index, boundary in enumerate(self.boundaries[: self.num_layers]):
            if storage_root(boundary) is root:  # a layer's input belongs to that layer, whoever produced it
                return "norms", index
        own = self.region.get(root, "embedding_head_loss")
        if own in ("dropout_masks", "collectives", "constants"):
            return own, self.layer.get(root)
        consumers = _consumers_through_views(root)
        for user in consumers:
            operand = self.weight_matmuls.get(user)
            if operand is not None and _reaches(root, operand):
                return self.region[user], self.layer[user]
        for user in consumers:
            if user in self.norms:
                return self.region[user], self.layer[user]
        return own, self.layer.get(root)


def _consumers_through_views(root: fx.Node) -> list[fx.Node]:
    """Ops that read ``root``'s storage, looking through views and collectives."""
    found, stack, seen = [], [root], {root}
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if is_view(user) or is_collective(user):
                stack.append(user)
            found.append(user)
    return found


def _reaches(root: fx.Node, operand: fx.Node) -> bool:
    node = operand
    while True:
        if node is root:
            return True
        if not (is_view(node) or is_collective(node)) or not node.all_input_nodes:
            return False
        node = node.all_input_nodes[0]


class _Dataflow:
    """Ancestor/descendant bitsets over the forward nodes, in graph order."""

    def __init__(self, nodes: list[fx.Node]):
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}
        self.anc = {}
        for n in nodes:
            mask = 0
            for p in n.all_input_nodes:
                if p in self.index:
                    mask |= self.anc[p] | (1 << self.index[p])
            self.anc[n] = mask
        self.desc = {}
        for n in reversed(nodes):
            mask = 0
            for u in n.users:
                if u in self.index:
                    mask |= self.desc[u] | (1 << self.index[u])
            self.desc[n] = mask

    def bit(self, node: fx.Node) -> int:
        return 1 << self.index[node]

    def mask(self, nodes: Iterable[fx.Node]) -> int:
        m = 0
        for n in nodes:
            m |= self.bit(n)
        return m

    def members(self, mask: int) -> list[fx.Node]:
        out = []
        while mask:
            low = mask & -mask
            out.append(self.nodes[low.bit_length() - 1])
            mask ^= low
        return out


def _constant_nodes(nodes: list[fx.Node], state: set[fx.Node]) -> set[fx.Node]:
    constant: set[fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder":
            if n in state:
                constant.add(n)
        elif n.op == "get_attr":
            constant.add(n)
        elif n.op == "call_function" and not is_random(n):
            if all(p in constant for p in n.all_input_nodes):
                constant.add(n)
    return constant


def find_weight_matmuls(nodes: list[fx.Node], constant: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Matmuls with one operand from parameters only and one activation operand."""
    found = {}
    for n in nodes:
        if not is_matmul(n):
            continue
        operands = [a for a in n.args if isinstance(a, fx.Node) and tensor_val(a) is not None]
        activations = [a for a in operands if a not in constant]
        if activations and len(activations) < len(operands):
            found[n] = activations[0]
    return found


def find_attention_cores(flow: _Dataflow, constant: set[fx.Node]) -> list[tuple[fx.Node | None, fx.Node, set]]:
    """(scores, values, internals) of each QK^T ... attention-over-V pair (explicit softmax
    attention) and of each fused attention op (scores ``None``)."""
    matmul_mask = flow.mask(n for n in flow.nodes if is_matmul(n))
    act_act = [
        n
        for n in flow.nodes
        if is_matmul(n) and all(a not in constant for a in n.all_input_nodes if tensor_val(a) is not None)
    ]
    cores, used = [], set()
    for scores in act_act:
        if scores in used:
            continue
        for values in act_act:
            if values in used or values is scores or not flow.anc[values] & flow.bit(scores):
                continue
            between = flow.desc[scores] & flow.anc[values]
            if between & matmul_mask:
                continue
            cores.append((scores, values, set(flow.members(between)) | {scores, values}))
            used.update((scores, values))
            break
    for n in flow.nodes:
        if is_fused_attention(n):
            cores.append((None, n, {n}))
    return sorted(cores, key=lambda c: flow.index[c[1]])


def find_sublayers(flow: _Dataflow, constant: set[fx.Node], weight_mask: int) -> list[tuple[fx.Node, fx.Node, int]]:
    """Residual adds ``skip + branch`` with a weight matmul between: (skip, add, body mask)."""
    found = []
    for n in flow.nodes:
        if n.op != "call_function" or packet(n) is not aten.add or len(n.args) < 2:
            continue
        a, b = n.args[:2]
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a in constant or b in constant:
            continue
        out, va, vb = tensor_val(n), tensor_val(a), tensor_val(b)
        if out is None or va is None or vb is None or not (va.shape == vb.shape == out.shape):
            continue
        if flow.anc[b] & flow.bit(a):
            skip, branch = a, b
        elif flow.anc[a] & flow.bit(b):
            skip, branch = b, a
        else:
            continue
        body = flow.desc[skip] & (flow.anc[branch] | flow.bit(branch))
        if body & weight_mask:
            found.append((skip, n, body | flow.bit(n)))
    return found


def _attach_unowned(
    flow: _Dataflow, owner: dict[fx.Node, int], constant: set[fx.Node], from_inputs: set[fx.Node], required: set[fx.Node]
) -> None:
    """Give unowned nodes an owner from their neighbours.

    Feeders first (in reverse order): a random value that does not depend on the
    inputs (a dropout mask drawn from its shape alone) joins the owner of all its
    users. Then what the forward outputs do not need (norm statistics, masks,
    detached outputs: values only the backward reads) joins the owner of the node
    it comes from."""
    for n in reversed(flow.nodes):
        users = [u for u in n.users if u in required]
        if n in owner or n in constant or n in from_inputs or n.op != "call_function" or not users:
            continue
        owners = {owner.get(u) for u in users}
        if len(owners) == 1 and None not in owners:
            owner[n] = owners.pop()
    for n in flow.nodes:
        if n in owner or n in required:
            continue
        for p in n.all_input_nodes:
            if p in owner:
                owner[n] = owner[p]
                break


def _from_inputs(flow: _Dataflow, constant: set[fx.Node]) -> set[fx.Node]:
    """Nodes that depend on a non-state input (the rest are constants or drawn at random)."""
    found: set[fx.Node] = set()
    for n in flow.nodes:
        if (n.op == "placeholder" and n not in constant) or any(p in found for p in n.all_input_nodes):
            found.add(n)
    return found


def _is_mask(node: fx.Node, constant: set[fx.Node], from_inputs: set[fx.Node]) -> bool:
    """A dropout mask: drawn at random and scaled, never touching an activation; or the
    1-byte mask output of a fused dropout op."""
    if node.op == "call_function" and node not in constant and node not in from_inputs:
        return True  # random_sourced
    value = tensor_val(node)
    if value is None or value.dtype is not torch.bool or node.target is not operator.getitem:
        return False
    return isinstance(node.args[0], fx.Node) and is_random(node.args[0])


def classify_regions(
    graph: fx.Graph, *, state: Iterable[fx.Node], outputs: Iterable[fx.Node], ignore: Iterable[fx.Node] = ()
) -> GraphRegions:
    """Label the forward nodes of ``graph``.

    ``state``: the placeholders holding parameters and buffers. ``outputs``: what
    the forward returns to the user (not what it saves for backward). ``ignore``:
    nodes to leave out (the backward part of a joint graph)."""
    state, ignore = set(state), set(ignore)
    nodes = [n for n in graph.nodes if n.op != "output" and n not in ignore]
    flow = _Dataflow(nodes)
    constant = _constant_nodes(nodes, state)
    from_inputs = _from_inputs(flow, constant)
    required = set()
    for out in outputs:
        if isinstance(out, fx.Node) and out in flow.index:
            required |= set(flow.members(flow.anc[out])) | {out}
    weight_matmuls = find_weight_matmuls(nodes, constant)
    weight_mask = flow.mask(weight_matmuls)
    found_cores = find_attention_cores(flow, constant)
    core_index = {n: i for i, (_, _, internals) in enumerate(found_cores) for n in internals}
    _attach_unowned(flow, core_index, constant, from_inputs, required)
    cores = [
        AttentionCore(values=values, scores=scores, internals=frozenset(n for n, j in core_index.items() if j == i))
        for i, (scores, values, _) in enumerate(found_cores)
    ]
    core_of = {n: cores[i] for n, i in core_index.items()}

    sublayer_of: dict[fx.Node, int] = {}
    raw = find_sublayers(flow, constant, weight_mask)
    for i, (_, _, body) in sorted(enumerate(raw), key=lambda item: -bin(item[1][2]).count("1")):
        for n in flow.members(body):  # smaller bodies are visited last and win
            sublayer_of[n] = i
    _attach_unowned(flow, sublayer_of, constant, from_inputs, required)

    sublayers, layer_of_sublayer, layer = [], [], -1
    for i, (skip, residual, _) in enumerate(raw):
        body = frozenset(n for n, j in sublayer_of.items() if j == i)
        core = next((c for c in cores if c.values in body), None)
        if core is not None or layer < 0:
            layer += 1
        sublayers.append(Sublayer(skip=skip, residual=residual, body=body, core=core))
        layer_of_sublayer.append(layer)

    norms: set[fx.Node] = set()
    up_projections: set[fx.Node] = set()
    for sub in sublayers:
        body_mask = flow.mask(sub.body)
        for mm, operand in weight_matmuls.items():
            if mm not in sub.body or (flow.anc[operand] | flow.bit(operand)) & body_mask & weight_mask:
                continue  # not one of the body's first weight matmuls
            if sub.core is None:
                up_projections.add(mm)
            lead_in = (flow.anc[operand] | flow.bit(operand)) & flow.desc[sub.skip] & body_mask
            norms.update(n for n in flow.members(lead_in) if n not in constant and not is_matmul(n))
    head_norms = _head_norms(flow, weight_matmuls, sublayer_of, sublayers, constant)
    norms |= head_norms
    norms |= {n for n in nodes if n.target is operator.getitem and n.args[0] in norms}

    region: dict[fx.Node, Region] = {}
    layer_of: dict[fx.Node, int | None] = {}
    for n in nodes:
        i = sublayer_of.get(n)
        core = core_of.get(n)
        layer_of[n] = layer_of_sublayer[i] if i is not None else None
        if core is not None:
            layer_of[n] = next((layer_of_sublayer[j] for j, s in enumerate(sublayers) if s.core is core), None)
        if n in constant:
            region[n] = "constants"
        elif is_collective(n):
            region[n] = "collectives"
        elif _is_mask(n, constant, from_inputs):
            region[n] = "dropout_masks"
        elif core is not None:
            region[n] = "attention_internals"
        elif i is None:
            region[n] = "embedding_head_loss"
        elif n in norms:
            region[n] = "norms"
        else:
            region[n] = "attention_projections" if sublayers[i].core is not None else "mlp"

    boundaries = []
    for layer_index in range(layer + 1):
        first = next(s for s, l in zip(sublayers, layer_of_sublayer) if l == layer_index)
        boundaries.append(first.skip)
    if sublayers:
        boundaries.append(sublayers[-1].residual)
    return GraphRegions(
        region=region,
        layer=layer_of,
        cores=cores,
        sublayers=sublayers,
        weight_matmuls=weight_matmuls,
        norms=norms,
        up_projections=up_projections,
        boundaries=list(dict.fromkeys(boundaries)),
        constant=constant,
        random_sourced={n for n in nodes if n.op == "call_function" and n not in constant and n not in from_inputs},
        num_layers=layer + 1,
        state=state,
    )


def _head_norms(flow, weight_matmuls, sublayer_of, sublayers, constant) -> set[fx.Node]:
    """The final norm: between the last layer's output and a weight matmul outside the layers."""
    if not sublayers:
        return set()
    last = sublayers[-1].residual
    found = set()
    for mm, operand in weight_matmuls.items():
        if mm in sublayer_of:
            continue
        lead_in = (flow.anc[operand] | flow.bit(operand)) & flow.desc[last]
        found.update(n for n in flow.members(lead_in) if n not in constant and not is_matmul(n))
    return found
