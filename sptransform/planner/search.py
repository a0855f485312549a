"""Enumerate tp x pp x dp, ZeRO stage, recompute policy and micro-batch; keep what fits."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from sptransform.planner.activations import PLANNED_POLICIES, Recompute
from sptransform.planner.cluster import Cluster
from sptransform.planner.flops import Utilization
from sptransform.planner.layout import RUNNABLE_ZERO_STAGES, Layout, ZeroStage, layout_problem
from sptransform.planner.memory import MemoryBudget, rank_memory
from sptransform.planner.params import divisors
from sptransform.planner.throughput import CommunicationTime, estimate_utilization
from sptransform.planner.workload import Workload
from sptransform.planner.presets import ModelShape
from sptransform.logs import progress

DEFAULT_ACHIEVED_FRACTION = 0.55
"""Share of peak FLOP/s a GPU sustains on the hardware FLOPs while the pipeline is
full. Korthikanti et al.'s Table 5 runs reach 0.53-0.65 once their pipeline bubble
is taken out; 0.55 sits at the low end."""

SEARCH_LIMITS = {"num_gpus": 2**20, "gpus_per_node": 2**20, "global_batch": 2**24, "layouts": 50_000}
"""What ``plan`` refuses to search above: GPUs in the cluster and per node (1,048,576), sequences
per iteration (16,777,216), and layouts left to evaluate once the (tp, pp) pairs that cannot be
valid (tp x pp not dividing the GPUs, pp not dividing the layers) are skipped. At these limits a
search takes seconds."""


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The values tried on each axis; ``None`` for tp and pp means every one that divides."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    zero_stages: tuple[ZeroStage, ...] = RUNNABLE_ZERO_STAGES
    """Stages 1 and 2 only when asked: ``parallelize`` runs 0 and 3."""
    recompute: tuple[Recompute, ...] = PLANNED_POLICIES
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    sequence_parallel: tuple[bool, ...] = (True, False)
    interleave: tuple[int, ...] = (1,)
    colocate_embedding_head: bool = False

    def __post_init__(self):
        for name in ("tp", "pp", "micro_batches", "interleave"):
            values = getattr(self, name)
            if values is None and name in ("tp", "pp"):
                continue
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
            if bad:
                raise ValueError(f"SearchSpace.{name}={tuple(values)}: {bad[0]!r} is not a positive integer; "
                                 "every value must be >= 1")
        if any(z not in (0, 1, 2, 3) for z in self.zero_stages):
            raise ValueError(f"SearchSpace.zero_stages={tuple(self.zero_stages)}: ZeRO stages are 0, 1, 2 or 3")
        if any(r not in PLANNED_POLICIES for r in self.recompute):
            raise ValueError(f"SearchSpace.recompute={tuple(self.recompute)}: use policies from {list(PLANNED_POLICIES)}")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    layout: Layout
    stages: tuple[MemoryBudget, ...]
    """First and last pipeline stage (one entry without pipelining)."""
    utilization: Utilization
    communication: CommunicationTime
    fits: bool

    @property
    def peak(self) -> MemoryBudget:
        return max(self.stages, key=lambda budget: budget.total)


@dataclass(frozen=True, kw_only=True)
class Plan:
    shape: ModelShape
    cluster: Cluster
    workload: Workload
    achieved_fraction: float
    reserve_bytes: float
    candidates: tuple[Candidate, ...]
    """Every valid layout: those that fit by estimated throughput, then the rest by memory."""
    skipped: int
    """Combinations that broke a rule (heads, layers or batch not divisible, ...)."""

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.fits)

    @property
    def memory_limit(self) -> float:
        return self.cluster.gpu.memory_bytes - self.reserve_bytes


def _groups(shape: ModelShape, *, cluster: Cluster, space: SearchSpace):
    """Per (tp, pp) in search order: (tp, pp, how many layouts, the layouts)."""
    tps = space.tp or tuple(divisors(cluster.gpus_per_node))
    policies = space.recompute
    if shape.attention == "sdpa" and "none" in policies:  # a fused kernel leaves selective nothing to drop
        policies = tuple(p for p in policies if p != "selective")
    for tp in tps:
        pps = space.pp or tuple(divisors(max(cluster.num_gpus // tp, 1)))
        for pp in pps:
            dp = max(cluster.num_gpus // (tp * pp), 1)
            zero_stages = space.zero_stages if dp > 1 else (0,)
            sequence_parallel = space.sequence_parallel if tp > 1 else (False,)
            axes = (zero_stages, policies, space.micro_batches, sequence_parallel, space.interleave)
            yield tp, pp, math.prod(len(axis) for axis in axes), _layouts(tp, pp, dp, axes, space)


def _layouts(tp: int, pp: int, dp: int, axes, space: SearchSpace):
    for zero, recompute, micro_batch, sp, interleave in itertools.product(*axes):
        yield Layout(tp=tp, pp=pp, dp=dp, sequence_parallel=sp, zero_stage=zero, recompute=recompute,
                     micro_batch=micro_batch, interleave=interleave,
                     colocate_embedding_head=space.colocate_embedding_head)


def candidate_layouts(shape: ModelShape, *, cluster: Cluster, space: SearchSpace):
    """Every combination in ``space`` with ``tp * pp * dp == num_gpus`` (validity not yet checked)."""
    for _, _, _, layouts in _groups(shape, cluster=cluster, space=space):
        yield from layouts


def _hopeless(shape: ModelShape, cluster: Cluster, tp: int, pp: int) -> bool:
    """Every layout of this (tp, pp) breaks a rule of ``layout_problem``: tp x pp does not divide
    the GPUs, or pp does not divide the layers (then neither does pp x interleave)."""
    return cluster.num_gpus % (tp * pp) != 0 or shape.num_layers % pp != 0


def check_search_size(cluster: Cluster, workload: Workload) -> None:
    """Refuse a cluster or batch above ``SEARCH_LIMITS`` (the search would take minutes)."""
    for name, value in (("num_gpus", cluster.num_gpus), ("gpus_per_node", cluster.gpus_per_node),
                        ("global_batch", workload.global_batch)):
        if value > SEARCH_LIMITS[name]:
            raise ValueError(f"{name}={value} is above the planner's limit of {SEARCH_LIMITS[name]:,}: "
                             f"give at most {SEARCH_LIMITS[name]}")


def plan(
    shape: ModelShape, *, cluster: Cluster, workload: Workload, space: SearchSpace = SearchSpace(),
    achieved_fraction: float = DEFAULT_ACHIEVED_FRACTION, reserve_bytes: float = 0.0,
) -> Plan:
    """Evaluate every valid layout in ``space``; raise ``ValueError`` when none is valid, or when the
    search is larger than ``SEARCH_LIMITS``."""
    check_search_size(cluster, workload)
    if not 0 < achieved_fraction <= 1:
        raise ValueError(f"achieved_fraction={achieved_fraction} must be a share of peak in (0, 1]")
    if not 0 <= reserve_bytes < cluster.gpu.memory_bytes:
        raise ValueError(f"reserve_bytes={reserve_bytes:.4g} must be >= 0 and below the GPU's "
                         f"{cluster.gpu.memory_bytes:.4g} bytes")
    groups = list(_groups(shape, cluster=cluster, space=space))
    to_evaluate = sum(count for tp, pp, count, _ in groups if not _hopeless(shape, cluster, tp, pp))
    if to_evaluate > SEARCH_LIMITS["layouts"]:
        raise ValueError(
            f"the search would evaluate {to_evaluate:,} layouts, above the limit of {SEARCH_LIMITS['layouts']:,}: "
            "pin axes or give fewer values per axis (sptransform plan: --tp, --pp, --zero, --recompute, "
            "--micro-batch, --sp, --interleave)"
        )
    candidates, first_problem, skipped = [], None, 0
    limit = cluster.gpu.memory_bytes - reserve_bytes
    for tp, pp, count, layouts in progress(groups, desc="planner: (tp, pp) groups"):
        if _hopeless(shape, cluster, tp, pp):  # the same outcome as checking each, without the time
            skipped += count
            if first_problem is None and count:
                first_problem = layout_problem(shape, next(layouts), cluster=cluster, workload=workload)
            continue
        for layout in layouts:
            problem = layout_problem(shape, layout, cluster=cluster, workload=workload)
            if problem:
                first_problem, skipped = first_problem or problem, skipped + 1
                continue
            stages = tuple(rank_memory(shape, layout, workload=workload))
            speed, comms = estimate_utilization(shape, layout, cluster=cluster, workload=workload,
                                                achieved_fraction=achieved_fraction)
            fits = max(s.total for s in stages) <= limit
            candidates.append(Candidate(layout=layout, stages=stages, utilization=speed, communication=comms,
                                        fits=fits))
    if not candidates:
        raise ValueError(first_problem or "the search space is empty; give at least one value per axis")
    candidates.sort(key=_rank)
    return Plan(shape=shape, cluster=cluster, workload=workload, achieved_fraction=achieved_fraction,
                reserve_bytes=reserve_bytes, candidates=tuple(candidates), skipped=skipped)


def _rank(candidate: Candidate):
    layout = candidate.layout
    # Among equal estimates prefer less communication: smaller tp, lower ZeRO stage, fewer stages.
    simplicity = (layout.tp, layout.zero_stage, layout.pp, not layout.sequence_parallel)
    if candidate.fits:
        return (0, -round(candidate.utilization.tokens_per_s, 6), *simplicity, candidate.peak.total)
    return (1, candidate.peak.total, -candidate.utilization.tokens_per_s, *simplicity)
