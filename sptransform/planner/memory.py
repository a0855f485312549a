"""Per-rank memory in buckets: weights, gradients, optimizer state, EMA, activations,
embedding and head.

Model state follows ZeRO (Rajbhandari et al.): stage 1 shards the optimizer state
over the data-parallel group, stage 2 also the gradients, stage 3 also the
weights. An fp32 EMA of the weights, when kept on the GPU, is sharded like the
optimizer state (it is updated from the same shard). Activations follow
Korthikanti et al.: the first pipeline stage keeps ``pp`` micro-batches in flight
under 1F1B, and the interleaved schedule's ``1 + (pp - 1) / (pp * m)`` more.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from sptransform.planner.activations import activation_bytes_per_layer
from sptransform.planner.layout import Layout
from sptransform.planner.params import ShardableCount, embedding_params, head_params, layer_params
from sptransform.planner.workload import StateBytes, Workload
from sptransform.planner.presets import ModelShape

GPU_BUCKETS = ("weights", "gradients", "optimizer", "ema", "activations", "embedding_head")


@dataclass(frozen=True, kw_only=True)
class MemoryBudget:
    """Bytes one GPU holds at the peak of an iteration, by bucket."""

    label: str
    weights: float
    """Transformer-layer weights (embedding and head are in ``embedding_head``)."""
    gradients: float
    optimizer: float
    ema: float = 0.0
    """An fp32 EMA of the weights kept in GPU memory."""
    activations: float
    embedding_head: float
    """All state of the vocabulary matrices (and positions, final norm) on this rank."""
    ema_host: float = 0.0
    """The EMA's share in pinned host memory; not part of ``total``."""

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in GPU_BUCKETS)

    def as_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["total"] = self.total
        return values


@dataclass(frozen=True, kw_only=True)
class ModelState:
    weights: float
    gradients: float
    optimizer: float
    ema: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.ema


def model_state_bytes(
    params: float, *, zero_stage: int, dp: int, state_bytes: StateBytes = StateBytes(), with_ema: bool = False
) -> ModelState:
    """Bytes of weights, gradients, optimizer state (and EMA) for ``params`` parameters on one rank.

    ZeRO's table: ``(2 + 2 + K) * params`` unsharded; stage 1 divides the ``K``
    term by ``dp``; stage 2 the gradients too; stage 3 everything."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
    return ModelState(
        weights=params * state_bytes.weights / (dp if zero_stage >= 3 else 1),
        gradients=params * state_bytes.gradients / (dp if zero_stage >= 2 else 1),
        optimizer=params * state_bytes.optimizer / (dp if zero_stage >= 1 else 1),
        ema=params * state_bytes.ema / (dp if zero_stage >= 1 else 1) if with_ema else 0.0,
    )


def layers_in_flight(*, num_layers: int, pp: int, interleave: int, stage: int, num_microbatches: int) -> float:
    """Layer-micro-batches whose activations pipeline ``stage`` holds at its peak.

    1F1B: stage ``i`` runs ``pp - i`` forwards before its first backward. The
    interleaved schedule keeps ``2 (pp - i - 1) + (m - 1) pp + 1`` chunks of
    ``L / (pp m)`` layers, which for stage 0 is the paper's ``L (1 + (pp-1)/(pp m))``."""
    if interleave == 1:
        return num_layers / pp * min(pp - stage, num_microbatches)
    chunks = min(2 * (pp - stage - 1) + (interleave - 1) * pp + 1, num_microbatches * interleave)
    return chunks * num_layers / (pp * interleave)


