"""Activation memory and FLOPs measured on partitioned forward/backward graphs.

``partition_module`` traces a module's joint graph and partitions it (sptransform's pass or
torch's); ``memory_report`` / ``flops_report`` read the result; ``measure_shape`` does all of
it for one layer of a preset model shape, on one rank of a tensor-parallel layout.
"""

from sptransform.measure.flops import Cost, FlopsReport, flops_report
from sptransform.measure.layer import Measurement, measure_shape
from sptransform.measure.memory import MemoryReport, SavedTensor, memory_report, paper_layer_bytes
from sptransform.measure.partitioned import Partitioned, partition_module

__all__ = [
    "Cost",
    "FlopsReport",
    "Measurement",
    "MemoryReport",
    "Partitioned",
    "SavedTensor",
    "flops_report",
    "measure_shape",
    "memory_report",
    "paper_layer_bytes",
    "partition_module",
]
