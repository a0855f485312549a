"""What running one node costs, from the shapes in ``node.meta["val"]``.

Three separate counts per op, never mixed:

* ``matmul_flops``: matrix multiplies and attention kernels, with the formulas of
  ``torch.utils.flop_counter`` (2*m*n*k per GEMM). This is the paper's convention
  (Korthikanti et al., Appendix A, count GEMMs only) and what "FLOPs" means in
  every report here.
* ``elementwise``: one per element of the largest tensor a non-matmul op reads or
  writes (softmax, dropout, norms, GELU, ...); views are free.
* ``comm_bytes``: for a collective, the bytes of the full (gathered / unreduced)
  tensor it moves.

The rematerialisation pass prices recomputation with these; the pipeline balances
stages with them; ``measure.flops`` adds them up into reports.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from sptransform.graph.nodes import is_collective, is_view, packet, tensor_val, val

from sptransform.torch_internals import OpOverload

aten = torch.ops.aten

# CPU's fused attention is not in torch's registry; its FLOPs are those of the flash kernel.
_EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
}
_WAIT = torch.ops._c10d_functional.wait_tensor.default
FORWARD_TAG = "sptransform_forward"
"""``node.meta`` key set on the forward-side nodes of a joint graph before it is partitioned;
a node carrying it in a backward graph is a recomputed forward op."""


@dataclass(frozen=True)
class Cost:
    matmul_flops: int = 0
    elementwise: int = 0
    comm_bytes: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(
            self.matmul_flops + other.matmul_flops,
            self.elementwise + other.elementwise,
            self.comm_bytes + other.comm_bytes,
        )

    def __sub__(self, other: "Cost") -> "Cost":
        return Cost(
            self.matmul_flops - other.matmul_flops,
            self.elementwise - other.elementwise,
            self.comm_bytes - other.comm_bytes,
        )


def _matmul_flops(node: fx.Node) -> int:
    op = packet(node)
    formula = flop_registry.get(op) or _EXTRA_FLOP_FORMULAS.get(op)
    args = [val(a) if isinstance(a, fx.Node) else a for a in node.args]
    out = val(node)
    if formula is not None:
        return int(formula(*args, out_val=out))
    if op is aten.linear:  # pre-dispatch graphs: 2 * out elements * in features
        return 2 * out.numel() * args[0].shape[-1]
    if op is aten.matmul:
        return 2 * out.numel() * args[0].shape[-1]
    return 0


def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)):
        return max((_numel(v) for v in value), default=0)
    return 0


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return max((_nbytes(v) for v in value), default=0)
    return 0


def node_cost(node: fx.Node) -> Cost:
    """What running ``node`` once costs."""
    if node.op != "call_function" or is_view(node) or node.target is operator.getitem:
        return Cost()
    if is_collective(node):
        if node.target is _WAIT:
            return Cost()
        moved = max([_nbytes(val(node))] + [_nbytes(val(a)) for a in node.all_input_nodes])
        return Cost(comm_bytes=moved)
    flops = _matmul_flops(node) if isinstance(node.target, OpOverload) else 0
    if flops:
        return Cost(matmul_flops=flops)
    touched = [_numel(val(node))] + [_numel(val(a)) for a in node.all_input_nodes if tensor_val(a) is not None]
    return Cost(elementwise=max(touched))


def graph_cost(nodes: Iterable[fx.Node]) -> Cost:
    total = Cost()
    for node in nodes:
        total = total + node_cost(node)
    return total


def recomputed_nodes(bw: fx.GraphModule) -> list[fx.Node]:
    """The forward ops a backward graph runs again (tagged by the partition, see ``FORWARD_TAG``)."""
    return [n for n in bw.graph.nodes if n.op == "call_function" and n.meta.get(FORWARD_TAG)]
