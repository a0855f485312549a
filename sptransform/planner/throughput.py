"""Estimated iteration time of a layout: compute at an assumed share of peak, the
pipeline bubble, and the communication nothing hides.

The assumptions, stated once:
  - every GPU runs its share of the hardware FLOPs at ``achieved_fraction`` of
    peak while the pipeline is full;
  - the (interleaved) 1F1B bubble adds ``(pp - 1) / (m * n_micro)`` of that time;
  - collectives run at the links' nominal bandwidth (NVLink inside a node, the
    per-GPU network link across nodes) as rings, and are not overlapped with
    compute: tensor-parallel all-reduces (or all-gather + reduce-scatter pairs
    with SP, the same bytes), pipeline sends, and the data-parallel/ZeRO traffic.
    ZeRO-2 reduce-scatters gradients every micro-batch; ZeRO-3 also all-gathers
    the weights for every micro-batch's forward and backward.
Megatron places tp innermost, then dp, then pp: a dp group stays inside a node
when ``tp * dp <= gpus_per_node``; pipeline neighbours do when ``tp * dp * 2 <= gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sptransform.planner.cluster import Cluster
from sptransform.planner.flops import Utilization, hardware_flops, utilization
from sptransform.planner.layout import Layout
from sptransform.planner.params import total_params
from sptransform.planner.workload import Workload
from sptransform.planner.presets import ModelShape


@dataclass(frozen=True, kw_only=True)
class CommunicationTime:
    """Seconds per iteration one rank spends in exposed communication."""

    tensor_parallel: float
    data_parallel: float
    pipeline: float

    @property
    def total(self) -> float:
        return self.tensor_parallel + self.data_parallel + self.pipeline


def pipeline_bubble_fraction(layout: Layout, *, workload: Workload) -> float:
    """Idle over busy time of a (interleaved) 1F1B pipeline: ``(pp - 1) / (m * n_micro)``."""
    return (layout.pp - 1) / (layout.interleave * layout.num_microbatches(workload))


def _ring(bytes_: float, group: int, bandwidth: float, *, all_reduce: bool) -> float:
    """Seconds for a ring all-reduce (or one reduce-scatter / all-gather) of ``bytes_``."""
    if group == 1:
        return 0.0
    steps = 2 if all_reduce else 1
    return steps * (group - 1) / group * bytes_ / bandwidth


def communication_time(shape: ModelShape, layout: Layout, *, cluster: Cluster, workload: Workload) -> CommunicationTime:
    gpu = cluster.gpu
    microbatches = layout.num_microbatches(workload)
    layers_per_rank = shape.num_layers / layout.pp
    boundary_bytes = layout.micro_batch * workload.seq_len * shape.hidden * workload.activation_bytes
    # Two all-reduces forward and two backward per layer; full recompute repeats the forward two.
    per_layer = 6 if layout.recompute == "full" else 4
    tensor_parallel = microbatches * layers_per_rank * per_layer * _ring(
        boundary_bytes, layout.tp, gpu.nvlink_bandwidth, all_reduce=True)

    inside_node = layout.tp * layout.dp <= cluster.gpus_per_node
    dp_bandwidth = gpu.nvlink_bandwidth if inside_node else gpu.network_bandwidth
    param_bytes = total_params(shape) / (layout.tp * layout.pp) * workload.state_bytes.weights
    one_pass = _ring(param_bytes, layout.dp, dp_bandwidth, all_reduce=False)
    data_parallel = {
        0: 2 * one_pass,  # all-reduce gradients once
        1: 2 * one_pass,  # reduce-scatter gradients, all-gather weights
        2: (microbatches + 1) * one_pass,
        3: 3 * microbatches * one_pass,
    }[layout.zero_stage]

    neighbours_inside = layout.tp * layout.dp * 2 <= cluster.gpus_per_node
    pp_bandwidth = gpu.nvlink_bandwidth if neighbours_inside else gpu.network_bandwidth
    sends = 2 * microbatches * layout.interleave if layout.pp > 1 else 0  # activation forward, gradient back
    sequence_split = layout.tp if layout.sequence_parallel else 1
    pipeline = sends * boundary_bytes / sequence_split / pp_bandwidth
    return CommunicationTime(tensor_parallel=tensor_parallel, data_parallel=data_parallel, pipeline=pipeline)


def estimate_utilization(
    shape: ModelShape, layout: Layout, *, cluster: Cluster, workload: Workload, achieved_fraction: float,
) -> tuple[Utilization, CommunicationTime]:
    """Estimated MFU/HFU and iteration time of ``layout`` under the module's assumptions."""
    if not 0 < achieved_fraction <= 1:
        raise ValueError(f"achieved_fraction={achieved_fraction} must be in (0, 1]; e.g. 0.55")
    work = hardware_flops(shape, batch=workload.global_batch, seq_len=workload.seq_len, recompute=layout.recompute)
    busy_s = work / (cluster.num_gpus * cluster.gpu.peak_flops * achieved_fraction)
    comms = communication_time(shape, layout, cluster=cluster, workload=workload)
    seconds = busy_s * (1 + pipeline_bubble_fraction(layout, workload=workload)) + comms.total
    result = utilization(
        shape, iteration_time_s=seconds, num_gpus=cluster.num_gpus, peak_flops=cluster.gpu.peak_flops,
        global_batch=workload.global_batch, seq_len=workload.seq_len, recompute=layout.recompute,
    )
    return result, comms
