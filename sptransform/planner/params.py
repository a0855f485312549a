"""Parameter counts of a ``ModelShape``, split the way tensor parallelism splits them.

Megatron-style tensor parallelism shards the weight matrices and the biases of
column-parallel linears; norms and the bias of row-parallel linears stay whole on
every rank. The word embedding and the head are vocabulary-parallel; learned
position embeddings are replicated.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from sptransform.planner.presets import ModelShape


@dataclass(frozen=True, kw_only=True)
class ShardableCount:
    """A parameter count: the part tensor parallelism divides, and the part it copies."""

    sharded: int
    replicated: int = 0

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def per_rank(self, tp: int) -> float:
        return self.sharded / tp + self.replicated


def _norm_params(shape: ModelShape) -> int:
    return 2 * shape.hidden if shape.norm == "layernorm" else shape.hidden


@functools.lru_cache(maxsize=256)  # the search asks once per layout and stage
def layer_params(shape: ModelShape) -> ShardableCount:
    """One transformer layer: attention, MLP and its two norms."""
    h, f = shape.hidden, shape.ffn
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.kv_heads * shape.head_dim
    qkv_width = q_width + 2 * kv_width
    mlp_in_width = 2 * f if shape.activation == "swiglu" else f
    matrices = h * qkv_width + q_width * h + h * mlp_in_width + f * h
    column_biases = qkv_width + mlp_in_width if shape.bias else 0
    row_biases = 2 * h if shape.bias else 0
    return ShardableCount(
        sharded=matrices + column_biases,
        replicated=row_biases + 2 * _norm_params(shape),
    )


def embedding_params(shape: ModelShape) -> ShardableCount:
    """Word embedding (vocabulary-parallel) and learned positions (replicated)."""
    positions = shape.seq_len * shape.hidden if shape.position == "learned" else 0
    return ShardableCount(sharded=shape.vocab_size * shape.hidden, replicated=positions)


def head_params(shape: ModelShape, *, separate_copy: bool) -> ShardableCount:
    """Final norm plus the output projection when this stage holds its own copy of it.

    ``separate_copy`` is true when the head is untied, or tied but living on another
    pipeline stage than the embedding (Megatron then keeps a synchronised copy)."""
    projection = shape.vocab_size * shape.hidden if separate_copy else 0
    return ShardableCount(sharded=projection, replicated=_norm_params(shape))


def total_params(shape: ModelShape) -> int:
    """All parameters of the model, counting a tied embedding/head once."""
    head = head_params(shape, separate_copy=not shape.tied_embeddings)
    return shape.num_layers * layer_params(shape).total + embedding_params(shape).total + head.total


def divisors(n: int) -> list[int]:
    return list(_divisors(n))


@functools.lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:  # the search asks for the same few numbers thousands of times
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))
