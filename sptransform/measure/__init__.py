"""Activation memory and FLOPs measured on partitioned forward/backward graphs.

The analysis modules (``tensors``, ``regions``, ``flops``, ``memory``) never import a pass;
the drivers that run the rematerialisation pass (``partitioned.partition_module``,
``layer.measure_shape``) load on first use, so ``sptransform.passes.remat`` can import the
analysis without a cycle.
"""

from sptransform.measure.flops import Cost, FlopsReport, flops_report
from sptransform.measure.memory import MemoryReport, SavedTensor, memory_report, paper_layer_bytes
from sptransform.graph.regions import REGIONS, GraphRegions, classify_regions

_DRIVERS = {
    "Partitioned": "partitioned",
    "partition_module": "partitioned",
    "Measurement": "layer",
    "measure_shape": "layer",
}


def __getattr__(name: str):
    if name in _DRIVERS:
        import importlib

        return getattr(importlib.import_module(f".{_DRIVERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Cost",
    "FlopsReport",
    "GraphRegions",
    "Measurement",
    "MemoryReport",
    "Partitioned",
    "REGIONS",
    "SavedTensor",
    "classify_regions",
    "flops_report",
    "measure_shape",
    "memory_report",
    "paper_layer_bytes",
    "partition_module",
]
