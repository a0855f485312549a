"""What each transformer layer costs, measured on the captured graph, for balancing pipeline stages.

* **time**: the forward's matmul FLOPs and elementwise element counts of the
  layer's nodes (``measure.flops.node_cost``), times 3 for forward + backward
  (a backward runs about twice the forward's FLOPs);
* **activation bytes**: what the layer saves for backward for one microbatch, as
  eager autograd saves it when the stages run: the graph runs once on fake tensors
  (no memory, no FLOPs) and autograd's pack hook reports each saved storage and the
  op saving it. What lies outside the layers is counted with the first layer
  (embeddings) or the last (final norm, head, loss): they join those stages.

Measured on the single-device graph of one microbatch: tensor parallelism divides
every layer alike, so the balance does not change with tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from sptransform.graph.cost import node_cost
from sptransform.torch_internals import StorageWeakRef, detect_fake_mode
from sptransform.passes.pipeline_split import GraphFlow, LayerBoundary

BACKWARD_FACTOR = 3
"""Forward + backward work over the forward's."""


@dataclass(frozen=True)
class LayerCost:
    forward_flops: int
    """Matmul FLOPs of the forward (one microbatch)."""
    forward_elementwise: int
    """Elements read or written by the forward's other ops."""
    activation_bytes: int
    """Bytes saved for backward (one microbatch)."""

    @property
    def time(self) -> int:
        """Forward + backward work, counting one elementwise element like one FLOP."""
        return BACKWARD_FACTOR * (self.forward_flops + self.forward_elementwise)


def measure_layer_costs(
    flow: GraphFlow, boundaries: Sequence[LayerBoundary], num_layers: int, flat_inputs: Sequence[Any],
) -> list[LayerCost]:
    """Per-layer costs of ``flow``'s graph (a single-device capture of one microbatch)."""
    flops, elementwise = [0] * num_layers, [0] * num_layers
    for node in flow.nodes:
        if not flow.computed(node):
            continue
        layer = flow.layer_of(node, boundaries)
        cost = node_cost(node)
        flops[layer] += cost.matmul_flops
        elementwise[layer] += cost.elementwise
    saved = saved_bytes_per_layer(flow, boundaries, num_layers, flat_inputs)
    return [LayerCost(f, e, s) for f, e, s in zip(flops, elementwise, saved)]


class _SavedTensors(fx.Interpreter):
    """Runs the graph on fake tensors; autograd's pack hook sees every tensor an op saves
    for its backward, while ``current`` is the node running it."""

    current: fx.Node | None = None

    def run_node(self, n: fx.Node):
        self.current = n
        return super().run_node(n)


def saved_bytes_per_layer(flow: GraphFlow, boundaries: Sequence[LayerBoundary], num_layers: int,
                          flat_inputs: Sequence[Any]) -> list[int]:
    """Bytes each layer saves for backward, as eager autograd keeps them when the stages run:
    one entry per storage, parameters left out, each storage counted in the layer of the op
    that saves it first."""
    captured = flow.captured
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([p.meta["val"] for p in placeholders if isinstance(p.meta.get("val"), torch.Tensor)])
    interpreter = _SavedTensors(captured.gm)
    out = [0] * num_layers
    seen: set = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = StorageWeakRef(t.untyped_storage())
        node = interpreter.current
        if storage not in seen and node is not None and flow.computed(node):
            out[flow.layer_of(node, boundaries)] += t.untyped_storage().nbytes()
        seen.add(storage)
        return t

    with fake_mode:
        inputs = []
        for node, name in zip(placeholders, captured.state_names):
            value = node.meta["val"]
            tensor = torch.empty(value.shape, dtype=value.dtype).requires_grad_(name in captured.param_names)
            seen.add(StorageWeakRef(tensor.untyped_storage()))  # parameters and buffers are not activations
            inputs.append(tensor)
        inputs.extend(torch.empty(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x for x in flat_inputs)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            interpreter.run(*inputs)
    return out
