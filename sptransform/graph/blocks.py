"""Repeated residual blocks of a forward graph, from dataflow alone: the layers a pipeline cuts between.

    x1 = add(x0, attn0(ln(x0)));  x2 = add(x1, mlp0(ln(x1)));  x3 = add(x2, attn1(ln(x2))); ...
    -> blocks  [x0 -> x1: attention], [x1 -> x2], [x2 -> x3: attention], ...
    -> layers  [[x0 -> x1, x1 -> x2], [x2 -> x3, x3 -> x4]]

* a **residual block** is a residual add ``r = skip + branch`` whose branch descends from the
  skip through a weight matmul (``regions.find_sublayers``), not nested in another one's body;
* blocks are grouped into **layers**: a new layer at each block holding attention (an
  attention core that ``regions.find_attention_cores`` recognises, or one of the ``attention``
  nodes the caller names); without any, the shortest repeating unit of the blocks' op
  signatures (an x-transformers ``layers`` list alternating attention written with ``einsum``
  and feed-forward entries repeats every 2 blocks); without repetition, one layer per block.

Nothing here depends on the tensor-parallel analysis recognising a block: QK-norm over the
whole hidden size, a fused multi-query QKV or an attention the analysis leaves whole are
layers all the same. Reads op types, shapes and which operands descend from parameters;
never node names or module paths.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch.fx as fx

from sptransform.graph.nodes import packet
from sptransform.graph.regions import _constant_nodes, _Dataflow, find_attention_cores, find_sublayers, find_weight_matmuls


@dataclass(frozen=True)
class ResidualBlock:
    """``residual = skip + branch``, with what runs between them."""

    skip: fx.Node
    residual: fx.Node
    body: frozenset[fx.Node]
    """Nodes that descend from ``skip`` and feed ``residual`` (``residual`` included)."""
    attention: bool
    signature: tuple[tuple[str, int], ...]
    """How many ops of each kind the body runs: equal for repeated blocks."""


def find_residual_blocks(nodes: list[fx.Node], state: Iterable[fx.Node], *,
                         attention: Iterable[fx.Node] = ()) -> list[ResidualBlock]:
    """The outermost residual blocks among ``nodes`` (forward nodes in graph order), in order
    of their residual add. ``state``: placeholders of parameters and buffers. A block holding
    one of ``attention`` counts as attention even when no attention core is recognised."""
    flow = _Dataflow(nodes)
    constant = _constant_nodes(nodes, set(state))
    weight_mask = flow.mask(find_weight_matmuls(nodes, constant))
    core_mask = flow.mask(n for scores, values, _ in find_attention_cores(flow, constant)
                          for n in (scores, values) if n is not None)
    core_mask |= flow.mask(n for n in attention if n in flow.index)
    found = find_sublayers(flow, constant, weight_mask)
    outermost = [(skip, residual, body) for skip, residual, body in found
                 if not any(other != body and body & other == body for _, _, other in found)]
    blocks = []
    for skip, residual, body in outermost:
        members = flow.members(body)
        signature = Counter(str(packet(n)) for n in members if n not in constant)
        blocks.append(ResidualBlock(skip=skip, residual=residual, body=frozenset(members),
                                    attention=bool(body & core_mask), signature=tuple(sorted(signature.items()))))
    return sorted(blocks, key=lambda b: flow.index[b.residual])


def group_layers(blocks: list[ResidualBlock]) -> list[list[ResidualBlock]]:
    """Consecutive blocks grouped into layers: at each attention block, else by the shortest
    repeating unit of signatures, else one block each."""
    if not blocks:
        return []
    if any(b.attention for b in blocks):
        layers: list[list[ResidualBlock]] = []
        for b in blocks:
            if b.attention or not layers:
                layers.append([])
            layers[-1].append(b)
        return layers
    signatures = [b.signature for b in blocks]
    period = next(p for p in range(1, len(blocks) + 1)
                  if len(blocks) % p == 0 and all(s == signatures[i % p] for i, s in enumerate(signatures)))
    if period == len(blocks):
        period = 1  # no repetition: each block is a layer of its own
    return [blocks[i : i + period] for i in range(0, len(blocks), period)]


def describe_layers(blocks: list[ResidualBlock], layers: list[list[ResidualBlock]]) -> str:
    """In words, for errors and ``explain()``: how many blocks, grouped by which rule."""
    if not blocks:
        return "no residual block"
    sizes = " or ".join(str(s) for s in sorted({len(layer) for layer in layers}))
    if any(b.attention for b in blocks):
        rule = "a layer starts at each block holding attention"
    elif len({b.signature for b in blocks}) > 1 and all(len(layer) == 1 for layer in layers):
        rule = "their ops do not repeat: a layer per block"
    else:
        rule = f"their ops repeat every {len(layers[0])} block(s)"
    return f"{len(blocks)} residual blocks in {len(layers)} layers of {sizes} block(s); {rule}"
