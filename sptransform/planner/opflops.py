"""Per-op FLOPs, memory traffic and arithmetic intensity of one layer (a roofline table).

A GEMM ``[M, K] x [K, N]`` costs ``2MKN`` FLOPs and moves ``MK + KN + MN``
elements, each read or written once: the ideal traffic, which a real kernel only
approaches (the tutorial's convention, so that the gap measures an implementation).
Compute time is FLOPs over the GPU's dense 16-bit peak, memory time is bytes over
its HBM bandwidth; the larger one bounds the op.

``train`` is one forward over a whole sequence (backward GEMMs have the same
shapes transposed, twice the FLOPs, and the same verdicts); ``decode`` is one new
token per sequence attending to a KV cache of ``seq_len`` positions.

Attention is per head, so the score matrix is ``heads x s x s`` and a grouped
query shares its K/V heads. ``heads_as_one=True`` treats attention as a single
``[s, h] x [h, s]`` product, as the tutorial's tables do; FLOPs are the same,
memory traffic is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sptransform.planner.cluster import GPU
from sptransform.planner.presets import ModelShape

Mode = Literal["train", "decode"]

# Nominal FLOPs per element of pointwise ops; they are memory-bound whatever the constant.
NORM_FLOPS_PER_ELEMENT = 5
SOFTMAX_FLOPS_PER_ELEMENT = 5
GELU_FLOPS_PER_ELEMENT = 8
SWIGLU_FLOPS_PER_ELEMENT = 5


@dataclass(frozen=True, kw_only=True)
class OpCost:
    name: str
    dims: str
    """``count x [M,K]x[K,N]`` for GEMMs, the element count for pointwise ops."""
    flops: float
    elements_moved: float
    dtype_bytes: int = 2
    is_matmul: bool
    """Counts toward model FLOPs (GEMMs and fused attention); pointwise ops do not."""

    @property
    def bytes_moved(self) -> float:
        return self.elements_moved * self.dtype_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes_moved


@dataclass(frozen=True, kw_only=True)
class RooflineRow:
    op: OpCost
    compute_s: float
    memory_s: float

    @property
    def bound(self) -> Literal["compute", "memory"]:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def gemm(name: str, m: int, k: int, n: int, *, count: int = 1, dtype_bytes: int = 2) -> OpCost:
    prefix = f"{count} x " if count > 1 else ""
    return OpCost(name=name, dims=f"{prefix}[{m},{k}]x[{k},{n}]", flops=2 * m * k * n * count,
                  elements_moved=count * (m * k + k * n + m * n), dtype_bytes=dtype_bytes, is_matmul=True)


def pointwise(name: str, elements: int, *, flops_per_element: int, reads: int = 1, dtype_bytes: int = 2) -> OpCost:
    return OpCost(name=name, dims=f"{elements} elements", flops=flops_per_element * elements,
                  elements_moved=(reads + 1) * elements, dtype_bytes=dtype_bytes, is_matmul=False)


def layer_ops(
    shape: ModelShape, *, mode: Mode, batch: int, seq_len: int, heads_as_one: bool = False, dtype_bytes: int = 2,
) -> list[OpCost]:
    """The ops of one layer's forward, in order."""
    if mode not in ("train", "decode"):
        raise ValueError(f"mode={mode!r} is not a mode; use 'train' or 'decode'")
    h, f = shape.hidden, shape.ffn
    q_width, kv_width = shape.num_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    rows = batch * seq_len if mode == "train" else batch  # tokens going through the projections
    norm = "layernorm" if shape.norm == "layernorm" else "rmsnorm"
    g = dict(dtype_bytes=dtype_bytes)
    ops = [pointwise(f"attention {norm}", rows * h, flops_per_element=NORM_FLOPS_PER_ELEMENT, **g),
           gemm("qkv projection", rows, h, q_width + 2 * kv_width, **g)]
    ops += _attention_ops(shape, mode=mode, batch=batch, seq_len=seq_len, heads_as_one=heads_as_one, **g)
    ops += [gemm("output projection", rows, q_width, h, **g),
            pointwise(f"MLP {norm}", rows * h, flops_per_element=NORM_FLOPS_PER_ELEMENT, **g)]
    if shape.activation == "swiglu":
        ops += [gemm("gate+up projection", rows, h, 2 * f, **g),
                pointwise("silu(gate) * up", rows * f, flops_per_element=SWIGLU_FLOPS_PER_ELEMENT, reads=2, **g)]
    else:
        ops += [gemm("fc1", rows, h, f, **g),
                pointwise("gelu", rows * f, flops_per_element=GELU_FLOPS_PER_ELEMENT, **g)]
    ops.append(gemm("fc2" if shape.activation == "gelu" else "down projection", rows, f, h, **g))
    return ops


def _attention_ops(shape: ModelShape, *, mode: Mode, batch: int, seq_len: int, heads_as_one: bool,
                   dtype_bytes: int) -> list[OpCost]:
    a, kv_heads, d = shape.num_heads, shape.kv_heads, shape.head_dim
    queries = seq_len if mode == "train" else 1
    if shape.attention == "sdpa" and not heads_as_one:
        q_width, kv_width = a * d, kv_heads * d
        flops = 4 * batch * queries * seq_len * q_width
        moved = batch * (2 * queries * q_width + 2 * seq_len * kv_width)  # Q in, O out, K and V in
        return [OpCost(name="fused attention (sdpa)", dims=f"{batch} x {a} heads, {queries} x {seq_len}",
                       flops=flops, elements_moved=moved, dtype_bytes=dtype_bytes, is_matmul=True)]
    if heads_as_one:
        count, group, width = batch, 1, a * d
    else:
        # Queries of one K/V head go through it together: for GQA a group of a / kv_heads rows per position.
        count, group, width = batch * kv_heads, a // kv_heads, d
    score_rows = group * queries
    scores = batch * (1 if heads_as_one else a) * queries * seq_len
    return [
        gemm("attention scores q @ k^T", score_rows, width, seq_len, count=count, dtype_bytes=dtype_bytes),
        pointwise("softmax", scores, flops_per_element=SOFTMAX_FLOPS_PER_ELEMENT, dtype_bytes=dtype_bytes),
        gemm("attention @ v", score_rows, seq_len, width, count=count, dtype_bytes=dtype_bytes),
    ]


def roofline(ops: list[OpCost], gpu: GPU) -> list[RooflineRow]:
    return [RooflineRow(op=op, compute_s=op.flops / gpu.peak_flops, memory_s=op.bytes_moved / gpu.memory_bandwidth)
            for op in ops]
