"""Activation memory: the tensors one transformer layer keeps for its backward pass.

The count follows the model instead of assuming the paper's layer: fused attention
(``sdpa``) keeps no ``s x s`` tensors, a model without dropout keeps no masks,
SwiGLU keeps four ``ffn``-wide tensors where GELU keeps two, grouped-query
attention keeps narrower K and V, RoPE keeps rotated copies of Q and K, and
Llama's RMSNorm keeps an fp32 copy of its input where LayerNorm keeps the input. For Korthikanti et al.'s layer (explicit softmax attention
with dropout, GELU of width 4h, LayerNorm) it reproduces their equation 1 and
Table 2 exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from sptransform.planner.presets import ModelShape

Recompute = Literal["none", "selective", "full"]
"""The policies the planner has closed-form byte counts for: the paper's three. Every policy
the runtime runs is in ``sptransform.options.RECOMPUTE_POLICIES``; the others are measured on
the graph (``sptransform memory``)."""
PLANNED_POLICIES: tuple[Recompute, ...] = get_args(Recompute)

MASK_BYTES = 1  # dropout masks are stored as bool
STATISTIC_BYTES = 4  # per-row statistics (norm mean/rstd, softmax log-sum-exp) are fp32


@dataclass(frozen=True, kw_only=True)
class SavedTensor:
    """One tensor kept for backward, sized for one micro-batch on one rank."""

    name: str
    bytes: float
    tensor_parallel: bool
    """Lives inside the tensor-parallel region (divided by tp even without SP)."""
    core_attention: bool = False
    """Dropped and rebuilt by selective recomputation."""


def check_tensor_parallel_fits(shape: ModelShape, *, tp: int, sp: bool, seq_len: int) -> None:
    """Raise ``ValueError`` when ``tp`` cannot split this model's heads, MLP or sequence."""
    rules = [
        ("num_heads", shape.num_heads, "attention (query) heads"),
        ("num_kv_heads", shape.kv_heads, "key/value heads"),
        ("ffn_hidden", shape.ffn, "MLP width"),
    ]
    if sp:
        rules.append(("seq_len", seq_len, "sequence positions (sequence parallelism)"))
    for field_name, value, what in rules:
        if value % tp:
            fitting = [t for t in (1, 2, 4, 8, 16, 32, 64) if all(v % t == 0 for _, v, _ in rules)]
            raise ValueError(
                f"tp={tp} does not divide {field_name}={value} ({what} of {shape.name!r}); "
                f"use tp in {fitting}"
            )


def saved_tensors_per_layer(
    shape: ModelShape,
    *,
    tp: int,
    sp: bool,
    recompute: Recompute,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int = 2,
    include_norm_statistics: bool = False,
) -> list[SavedTensor]:
    """The tensors one layer keeps for backward; see ``activation_bytes_per_layer``."""
    if recompute not in PLANNED_POLICIES:
        raise ValueError(f"recompute={recompute!r} is not a policy; use one of {PLANNED_POLICIES}")
    check_tensor_parallel_fits(shape, tp=tp, sp=sp, seq_len=seq_len)
    tokens = seq_len * micro_batch
    if recompute == "full":
        kept = [SavedTensor(name="layer input (checkpoint)", bytes=tokens * shape.hidden * dtype_bytes,
                            tensor_parallel=False)]
    else:
        kept = _all_saved_tensors(shape, tokens=tokens, seq_len=seq_len, micro_batch=micro_batch,
                                  dtype_bytes=dtype_bytes, include_norm_statistics=include_norm_statistics)
        if recompute == "selective":
            kept = [t for t in kept if not t.core_attention]
    return [
        SavedTensor(name=t.name, bytes=t.bytes / tp if (t.tensor_parallel or sp) else t.bytes,
                    tensor_parallel=t.tensor_parallel, core_attention=t.core_attention)
        for t in kept
    ]