def stage_memory(shape: ModelShape, layout: Layout, *, workload: Workload, stage: int) -> MemoryBudget:
    """The budget of one rank of pipeline ``stage`` (layout assumed valid: see ``check_layout``)."""
    first, last = stage == 0, stage == layout.pp - 1
    holds_head = first if layout.colocate_embedding_head else last
    layer_state = _state(layer_params(shape).per_rank(layout.tp) * shape.num_layers / layout.pp, layout, workload)
    vocab_state = _state(_vocab_params(shape, layout, first=first, holds_head=holds_head), layout, workload)
    host_ema = (layer_state.ema + vocab_state.ema) if workload.ema == "host" else 0.0
    on_gpu = workload.ema == "gpu"
    label = "only stage" if layout.pp == 1 else "first stage" if first else "last stage" if last else f"stage {stage}"
    return MemoryBudget(
        label=label,
        weights=layer_state.weights,
        gradients=layer_state.gradients,
        optimizer=layer_state.optimizer,
        ema=layer_state.ema if on_gpu else 0.0,
        activations=_stage_activations(shape, layout, workload=workload, stage=stage, holds_head=holds_head),
        embedding_head=vocab_state.total - (0.0 if on_gpu else vocab_state.ema),
        ema_host=host_ema,
    )


def rank_memory(shape: ModelShape, layout: Layout, *, workload: Workload) -> list[MemoryBudget]:
    """Budgets of the first and the last pipeline stage (one budget when ``pp == 1``)."""
    stages = sorted({0, layout.pp - 1})
    return [stage_memory(shape, layout, workload=workload, stage=s) for s in stages]


def peak_rank_memory(shape: ModelShape, layout: Layout, *, workload: Workload) -> MemoryBudget:
    """The budget of the rank that needs the most GPU memory."""
    return max(rank_memory(shape, layout, workload=workload), key=lambda budget: budget.total)


def _state(params: float, layout: Layout, workload: Workload) -> ModelState:
    return model_state_bytes(params, zero_stage=layout.zero_stage, dp=layout.dp,
                             state_bytes=workload.state_bytes, with_ema=workload.ema != "none")


def _vocab_params(shape: ModelShape, layout: Layout, *, first: bool, holds_head: bool) -> float:
    count = ShardableCount(sharded=0)
    if first:
        count = embedding_params(shape)
    if holds_head:
        # A tied head needs its own copy only on another stage than the embedding.
        separate = not shape.tied_embeddings or not first
        head = head_params(shape, separate_copy=separate)
        count = ShardableCount(sharded=count.sharded + head.sharded, replicated=count.replicated + head.replicated)
    return count.per_rank(layout.tp)


@functools.lru_cache(maxsize=4096)  # the search asks for the same layer under every ZeRO stage, dp and pp
def _layer_bytes(shape: ModelShape, **kwargs) -> float:
    return activation_bytes_per_layer(shape, **kwargs)


def _stage_activations(shape, layout: Layout, *, workload: Workload, stage: int, holds_head: bool) -> float:
    """Stored layer activations, the transient recompute working set, and the
    embedding/head activations (Korthikanti et al. section 4.3)."""
    common = dict(tp=layout.tp, sp=layout.sequence_parallel, micro_batch=layout.micro_batch,
                  seq_len=workload.seq_len, dtype_bytes=workload.activation_bytes)
    per_layer = _layer_bytes(shape, recompute=layout.recompute, **common)
    microbatches = layout.num_microbatches(workload)
    stored = per_layer * layers_in_flight(num_layers=shape.num_layers, pp=layout.pp, interleave=layout.interleave,
                                          stage=stage, num_microbatches=microbatches)
    # Backward of a recomputed layer rebuilds what the policy dropped, one layer at a time.
    working_set = _layer_bytes(shape, recompute="none", **common) - per_layer
    tokens = layout.micro_batch * workload.seq_len
    sequence_split = layout.tp if layout.sequence_parallel else 1
    extra = 0.0
    if stage == 0 and shape.dropout > 0:
        extra += tokens * shape.hidden / sequence_split * min(layout.pp, microbatches)  # embedding dropout masks
    if holds_head:
        extra += 2 * tokens * shape.hidden * workload.activation_bytes / sequence_split  # final norm + head input
        extra += tokens * shape.vocab_size * 4 / layout.tp  # fp32 logits for the loss
    return stored + working_set + extra
