"""The record the passes fill in as they transform one captured graph.

It says which parameter is split how, where tensor-parallel regions are entered
and left, which replicated parameters get partial gradients, and how each output
is split. ``ParallelModule`` reads it to shard parameters and wrap outputs;
``explain()`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from sptransform.capture import CapturedGraph
from sptransform.graph.analysis import ModelAnalysis
from sptransform.graph.sharding import DimShard


@dataclass(frozen=True)
class ParamPlacement:
    """How one parameter is held: split along ``spec`` (None: replicated).
    ``padded_rows``: the local shard is padded to this many rows in the graph."""

    spec: DimShard | None
    role: str
    padded_rows: int | None = None


@dataclass
class Exit:
    """A partial sum leaving a tensor-parallel region, and the bias to add after it."""

    partial: fx.Node
    bias: fx.Node | None
    layer: int


@dataclass
class ParallelPlan:
    tp: int
    sp: bool
    group: str
    rank: fx.Node
    static_rank: int | None = None
    placements: dict[str, ParamPlacement] = field(default_factory=dict)
    entries: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    """Activation -> the column-parallel ops that read it."""
    exits: list[Exit] = field(default_factory=list)
    sync_params: dict[str, int] = field(default_factory=dict)
    """Replicated parameter -> layer bucket whose gradients are summed over the group."""
    output_specs: dict[int, tuple[DimShard, int]] = field(default_factory=dict)
    """Output index -> (split, global size of the split dim)."""
    vocab: int | None = None
    vocab_per_rank: int | None = None
    seq_len: int | None = None
    notes: list[str] = field(default_factory=list)

    def place(self, name: str, placement: ParamPlacement) -> None:
        old = self.placements.get(name)
        if old is not None and old.spec != placement.spec:
            raise ValueError(
                f"parameter {name!r} is used as {old.role} and as {placement.role}, which need "
                f"different splits ({old.spec} vs {placement.spec}); sptransform cannot shard it"
            )
        self.placements[name] = placement


@dataclass
class ParallelGraph:
    """One input signature's transformed graph: the capture (whose ``gm`` the passes edited
    in place), what the analysis found, and the plan the passes filled (both ``None`` at tp=1)."""

    captured: CapturedGraph
    analysis: ModelAnalysis | None
    plan: ParallelPlan | None
    compiled: object = None
    """The AOTAutograd-compiled runner when ``recompute`` is not ``"none"`` (made on first call)."""

    @property
    def gm(self) -> fx.GraphModule:
        return self.captured.gm
