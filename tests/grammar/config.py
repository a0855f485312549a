"""What a generated model is made of: one choice per part, drawn by hypothesis (the fast lane) or by
a seeded ``random.Random`` (the real-rank lane) through the same ``draw_config``.

A choice names a spelling users write (``parts``/``attention``/``model`` implement each); a failing
example prints the ``Config``, which reads as a description of the model's code."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from hypothesis import strategies as st

CHOICES: dict[str, tuple] = {
    "arch": ("decoder", "encoder", "encdec"),
    "dtype": ("float32", "float64", "bfloat16"),
    "vocab": (32, 37, 64),  # 37: not divisible by tp (vocabulary padding)
    "head_dim": (4, 8),
    "heads": (2, 4),
    "layers": (1, 1, 2),  # a second layer doubles the cost and seldom adds a code path: 1 in 3
    "seq": (8, 16),
    "memory": (6, 12),  # encoder-decoder: the memory's length, != the query's
    "embed": ("embedding", "functional", "scaled"),
    "positions": ("none", "learned", "rope_interleaved", "rope_halves", "rope_partial", "alibi"),
    "head": ("linear", "tied_linear", "tied_matmul_t", "tied_mT", "tied_einsum", "tied_lambda", "tied_closure",
             "scaled_linear"),
    "norm": ("layernorm", "rmsnorm", "rms_one_plus", "rms_float32", "layernorm_manual"),
    "qk_norm": (False, True),
    "residual": ("pre", "post", "parallel", "sandwich", "pre_layer_scale"),
    "qkv": ("separate", "fused_split", "fused_chunk", "fused_unbind", "latent"),
    "kv": ("mha", "gqa_expand", "gqa_repeat_interleave", "mqa"),
    "kernel": ("sdpa", "softmax", "einsum"),
    "mask": ("is_causal", "tensor"),  # decoders: causality by flag or by a boolean/additive mask tensor
    "bias": (False, True),
    "mlp": ("gelu", "swiglu", "geglu", "fused_gate_up", "cast_weight"),
    "cross": ("hand", "mha"),
    "container": ("modulelist", "alternating", "sequential", "shared"),
    "loss": ("inside", "logits"),
}


@dataclass(frozen=True)
class Config:
    arch: str = "decoder"
    dtype: str = "float32"
    vocab: int = 32
    head_dim: int = 4
    heads: int = 4
    layers: int = 1
    seq: int = 8
    memory: int = 6
    embed: str = "embedding"
    positions: str = "none"
    head: str = "linear"
    norm: str = "layernorm"
    qk_norm: bool = False
    residual: str = "pre"
    qkv: str = "separate"
    kv: str = "mha"
    kernel: str = "sdpa"
    mask: str = "is_causal"
    bias: bool = False
    mlp: str = "gelu"
    cross: str = "hand"
    container: str = "modulelist"
    loss: str = "inside"
    seed: int = 0

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_heads(self) -> int:
        return {"mha": self.heads, "mqa": 1}.get(self.kv, max(1, self.heads // 2))

    @property
    def batch(self) -> int:
        return 2


@dataclass(frozen=True)
class Layout:
    """How the model is parallelized: the properties drawn with it."""

    tp: int = 2
    sp: bool = True
    pp: int = 1
    dp: int = 1
    recompute: str = "none"
    compile: str = "eager"


def draw_config(choose: Callable[[str, Sequence], object]) -> Config:
    """A Config from ``choose(name, options)``, one call per field in a fixed order."""
    values = {name: choose(name, options) for name, options in CHOICES.items()}
    if values["qkv"] in ("fused_chunk", "fused_unbind") and values["kv"] != "mha":
        values["qkv"] = "fused_split"  # equal thirds (chunk, a 3-way view) exist only when K/V have every head
    values["seed"] = choose("seed", range(1000))
    return Config(**values)


@st.composite
def configs(draw) -> Config:
    return draw_config(lambda name, options: draw(st.sampled_from(list(options))))


@st.composite
def simulated_cases(draw) -> tuple[Config, Layout]:
    """A model and a tensor-parallel layout simulated ranks run (pp = dp = 1, no recompute)."""
    # tp=2 first: hypothesis draws (and shrinks to) the first choice most, and tp=1 only checks capture
    return draw(configs()), Layout(tp=draw(st.sampled_from([2, 4, 1])), sp=draw(st.booleans()))


def sample_configs(seed: int, n: int) -> list[Config]:
    rng = random.Random(seed)
    return [draw_config(lambda name, options: rng.choice(list(options))) for _ in range(n)]


def replace(config: Config, **changes) -> Config:
    return dataclasses.replace(config, **changes)
