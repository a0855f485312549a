"""A parallel layout (tp x pp x dp, ZeRO stage, recompute, micro-batch) and its rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from sptransform.options import ZeroStage as RunnableZeroStage
from sptransform.planner.activations import PLANNED_POLICIES, Recompute, check_tensor_parallel_fits
from sptransform.planner.cluster import Cluster
from sptransform.planner.params import divisors
from sptransform.planner.workload import Workload
from sptransform.planner.presets import ModelShape

ZeroStage = Literal[0, 1, 2, 3]

RUNNABLE_ZERO_STAGES: tuple[int, ...] = get_args(RunnableZeroStage)
"""The stages ``parallelize`` runs (0 to 3), which the planner searches. Its memory model is the
seed tutorial's ZeRO arithmetic; between steps sptransform's ZeRO 1 and 2 hold less (parameter
and gradient pieces too), during a step the gathered parameters (README, "Data parallelism")."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one model is spread over the cluster."""

    tp: int
    """Tensor-parallel size (inside a node)."""
    pp: int
    """Pipeline stages."""
    dp: int
    """Data-parallel replicas; ``tp * pp * dp`` is the number of GPUs."""
    sequence_parallel: bool
    """Shard norms, dropouts and the tensors between them along the sequence (needs tp > 1 to matter)."""
    zero_stage: ZeroStage
    """0: nothing sharded; 1: optimizer state; 2: + gradients; 3: + weights (over dp)."""
    recompute: Recompute
    micro_batch: int
    """Sequences per micro-batch."""
    interleave: int = 1
    """Model chunks per pipeline rank (Megatron's interleaved schedule; the paper's m)."""
    colocate_embedding_head: bool = False
    """Embedding and head on the same pipeline rank (DeepSeek's DualPipe placement)."""

    def num_microbatches(self, workload: Workload) -> int:
        return workload.global_batch // (self.dp * self.micro_batch)

    def parallelize_options(self) -> dict[str, Any]:
        """The ``sptransform.parallelize`` keywords of this layout (the micro-batch is the
        training loop's, not an option). Raises ``ValueError`` for a layout it cannot run."""
        if self.zero_stage not in RUNNABLE_ZERO_STAGES:
            raise ValueError(f"zero_stage={self.zero_stage}: parallelize runs ZeRO stages {RUNNABLE_ZERO_STAGES}; "
                             "use one of them")
        options: dict[str, Any] = dict(tp=self.tp, sp=self.sequence_parallel and self.tp > 1, pp=self.pp, dp=self.dp,
                                       zero=self.zero_stage, recompute=self.recompute)
        if self.interleave > 1:
            options["stages_per_rank"] = self.interleave
        return options

    def label(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.sequence_parallel and self.tp > 1:
            parts.append("sp")
        parts += [f"z{self.zero_stage}", {"none": "noremat", "selective": "sel", "full": "full"}[self.recompute],
                  f"mb{self.micro_batch}"]
        if self.interleave > 1:
            parts.append(f"m{self.interleave}")
        return " ".join(parts)


def layout_problem(shape: ModelShape, layout: Layout, *, cluster: Cluster, workload: Workload) -> str | None:
    """The first rule this layout breaks, worded as value, rule and fix; ``None`` when it is valid."""
    for name in ("tp", "pp", "dp", "micro_batch", "interleave"):
        if getattr(layout, name) < 1:
            return f"{name}={getattr(layout, name)} must be at least 1"
    if layout.zero_stage not in (0, 1, 2, 3):
        return f"zero_stage={layout.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3"
    if layout.recompute not in PLANNED_POLICIES:
        return f"recompute={layout.recompute!r} is not a policy; use one of {list(PLANNED_POLICIES)}"
    model_parallel = layout.tp * layout.pp
    if cluster.num_gpus % model_parallel:
        return (
            f"world size num_gpus={cluster.num_gpus} is not divisible by tp x pp = "
            f"{layout.tp} x {layout.pp} = {model_parallel}; use tp and pp whose product is in "
            f"{divisors(cluster.num_gpus)}"
        )
    if model_parallel * layout.dp != cluster.num_gpus:
        return (
            f"tp x pp x dp = {layout.tp} x {layout.pp} x {layout.dp} = {model_parallel * layout.dp} "
            f"but num_gpus={cluster.num_gpus}; use dp={cluster.num_gpus // model_parallel}"
        )
    if cluster.gpus_per_node % layout.tp:
        return (
            f"tp={layout.tp} does not fit in a node of gpus_per_node={cluster.gpus_per_node} "
            f"(tensor parallelism needs the intra-node links); use tp in {divisors(cluster.gpus_per_node)}"
        )
    try:
        check_tensor_parallel_fits(shape, tp=layout.tp, sp=layout.sequence_parallel, seq_len=workload.seq_len)
    except ValueError as error:
        return str(error)
    if shape.position == "learned" and workload.seq_len > shape.seq_len:
        return (
            f"seq_len={workload.seq_len} is longer than the {shape.seq_len} learned positions of "
            f"{shape.name!r}; use seq_len <= {shape.seq_len}"
        )
    return _schedule_problem(shape, layout, workload=workload, max_stages=cluster.num_gpus // layout.tp)


def _schedule_problem(shape: ModelShape, layout: Layout, *, workload: Workload, max_stages: int) -> str | None:
    chunks = layout.pp * layout.interleave
    if shape.num_layers % chunks:
        fitting = [p for p in divisors(max_stages) if shape.num_layers % (p * layout.interleave) == 0]
        fix = (f"use pp in {fitting}" if fitting else
               f"use an interleave that divides {shape.num_layers}, e.g. 1")
        return (
            f"pp x interleave = {layout.pp} x {layout.interleave} = {chunks} does not divide "
            f"num_layers={shape.num_layers} of {shape.name!r} (every stage needs the same number of layers); {fix}"
        )
    per_step = layout.dp * layout.micro_batch
    if workload.global_batch % per_step:
        return (
            f"global_batch={workload.global_batch} is not divisible by dp x micro_batch = "
            f"{layout.dp} x {layout.micro_batch} = {per_step}; use micro_batch in "
            f"{[m for m in divisors(workload.global_batch) if workload.global_batch % (layout.dp * m) == 0]} "
            f"or a global batch that is a multiple of {per_step}"
        )
    if layout.interleave > 1:
        if layout.pp == 1:
            return f"interleave={layout.interleave} needs pipeline parallelism; use pp > 1 or interleave=1"
        if layout.num_microbatches(workload) % layout.pp:
            return (
                f"the interleaved schedule needs the {layout.num_microbatches(workload)} micro-batches "
                f"to be a multiple of pp={layout.pp}; change micro_batch or global_batch, or use interleave=1"
            )
    return None


def check_layout(shape: ModelShape, layout: Layout, *, cluster: Cluster, workload: Workload) -> None:
    """Raise ``ValueError`` naming the value, the rule and the fix when the layout is invalid."""
    problem = layout_problem(shape, layout, cluster=cluster, workload=workload)
    if problem:
        raise ValueError(problem)
