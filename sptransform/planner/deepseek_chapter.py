"""The DeepSeek-V3 memory chapter's walkthrough, under that chapter's own assumptions.

The chapter puts 671B parameters (37B active) on 16 pipeline stages x 64-way
data parallelism with ZeRO-1 and no tensor parallelism, and shows three tricks
(selective recompute, EMA in host memory, a shared and co-located embedding/head)
taking the heaviest rank from 33.6 GB to 26.1 GB. Its arithmetic, kept as it is:

  - weights and gradients count only the active parameters: ``2 * 37e9 / 16``;
  - optimizer state and EMA are ZeRO-1 sharded over all parameters:
    ``12 * 671e9 / (16 * 64)`` and ``4 * 671e9 / (16 * 64)``;
  - activations are ``12 * L * B * S * d * 2`` bytes with ``L = 4`` layers per
    stage, which the chapter calls "per layer" and multiplies by 4 layers again;
    recompute keeps 70% of them ("about 30% savings");
  - the embedding and head are ``V * d`` BF16 matrices each, one when shared;
  - weights, gradients, optimizer and EMA are quoted in 10^9 bytes, activations
    and embedding in 2^30 bytes, each rounded to 0.1, and the rounded figures
    summed (unrounded, the two totals are 33.65 and 26.17).
"""

from __future__ import annotations

from dataclasses import dataclass

from sptransform.planner.memory import GPU_BUCKETS, MemoryBudget, model_state_bytes
from sptransform.planner.workload import StateBytes

CHAPTER_UNITS = {
    "weights": 1e9, "gradients": 1e9, "optimizer": 1e9, "ema": 1e9,
    "activations": 2**30, "embedding_head": 2**30,
}

CHAPTER_FIGURES = {
    "before": {"weights": 4.6, "gradients": 4.6, "optimizer": 7.9, "ema": 2.6, "activations": 10.5,
               "embedding_head": 3.4, "total": 33.6},
    "after": {"weights": 4.6, "gradients": 4.6, "optimizer": 7.9, "ema": 0.0, "activations": 7.3,
              "embedding_head": 1.7, "total": 26.1},
}
"""What the chapter prints, for side-by-side output."""


@dataclass(frozen=True, kw_only=True)
class ChapterAssumptions:
    """The chapter's setup; every field is a number it states."""

    total_params: float = 671e9
    active_params: float = 37e9
    pp: int = 16
    dp: int = 64
    seq_len: int = 4096
    micro_batch: int = 1
    hidden: int = 7168
    vocab_size: int = 128_000
    layers_per_stage: int = 4
    """61 layers / 16 stages, rounded up."""
    activation_elements_per_layer_token: int = 12
    """The chapter's ``12 * L * B * S * d``: 12 hidden-wide tensors per layer and token."""
    recompute_keeps: float = 0.7
    gpu_memory_gb: float = 80
    """The H800 line the chapter draws."""


def chapter_budget(
    assumptions: ChapterAssumptions = ChapterAssumptions(), *,
    recompute: bool, ema_on_host: bool, share_embedding: bool,
) -> MemoryBudget:
    """The heaviest rank's buckets in bytes, with any subset of the three tricks."""
    a = assumptions
    active = model_state_bytes(a.active_params / a.pp, zero_stage=1, dp=a.dp, state_bytes=StateBytes())
    sharded = model_state_bytes(a.total_params / a.pp, zero_stage=1, dp=a.dp, state_bytes=StateBytes(),
                                with_ema=True)
    per_layer = (a.activation_elements_per_layer_token * a.layers_per_stage * a.micro_batch * a.seq_len
                 * a.hidden * 2)
    activations = per_layer * a.layers_per_stage * (a.recompute_keeps if recompute else 1.0)
    vocab_matrix = a.vocab_size * a.hidden * 2
    tricks = [name for name, on in (("recompute", recompute), ("EMA on host", ema_on_host),
                                    ("shared embedding/head", share_embedding)) if on]
    return MemoryBudget(
        label=" + ".join(tricks) if tricks else "no tricks",
        weights=active.weights,
        gradients=active.gradients,
        optimizer=sharded.optimizer,
        ema=0.0 if ema_on_host else sharded.ema,
        ema_host=sharded.ema if ema_on_host else 0.0,
        activations=activations,
        embedding_head=vocab_matrix * (1 if share_embedding else 2),
    )


def chapter_figures(budget: MemoryBudget) -> dict[str, float]:
    """The budget in the chapter's units, each bucket rounded to 0.1 as it prints them, and their sum."""
    figures = {name: round(getattr(budget, name) / CHAPTER_UNITS[name], 1) for name in GPU_BUCKETS}
    figures["total"] = round(sum(figures.values()), 1)
    return figures


def chapter_walkthrough(assumptions: ChapterAssumptions = ChapterAssumptions()) -> dict[str, MemoryBudget]:
    """Before (no tricks) and after (all three), as the chapter's walkthrough shows them."""
    return {
        "before": chapter_budget(assumptions, recompute=False, ema_on_host=False, share_embedding=False),
        "after": chapter_budget(assumptions, recompute=True, ema_on_host=True, share_embedding=True),
    }
