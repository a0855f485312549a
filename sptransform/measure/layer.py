"""Measure one rank of a model given by its shape: trace a layer under fake tensors, partition, count.

``measure_shape(PRESETS["gpt-175b"], options=RematOptions(policy="selective"))``
builds ``ShapeModel`` with ``num_layers`` layers (default 1) under fake tensors,
partitions its joint graph with the rematerialisation pass and returns the memory
and FLOPs reports with the paper's Table 2 row beside them. The whole model's
bytes are the per-layer bytes times ``shape.num_layers`` plus what lies outside
the layers (embeddings, final norm, head, loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sptransform.passes.remat import RematOptions
from sptransform.planner.presets import ModelShape

from sptransform.measure.flops import FlopsReport
from sptransform.measure.memory import MemoryReport, element_size, paper_layer_bytes
from sptransform.measure.models import ShapeModel, fake_model
from sptransform.measure.parallel import fake_process_group, rank_graph
from sptransform.measure.partitioned import Partitioned, partition_module


@dataclass
class Measurement:
    shape: ModelShape
    seq: int
    batch: int
    dtype: torch.dtype
    tp: int
    sp: bool
    options: RematOptions
    memory: MemoryReport
    flops: FlopsReport
    partitioned: Partitioned

    @property
    def sbh(self) -> int:
        return self.seq * self.batch * self.shape.hidden

    def layer_bytes(self) -> float:
        return sum(self.memory.per_layer().values())

    def model_bytes(self) -> float:
        """Per-layer bytes for all ``shape.num_layers`` layers plus the rest (one micro-batch, no pipelining)."""
        return self.layer_bytes() * self.shape.num_layers + sum(self.memory.outside_layers().values())

    def paper(self) -> dict[str, float] | None:
        return paper_layer_bytes(
            self.shape, seq=self.seq, batch=self.batch, tp=self.tp, sp=self.sp,
            policy=self.options.policy, element_size=element_size(self.dtype),
        )


def measure_shape(
    shape: ModelShape,
    *,
    options: RematOptions,
    seq: int | None = None,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    tp: int = 1,
    sp: bool = False,
    num_layers: int = 1,
) -> Measurement:
    """Trace ``num_layers`` layers of ``shape`` under fake tensors and measure one rank."""
    seq = seq or shape.seq_len
    if sp and tp == 1:
        raise ValueError("sp=True needs tp > 1 (sequence parallelism splits over the tensor-parallel ranks)")
    if tp == 1:
        model, inputs = fake_model(shape, seq=seq, batch=batch, dtype=dtype, num_layers=num_layers)
        partitioned = partition_module(model, inputs, options=options)
    else:
        with torch.device("meta"):
            model = ShapeModel(shape, seq=seq, num_layers=num_layers).to(dtype)
        idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        with fake_process_group(tp):
            graph = rank_graph(model, (idx, idx), tp=tp, sp=sp)
            partitioned = partition_module(graph.gm, graph.inputs, options=options, state_inputs=graph.state_inputs)
    return Measurement(
        shape=shape, seq=seq, batch=batch, dtype=dtype, tp=tp, sp=sp, options=options,
        memory=partitioned.memory(), flops=partitioned.flops(), partitioned=partitioned,
    )


def layer_flops(measured: Measurement) -> FlopsReport:
    """FLOPs of one layer: ``measured``'s graphs minus those of the same model with one layer fewer."""
    if measured.memory.num_layers < 2:
        raise ValueError("layer_flops needs a measurement of at least two layers (num_layers=2)")
    fewer = measure_shape(
        measured.shape, options=measured.options, seq=measured.seq, batch=measured.batch, dtype=measured.dtype,
        tp=measured.tp, sp=measured.sp, num_layers=measured.memory.num_layers - 1,
    )
    a, b = measured.flops, fewer.flops
    return FlopsReport(model=a.model - b.model, hardware=a.hardware - b.hardware, recomputed=a.recomputed - b.recomputed)
