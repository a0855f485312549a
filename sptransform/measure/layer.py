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
from sptransform.presets import ModelShape

from .flops import FlopsReport
from .memory import MemoryReport, element_size, paper_layer_bytes
from .models import fake_model
from .partitioned import Partitioned, partition_module


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
    if tp != 1 or sp:
        raise NotImplementedError(
            f"tp={tp}, sp={sp} needs sptransform.parallelize to build the per-rank graph; "
            "this checkout does not have it yet, so only tp=1 without --sp can be measured"
        )
    model, inputs = fake_model(shape, seq=seq, batch=batch, dtype=dtype, num_layers=num_layers)
    partitioned = partition_module(model, inputs, options=options)
    return Measurement(
        shape=shape, seq=seq, batch=batch, dtype=dtype, tp=tp, sp=sp, options=options,
        memory=partitioned.memory(), flops=partitioned.flops(), partitioned=partitioned,
    )
