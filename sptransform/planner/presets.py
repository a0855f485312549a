"""Model shapes the CLI and the planner know by name.

A preset describes a decoder-only transformer by its shape only; it never holds
weights. ``ModelShape.from_hf_config`` reads the same fields from an HF
``config.json``. Table 3 of Korthikanti et al. (2022) gives the four large GPT
configurations (sequence 2048, vocabulary 51200, explicit softmax attention with
dropout, GELU MLP of width 4h, LayerNorm, learned positions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The shape of a decoder-only transformer.

    Fields use the paper's letters where it has one (h, a, L, s, v)."""

    name: str
    num_layers: int
    """L: transformer layers."""
    hidden: int
    """h: hidden size."""
    num_heads: int
    """a: attention (query) heads."""
    num_kv_heads: int | None = None
    """K/V heads for grouped-query attention; ``None`` means ``num_heads``."""
    ffn_hidden: int | None = None
    """MLP inner width; ``None`` means ``4 * hidden``."""
    vocab_size: int = 51200
    """v: vocabulary size."""
    seq_len: int = 2048
    """s: default sequence length (also the maximum of learned positions)."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    activation: Literal["gelu", "swiglu"] = "gelu"
    position: Literal["learned", "rope"] = "learned"
    attention: Literal["explicit", "sdpa"] = "explicit"
    """``explicit``: QK^T, softmax, dropout and attention-over-V materialized
    (the paper's layer); ``sdpa``: one fused kernel."""
    qkv_projection: Literal["fused", "separate"] = "fused"
    """``fused``: one ``[q|k|v]`` linear (GPT-2, Megatron); ``separate``: three
    linears (Llama). It changes what is kept when RoPE rotates Q and K: with a
    fused projection V is a view of the fused output, so all of it stays alive."""
    dropout: float = 0.1
    bias: bool = True
    tied_embeddings: bool = True
    paper_layout: dict = field(default_factory=dict, compare=False)
    """Paper Table 3 layout (tp, pp, gpus, global batch, micro batch), when known."""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def with_(self, **changes) -> "ModelShape":
        return replace(self, **changes)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> "ModelShape":
        """Read a HF ``config.json`` (GPT-2 or Llama-style field names)."""
        data = json.loads(Path(path).read_text())
        return shape_from_hf_dict(data, name=Path(path).stem)


_HF_FIELDS = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "num_heads": ("num_attention_heads", "n_head"),
}


def shape_from_hf_dict(data: dict, *, name: str = "hf-config") -> ModelShape:
    """Build a ``ModelShape`` from a HF config dictionary; errors name the missing field."""
    values = {}
    for ours, theirs in _HF_FIELDS.items():
        found = [data[k] for k in theirs if k in data]
        if not found:
            raise ValueError(
                f"config {name!r} has none of the fields {list(theirs)} needed for {ours}; "
                "add one of them to the config"
            )
        values[ours] = int(found[0])
    is_llama_like = "intermediate_size" in data or data.get("hidden_act") == "silu"
    ffn = data.get("intermediate_size") or data.get("n_inner")
    return ModelShape(
        name=name,
        num_kv_heads=data.get("num_key_value_heads"),
        ffn_hidden=int(ffn) if ffn else None,
        vocab_size=int(data.get("vocab_size", 51200)),
        seq_len=int(data.get("max_position_embeddings") or data.get("n_positions") or 2048),
        norm="rmsnorm" if "rms_norm_eps" in data else "layernorm",
        activation="swiglu" if is_llama_like else "gelu",
        position="rope" if "rope_theta" in data or "rope_scaling" in data else "learned",
        attention="sdpa" if data.get("_attn_implementation", data.get("attn_implementation")) == "sdpa" else "explicit",
        dropout=float(data.get("attn_pdrop", data.get("attention_dropout", 0.0)) or 0.0),
        bias=not is_llama_like,
        qkv_projection="separate" if is_llama_like else "fused",
        tied_embeddings=bool(data.get("tie_word_embeddings", True)),
        **values,
    )


def _paper(name, a, h, L, t, p, gpus, gbs, mbs):
    return ModelShape(
        name=name, num_layers=L, hidden=h, num_heads=a,
        paper_layout=dict(tp=t, pp=p, gpus=gpus, global_batch=gbs, micro_batch=mbs),
    )


PRESETS: dict[str, ModelShape] = {
    # Korthikanti et al. 2022, Table 3 (s=2048, v=51200).
    "gpt-22b": _paper("gpt-22b", 64, 6144, 48, 8, 1, 8, 4, 4),
    "gpt-175b": _paper("gpt-175b", 96, 12288, 96, 8, 8, 64, 64, 1),
    "gpt-530b": _paper("gpt-530b", 128, 20480, 105, 8, 35, 280, 280, 1),
    "gpt-1t": _paper("gpt-1t", 160, 25600, 128, 8, 64, 512, 512, 1),
    # GPT-3-style shapes from the compute-/memory-bound tutorial's table (head size 128).
    "gpt-1.3b": ModelShape(name="gpt-1.3b", num_layers=24, hidden=2048, num_heads=16),
    "gpt-13b": ModelShape(name="gpt-13b", num_layers=40, hidden=5120, num_heads=40),
    # GPT-2 family (HF shapes: vocab 50257, 1024 positions).
    "gpt2-tiny": ModelShape(name="gpt2-tiny", num_layers=2, hidden=128, num_heads=4, vocab_size=50257, seq_len=1024),
    "gpt2": ModelShape(name="gpt2", num_layers=12, hidden=768, num_heads=12, vocab_size=50257, seq_len=1024),
    "gpt2-medium": ModelShape(name="gpt2-medium", num_layers=24, hidden=1024, num_heads=16, vocab_size=50257, seq_len=1024),
    "gpt2-large": ModelShape(name="gpt2-large", num_layers=36, hidden=1280, num_heads=20, vocab_size=50257, seq_len=1024),
    "gpt2-xl": ModelShape(name="gpt2-xl", num_layers=48, hidden=1600, num_heads=25, vocab_size=50257, seq_len=1024),
    # Llama-style models (RMSNorm, RoPE, SwiGLU, GQA, separate Q/K/V projections, fused attention,
    # untied head, no dropout).
    "llama-7b": ModelShape(
        name="llama-7b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=32, ffn_hidden=11008,
        vocab_size=32000, seq_len=4096, norm="rmsnorm", activation="swiglu", position="rope",
        attention="sdpa", dropout=0.0, bias=False, qkv_projection="separate", tied_embeddings=False,
    ),
    "llama3-8b": ModelShape(
        name="llama3-8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
        vocab_size=128256, seq_len=8192, norm="rmsnorm", activation="swiglu", position="rope",
        attention="sdpa", dropout=0.0, bias=False, qkv_projection="separate", tied_embeddings=False,
    ),
}


def get_preset(name: str) -> ModelShape:
    """Look a preset up by name, or read a HF ``config.json`` when given a path."""
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith(".json") and Path(name).exists():
        return ModelShape.from_hf_config(name)
    raise ValueError(
        f"unknown model {name!r}: use one of {sorted(PRESETS)} or a path to a HF config.json"
    )