def activation_bytes_per_layer(
    shape: ModelShape,
    *,
    tp: int,
    sp: bool,
    recompute: Recompute,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int = 2,
    include_norm_statistics: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch on one rank.

    Counted per micro-batch of ``b = micro_batch`` sequences of ``s = seq_len``
    tokens, activations in ``dtype_bytes`` (masks 1 byte, row statistics fp32).
    ``h`` is the hidden size, ``q = heads x head_dim``, ``kv = kv_heads x head_dim``,
    ``f`` the MLP width, ``a`` the heads.

    Each norm (both halves):
      - LayerNorm: its input, ``sbh``;
      - RMSNorm, written as Llama's reference code does (statistics in fp32, the
        normalized tensor cast back, then scaled): the fp32 copy of its input
        (``4 sbh`` bytes with 16-bit activations) and the cast normalized tensor
        the weight's gradient reads, ``sbh``;
      - with ``include_norm_statistics``, LayerNorm's fp32 mean and rstd (8 bytes
        per token) or RMSNorm's rstd (4 bytes per token); the paper leaves them
        out, and so does the default.
    Attention half:
      - the norm's output, the Q/K/V projections' input, ``sbh``;
      - what keeps Q, K and V alive: Q and K rotated by RoPE are new tensors
        (``sb(q+kv)``); so are K and V repeated to all heads by explicit attention
        over grouped K/V heads (``sbq`` each); any other Q, K or V is a view of
        its projection's output and keeps that alive whole (a fused ``[q|k|v]``
        projection: ``sb(q+2kv)`` even when only V is read). For GPT's layer
        (fused, learned positions) this is ``sb(q+2kv)``; for Llama's
        (separate projections, RoPE) it is rotated Q and K plus V;
      - ``explicit`` attention: the softmax output (``a s^2 b``); with dropout also
        the attention-dropout mask (``a s^2 b`` bytes) and its output
        (``a s^2 b``), which attention-over-V then reads instead of the softmax
        output;
      - ``sdpa`` (one fused kernel): the fp32 log-sum-exp of each score row
        (``4 a s b`` bytes); no ``s x s`` tensor;
      - the output projection's input, ``sbq`` (for ``sdpa`` this is the kernel's
        own output, which flash kernels lay out so that the head transpose is a
        view: counted once);
      - with dropout, the residual-dropout mask (``sbh`` bytes).
    MLP half:
      - the norm's output, the MLP input ``sbh`` (shared by the gate and up
        projections of SwiGLU);
      - GELU: its input and output, ``2 sbf``; SwiGLU: gate output (SiLU input),
        SiLU output, up output and their product (down projection input), ``4 sbf``;
      - with dropout, the residual-dropout mask (``sbh`` bytes).
    RoPE adds nothing more (its backward needs only cos/sin, shared by all
    layers); biases and residual adds add nothing; weights (and their transposes)
    are not activations.

    Tensor parallelism divides the tensors between the QKV projection and the
    output projection, and between the MLP's two projections, by ``tp``; sequence
    parallelism (``sp``) divides the rest too (the projection inputs are kept
    sharded and all-gathered again in backward, as in the paper).

    Recompute: ``selective`` drops the core-attention tensors of explicit
    attention (softmax output, dropout mask and output) and keeps Q, K, V; a fused
    ``sdpa`` kernel keeps no ``s x s`` tensor, so selective keeps what ``none``
    keeps; ``full`` keeps only the layer input, ``sbh`` (divided by ``tp``
    with ``sp``). For the paper's layer (2-byte activations) this gives
    ``sbh(34 + 5as/h)`` with ``tp=1`` and every row of its Table 2.

    Counts follow eager autograd; a compiled graph's partitioner may recompute
    cheap pointwise ops (GELU, SiLU) and keep less.
    """
    return sum(t.bytes for t in saved_tensors_per_layer(
        shape, tp=tp, sp=sp, recompute=recompute, micro_batch=micro_batch, seq_len=seq_len,
        dtype_bytes=dtype_bytes, include_norm_statistics=include_norm_statistics,
    ))


def _all_saved_tensors(shape, *, tokens, seq_len, micro_batch, dtype_bytes, include_norm_statistics):
    h, f, a = shape.hidden, shape.ffn, shape.num_heads
    q_width = a * shape.head_dim
    scores = micro_batch * a * seq_len * seq_len
    has_dropout = shape.dropout > 0

    def act(name, elements, *, tensor_parallel, core=False, bytes_each=dtype_bytes):
        return SavedTensor(name=name, bytes=elements * bytes_each, tensor_parallel=tensor_parallel,
                           core_attention=core)

    def norm(where):
        if shape.norm == "rmsnorm":  # Llama's reference RMSNorm: statistics in fp32, cast back, then scaled
            tensors = [
                act(f"{where} norm input (fp32 copy)", tokens * h, tensor_parallel=False,
                    bytes_each=max(dtype_bytes, STATISTIC_BYTES)),
                act(f"{where} normalized, cast back (weight-gradient input)", tokens * h, tensor_parallel=False),
            ]
        else:
            tensors = [act(f"{where} norm input", tokens * h, tensor_parallel=False)]
        if include_norm_statistics:
            per_token = 2 if shape.norm == "layernorm" else 1
            tensors.append(act(f"{where} norm statistics", tokens * per_token,
                               tensor_parallel=False, bytes_each=STATISTIC_BYTES))
        return tensors

    saved = norm("attention")
    saved.append(act("QKV projection input (norm output)", tokens * h, tensor_parallel=False))
    saved += [act(name, tokens * width, tensor_parallel=True) for name, width in _attention_inputs(shape)]
    if shape.attention == "sdpa":
        # not dropped by selective recompute: regaining it means re-running the whole kernel
        saved.append(act("attention log-sum-exp", micro_batch * a * seq_len, tensor_parallel=True,
                         bytes_each=STATISTIC_BYTES))
    else:
        saved.append(act("softmax output", scores, tensor_parallel=True, core=True))
        if has_dropout:
            saved += [
                act("attention dropout mask", scores, tensor_parallel=True, core=True, bytes_each=MASK_BYTES),
                act("attention dropout output", scores, tensor_parallel=True, core=True),
            ]
    saved.append(act("output projection input", tokens * q_width, tensor_parallel=True))
    if has_dropout:
        saved.append(act("attention residual dropout mask", tokens * h, tensor_parallel=False,
                         bytes_each=MASK_BYTES))
    saved += norm("MLP")
    saved.append(act("MLP input (norm output)", tokens * h, tensor_parallel=False))
    if shape.activation == "swiglu":
        for name in ("gate output (SiLU input)", "SiLU output", "up projection output",
                     "down projection input (SiLU(gate) * up)"):
            saved.append(act(name, tokens * f, tensor_parallel=True))
    else:
        saved += [
            act("GELU input (first MLP projection output)", tokens * f, tensor_parallel=True),
            act("second MLP projection input (GELU output)", tokens * f, tensor_parallel=True),
        ]
    if has_dropout:
        saved.append(act("MLP residual dropout mask", tokens * h, tensor_parallel=False, bytes_each=MASK_BYTES))
    return saved


def _attention_inputs(shape: ModelShape) -> list[tuple[str, int]]:
    """Storages that keep Q, K and V alive for attention's backward, as (name, width per token).

    Q and K rotated by RoPE, and K and V repeated to all heads by explicit
    attention with grouped K/V heads, are new tensors; any other Q, K or V is a
    view of its projection's output, which it keeps alive whole (for a fused
    ``[q|k|v]`` projection that is all three widths even if only V is read)."""
    q_width, kv_width = shape.num_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    repeated = shape.attention == "explicit" and shape.kv_heads != shape.num_heads
    own = {
        "Q": shape.position == "rope",
        "K": shape.position == "rope" or repeated,
        "V": repeated,
    }
    widths = {"Q": q_width, "K": q_width if repeated else kv_width, "V": q_width if repeated else kv_width}
    projection_widths = {"Q": q_width, "K": kv_width, "V": kv_width}
    kept = [(f"{t} ({'after RoPE' if shape.position == 'rope' and t != 'V' else 'repeated to all heads'})",
             widths[t]) for t in "QKV" if own[t]]
    viewed = [t for t in "QKV" if not own[t]]
    if viewed and shape.qkv_projection == "fused":
        kept.append((f"fused QKV projection output (holds {', '.join(viewed)})", q_width + 2 * kv_width))
    else:
        kept += [(f"{t} projection output", projection_widths[t]) for t in viewed]
    return kept
