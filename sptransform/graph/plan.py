"""The record the passes fill in as they transform one captured graph.

It says which parameter is split how, which replicated parameters get partial gradients
(summed in per-layer buckets), and how each output is split. ``ParallelModule`` reads it to shard parameters and wrap outputs;
``explain()`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from sptransform.capture import CapturedGraph
from sptransform.graph.analysis import analyze
from sptransform.graph.findings import ModelAnalysis
from sptransform.graph.placement import ParamPlacement  # noqa: F401  (re-exported)
from sptransform.graph.placement import DimShard


@dataclass
class ParallelPlan:
    tp: int
    sp: bool
    group: str
    rank: fx.Node
    static_rank: int | None = None
    placements: dict[str, ParamPlacement] = field(default_factory=dict)
    """Parameter FQN -> its split (seeded by the analysis; parameters not listed are replicated)."""
    sync_params: dict[str, int] = field(default_factory=dict)
    """Replicated parameter -> layer bucket whose gradients are summed over the group."""
    output_specs: dict[int, tuple[DimShard, int]] = field(default_factory=dict)
    """Output index -> (split, global size of the split dim)."""
    input_specs: dict[int, DimShard] = field(default_factory=dict)
    """Flat user input index -> the split it is given in (``capture.Entry.split_inputs``)."""
    vocab: int | None = None
    vocab_per_rank: int | None = None
    seq_len: int | None = None
    linears: tuple[int, int] = (0, 0)
    """(linears whose weight is split over the ranks, linears in the graph)."""
    notes: list[str] = field(default_factory=list)
    overlap: bool = True
    """Replicated parameters' gradient buckets waited on when the backward ends (``sync_grads``)."""


@dataclass
class ParallelGraph:
    """One input signature's transformed graph: the capture (whose ``gm`` the passes edited
    in place), what the analysis found, and the plan the passes filled (both ``None`` at tp=1)."""

    captured: CapturedGraph
    analysis: ModelAnalysis | None
    plan: ParallelPlan | None
    compiled: object = None
    """The AOTAutograd-compiled runner when ``recompute`` is not ``"none"`` (made on first call)."""
    data_parallel: object = None
    """``passes.data_parallel.DataParallelPlan`` when ``dp > 1``: how each parameter is stored over
    the data-parallel ranks."""
    expert_parallel: object = None
    """``passes.expert_parallel.ExpertParallelPlan`` when ``ep > 1``: which experts this rank holds."""
    fingerprint: object = None
    """``graph.fingerprint.GraphFingerprint`` of the graph as captured (before the passes): the
    ranks of a job compare theirs at ``parallelize`` (``runtime.rendezvous.agree_on_graph``)."""
    _single_device_analysis: ModelAnalysis | None = field(default=None, repr=False, compare=False)

    @property
    def gm(self) -> fx.GraphModule:
        return self.captured.gm

    def model_analysis(self) -> ModelAnalysis:
        """The analysis of the build, or at tp=1 (none) ``analyze(captured, 1)``: run once per
        captured graph and kept, since every microbatch's step reads its loss output."""
        if self.analysis is not None:
            return self.analysis
        if self._single_device_analysis is None:
            self._single_device_analysis = analyze(self.captured, 1)
        return self._single_device_analysis
