"""What the analysis of a captured graph finds, as plain records.

A ``LinearMatch`` (a matmul-like op reading a parameter, or rows of one), an ``EmbeddingMatch``,
a ``Region`` (the column-parallel linears feeding one row-parallel linear, as the backward walk
traced them) and ``ModelAnalysis``, everything ``graph.analysis.analyze`` found together. They
live apart from the finders so that ``graph.reasons``, which words what the finders could not
split, reads them without importing the finders that call it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch.fx as fx

from sptransform.graph.placement import DimShard


@dataclass(frozen=True)
class LinearMatch:
    node: fx.Node
    input: fx.Node
    """The activation operand."""
    weight: fx.Node
    """The parameter placeholder."""
    weight_name: str
    out_dim: int
    """Dim of the parameter that indexes output features."""
    bias: fx.Node | None
    """The bias's parameter placeholder."""
    bias_name: str | None
    in_features: int
    out_features: int
    """Of the weight the linear reads: the piece's, when it reads a piece."""
    weight_piece: tuple[int, int] | None = None
    """``(start, length)`` along ``out_dim`` of the parameter when the linear reads a piece of it
    (``w_q, w_kv = w.split([E, 2 * E])``, ``w.chunk(3)[i]``, ``w[a:b]``); None: all of it."""
    bias_piece: tuple[int, int] | None = None
    """The same for the bias (``b_q, b_k, b_v = b.chunk(3)``)."""
    in_dim: int | None = None
    """Dim of the parameter that indexes input features (None: the other of a 2-D weight's two)."""
    per_group: bool = False
    """The parameter holds one weight per expert, each split alike (experts' gate/up
    column-wise, down row-wise): a grouped matmul (``nodes.GROUPED_MM_OPS``), or a ``bmm`` by the
    experts' weights gathered per token (``W[expert_ids]``)."""
    input_dim: int = -1
    """Dim of the activation operand that the linear contracts (its input features)."""
    output_dim: int = -1
    """Dim of the linear's output that holds its output features."""

    @property
    def weight_in_dim(self) -> int:
        return 1 - self.out_dim if self.in_dim is None else self.in_dim

    @property
    def weight_label(self) -> str:
        """The weight's name, with the rows read when a piece (``attn.in_proj_weight[32:96]``)."""
        if self.weight_piece is None:
            return self.weight_name
        start, length = self.weight_piece
        return f"{self.weight_name}[{start}:{start + length}]"


@dataclass(frozen=True)
class EmbeddingMatch:
    node: fx.Node
    weight: fx.Node
    weight_name: str
    num_embeddings: int


@dataclass
class Region:
    """Column-parallel linears feeding one row-parallel linear."""

    row: LinearMatch
    columns: dict[fx.Node, DimShard]
    """Each column linear's node -> how its output features are split."""
    specs: dict[fx.Node, object]
    """Every node inside -> its output split (a list for ``split`` nodes)."""
    cuts: list[tuple[fx.Node, DimShard]]
    """Replicated tensors entering the region that are cut to the local part."""
    column_linears: dict[fx.Node, LinearMatch] = field(default_factory=dict)
    kind: Literal["attention", "mlp"] = "mlp"
    layer: int = 0
    more_rows: tuple[LinearMatch, ...] = ()
    """Row-parallel linears walked together with ``row`` (experts run on the chunks of one split)."""
    crossed_statistic: bool = False
    """The walk crossed a statistic over the split features outside attention (a gated norm over
    a mixer's channels; from the head, the residual stream's norms): kept after the others."""

    @property
    def rows(self) -> tuple[LinearMatch, ...]:
        return (self.row, *self.more_rows)


@dataclass
class ModelAnalysis:
    linears: dict[fx.Node, LinearMatch]
    embeddings: list[EmbeddingMatch]
    regions: list[Region]
    head: LinearMatch | None
    loss: fx.Node | None
    vocab_embeddings: list[EmbeddingMatch]
    norms: list[fx.Node] = field(default_factory=list)
    dropouts: list[fx.Node] = field(default_factory=list)
    seq_len: int | None = None
    """The attention's query length (None without attention)."""
    notes: list[str] = field(default_factory=list)
    """What runs replicated, and why."""
    fused: dict[str, DimShard] = field(default_factory=dict)
    """Parameters the linears read in pieces -> their split (each piece's column split, side by side)."""
    kept_whole: set[str] = field(default_factory=set)
    """Parameters read in pieces that no split fits: replicated (``notes`` says why)."""
    read_whole_rows: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    """Parameters of ``fused`` some of whose pieces linears read whole (a multi-query projection's
    K/V head) -> those rows, as ``(start, length)`` runs along the split's dim."""
    param_bytes: dict[str, int] = field(default_factory=dict)
    """Every parameter's bytes, whole (as captured)."""
    whole_reasons: dict[str, str] = field(default_factory=dict)
    """Parameter -> which rule leaves it whole on every rank, for those no region splits
    (``explain()`` names the largest)."""

    @property
    def num_layers(self) -> int:
        return 1 + max((r.layer for r in self.regions), default=-1)
