"""FLOPs counted on the aten ops of a graph, from the shapes in ``node.meta["val"]``.

The three counts per op (``matmul_flops``, ``elementwise``, ``comm_bytes``) are
``graph.cost``'s; see its docstring for what each counts.

Model FLOPs are those of the joint forward+backward graph, each op once (no
recompute); hardware FLOPs are those of the partitioned forward and backward graphs,
which run the recomputed forward ops a second time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx

from sptransform.graph.cost import FORWARD_TAG, Cost, graph_cost, node_cost, recomputed_nodes  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class FlopsReport:
    """Model vs hardware FLOPs of one partitioned graph (matmul FLOPs; see module doc)."""

    model: Cost
    """The joint forward+backward graph, each op once."""
    hardware: Cost
    """The forward graph plus the backward graph, recomputation included."""
    recomputed: Cost
    """The forward ops found again in the backward graph, counted there."""

    @property
    def model_flops(self) -> int:
        return self.model.matmul_flops

    @property
    def hardware_flops(self) -> int:
        return self.hardware.matmul_flops

    @property
    def recompute_flops(self) -> int:
        return self.recomputed.matmul_flops

    @property
    def ratio(self) -> float:
        """hardware / model FLOPs."""
        return self.hardware_flops / self.model_flops if self.model_flops else math.nan


def flops_report(joint: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule) -> FlopsReport:
    model = graph_cost(joint.graph.nodes)
    hardware = graph_cost(fw.graph.nodes) + graph_cost(bw.graph.nodes)
    return FlopsReport(model=model, hardware=hardware, recomputed=graph_cost(recomputed_nodes(bw)))
