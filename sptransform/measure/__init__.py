"""Activation memory and FLOPs measured on partitioned forward/backward graphs."""

from .flops import Cost, FlopsReport, flops_report
from .layer import Measurement, measure_shape
from .memory import MemoryReport, SavedTensor, memory_report, paper_layer_bytes
from .partitioned import Partitioned, partition_module
from .regions import REGIONS, GraphRegions, classify_regions

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
