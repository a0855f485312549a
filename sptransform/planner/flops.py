"""Model and hardware FLOPs per iteration, MFU and HFU (Korthikanti et al., Appendix A).

Only matrix multiplications count, as in the paper (and Narayanan et al.): the
projections, ``QK^T`` and attention-over-V over the full ``s x s`` (no causal
halving), and the logits. Backward costs twice the forward. For the paper's layer
this is its equation 7, ``72 B L s h^2 (1 + s/6h + v/12hL)``.

Hardware FLOPs add what recomputation runs again. Selective recomputation repeats
``QK^T`` and attention-over-V once, ``4 B s^2 h`` per layer; the paper's equation 8
(``s/3h`` in place of ``s/6h``) adds three times that, i.e. it charges the whole
fwd+bwd of the attention scores again, so HFU from equation 8 overstates the work
really done. Both are reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sptransform.planner.activations import Recompute
from sptransform.planner.presets import ModelShape

HardwareConvention = Literal["actual", "paper-eq8"]

EQ8_NOTE = (
    "HFU eq.8 follows the paper's equation 8, which adds 12·B·s²·h per layer for selective recompute: three times "
    "the 4·B·s²·h (one forward of QK^T and attention-over-V) really recomputed. HFU actual counts only what is "
    "recomputed, so it is lower."
)


def _widths(shape: ModelShape) -> tuple[int, int, int]:
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.kv_heads * shape.head_dim
    mlp_in = 2 * shape.ffn if shape.activation == "swiglu" else shape.ffn
    return q_width, kv_width, mlp_in


def layer_forward_flops(shape: ModelShape, *, batch: int, seq_len: int) -> float:
    """One layer's forward GEMM FLOPs for ``batch`` sequences (paper: ``24Bsh^2 + 4Bs^2h``)."""
    q_width, kv_width, mlp_in = _widths(shape)
    tokens = batch * seq_len
    projections = shape.hidden * (q_width + 2 * kv_width) + q_width * shape.hidden
    mlp = shape.hidden * mlp_in + shape.ffn * shape.hidden
    return 2 * tokens * (projections + mlp) + core_attention_flops(shape, batch=batch, seq_len=seq_len)


def core_attention_flops(shape: ModelShape, *, batch: int, seq_len: int) -> float:
    """Forward ``QK^T`` plus attention-over-V: ``4 B s^2 h`` for the paper's layer."""
    q_width, _, _ = _widths(shape)
    return 2 * 2 * batch * seq_len * seq_len * q_width


def logits_forward_flops(shape: ModelShape, *, batch: int, seq_len: int) -> float:
    return 2 * batch * seq_len * shape.hidden * shape.vocab_size


def model_flops(shape: ModelShape, *, batch: int, seq_len: int) -> float:
    """FLOPs of one forward and backward over ``batch`` sequences, however they are run."""
    forward = shape.num_layers * layer_forward_flops(shape, batch=batch, seq_len=seq_len)
    return 3 * (forward + logits_forward_flops(shape, batch=batch, seq_len=seq_len))


def hardware_flops(
    shape: ModelShape, *, batch: int, seq_len: int, recompute: Recompute,
    convention: HardwareConvention = "actual",
) -> float:
    """Model FLOPs plus what ``recompute`` runs again.

    ``full`` repeats every layer's forward (not the logits). ``selective`` repeats
    the core attention's forward; ``convention="paper-eq8"`` charges it three
    times, as the paper's equation 8 does. A fused (``sdpa``) kernel keeps no
    ``s x s`` tensor, so selective recomputation keeps it whole and repeats nothing."""
    base = model_flops(shape, batch=batch, seq_len=seq_len)
    if recompute == "full":
        return base + shape.num_layers * layer_forward_flops(shape, batch=batch, seq_len=seq_len)
    if recompute == "selective" and shape.attention == "explicit":
        repeats = 3 if convention == "paper-eq8" else 1
        return base + repeats * shape.num_layers * core_attention_flops(shape, batch=batch, seq_len=seq_len)
    return base


@dataclass(frozen=True, kw_only=True)
class Utilization:
    """What one iteration achieves on the cluster."""

    iteration_time_s: float
    model_flops: float
    hardware_flops: float
    """FLOPs really executed (recomputation counted once)."""
    hardware_flops_eq8: float
    """The paper's equation-8 count (differs from ``hardware_flops`` under selective recompute)."""
    mfu: float
    hfu: float
    hfu_eq8: float
    tokens_per_s: float


def utilization(
    shape: ModelShape, *, iteration_time_s: float, num_gpus: int, peak_flops: float,
    global_batch: int, seq_len: int, recompute: Recompute,
) -> Utilization:
    """MFU and HFU of an iteration that took ``iteration_time_s`` (as in the paper's Table 5)."""
    if iteration_time_s <= 0:
        raise ValueError(f"iteration_time_s={iteration_time_s} must be positive")
    capacity = iteration_time_s * num_gpus * peak_flops
    counts = dict(batch=global_batch, seq_len=seq_len, recompute=recompute)
    model = model_flops(shape, batch=global_batch, seq_len=seq_len)
    hardware = hardware_flops(shape, **counts)
    hardware_eq8 = hardware_flops(shape, convention="paper-eq8", **counts)
    return Utilization(
        iteration_time_s=iteration_time_s, model_flops=model, hardware_flops=hardware,
        hardware_flops_eq8=hardware_eq8, mfu=model / capacity, hfu=hardware / capacity,
        hfu_eq8=hardware_eq8 / capacity, tokens_per_s=global_batch * seq_len / iteration_time_s,
    )
