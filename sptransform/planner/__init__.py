"""The planner: per-rank memory and FLOPs budgets, MFU/HFU, and the layouts that fit.

    from sptransform.planner import Cluster, Workload, get_gpu, plan
    from sptransform.planner.presets import get_preset

    result = plan(get_preset("gpt-175b"), cluster=Cluster(gpu=get_gpu("A100-80G"), num_gpus=64),
                  workload=Workload(global_batch=64, seq_len=2048))
    best = result.fitting[0]   # .layout, .peak (MemoryBudget), .utilization (MFU, HFU, time)

The command line is ``sptransform plan`` and ``sptransform flops`` (docs/planner.md).
"""

from sptransform.planner.activations import activation_bytes_per_layer, saved_tensors_per_layer
from sptransform.planner.cluster import GPU, GPU_PRESETS, Cluster, get_gpu
from sptransform.planner.flops import hardware_flops, model_flops, utilization
from sptransform.planner.layout import Layout, check_layout
from sptransform.planner.memory import MemoryBudget, model_state_bytes, peak_rank_memory, rank_memory
from sptransform.planner.opflops import layer_ops, roofline
from sptransform.planner.params import total_params
from sptransform.planner.search import Plan, SearchSpace, plan
from sptransform.planner.throughput import estimate_utilization
from sptransform.planner.workload import StateBytes, Workload

__all__ = [
    "GPU", "GPU_PRESETS", "Cluster", "Layout", "MemoryBudget", "Plan", "SearchSpace", "StateBytes", "Workload",
    "activation_bytes_per_layer", "check_layout", "estimate_utilization", "get_gpu", "hardware_flops",
    "layer_ops", "model_flops", "model_state_bytes", "peak_rank_memory", "plan", "rank_memory", "roofline",
    "saved_tensors_per_layer", "total_params", "utilization",
]
