"""Model shapes the CLI and the planner know by name.

A preset describes a decoder-only transformer by its shape only; it never holds
weights. ``ModelShape.from_hf_config`` reads the same fields from an HF
``config.json``. Table 3 of Korthikanti et al. (2022) gives the four large GPT
configurations (sequence 2048, vocabulary 51200, explicit softmax attention with
dropout, GELU MLP of width 4h, LayerNorm, learned positions).
"""

from __future__ import annotations

import json
import math
import os
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

    def __post_init__(self):
        check_shape(self)

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
        """Read a HF ``config.json`` (GPT-2 or Llama-style field names), or a folder holding one."""
        return load_hf_config(path)


MAX_SIZE = 2**24
"""The largest layer count, width, head count, vocabulary or sequence length a shape may have
(16,777,216: far above any real model; products of a few such sizes still fit int64, which the
traced fake tensors of ``sptransform memory`` need)."""

_SIZE_FIELDS = ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size", "seq_len")
_CHOICES = {
    "norm": ("layernorm", "rmsnorm"), "activation": ("gelu", "swiglu"), "position": ("learned", "rope"),
    "attention": ("explicit", "sdpa"), "qkv_projection": ("fused", "separate"),
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_shape(shape: ModelShape) -> None:
    """Raise ``ValueError`` naming the field, the rule and the fix when ``shape`` is not a model:
    sizes are integers in [1, ``MAX_SIZE``] (``vocab_size`` may be 0: no embedding or head;
    ``num_kv_heads`` and ``ffn_hidden`` may be ``None``: the defaults), ``hidden`` is divisible
    by ``num_heads``, ``num_heads`` by ``num_kv_heads``, RoPE needs an even head size, and
    dropout is in [0, 1)."""
    where = f"model shape {shape.name!r}"
    for name in _SIZE_FIELDS:
        value = getattr(shape, name)
        if value is None and name in ("num_kv_heads", "ffn_hidden"):
            continue
        smallest = 0 if name == "vocab_size" else 1
        if not _is_int(value) or not smallest <= value <= MAX_SIZE:
            raise ValueError(f"{where}: {name}={value!r} must be an integer in [{smallest}, {MAX_SIZE:,}]")
    _check_divisible(where, ("hidden", shape.hidden), ("num_heads", shape.num_heads),
                     ("num_kv_heads", shape.kv_heads), rope=shape.position == "rope")
    for name, allowed in _CHOICES.items():
        if getattr(shape, name) not in allowed:
            raise ValueError(f"{where}: {name}={getattr(shape, name)!r} is not one of {list(allowed)}")
    if not isinstance(shape.dropout, (int, float)) or isinstance(shape.dropout, bool) \
            or not 0 <= shape.dropout < 1:
        raise ValueError(f"{where}: dropout={shape.dropout!r} must be a probability in [0, 1)")


def _nearest_divisors(n: int, near: int, *, count: int = 2) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    every = set(small + [n // d for d in small])
    return sorted(sorted(every, key=lambda d: (abs(d - near), -d))[:count])


def _check_divisible(where: str, hidden: tuple[str, int], heads: tuple[str, int], kv_heads: tuple[str, int],
                     *, rope: bool) -> None:
    """The rules a transformer's attention shape obeys, worded with the caller's field names."""
    (hidden_name, h), (heads_name, a), (kv_name, kv) = hidden, heads, kv_heads
    if h % a:
        raise ValueError(
            f"{where}: {hidden_name}={h} is not divisible by {heads_name}={a} (every head gets "
            f"{hidden_name} / {heads_name} features): use a head count that divides {h}, "
            f"e.g. {' or '.join(map(str, _nearest_divisors(h, a)))}"
        )
    if kv > a or a % kv:
        fitting = sorted(_nearest_divisors(a, kv, count=6))
        raise ValueError(
            f"{where}: {heads_name}={a} is not divisible by {kv_name}={kv} (query heads share K/V heads in "
            f"equal groups): use {kv_name} in {fitting}"
        )
    if rope and (h // a) % 2:
        raise ValueError(
            f"{where}: the head size {hidden_name} / {heads_name} = {h} / {a} = {h // a} is odd, and rotary "
            "position embeddings rotate pairs of features: use a head count that leaves an even head size"
        )


_HF_FIELDS = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "num_heads": ("num_attention_heads", "n_head"),
}
_HF_OPTIONAL_SIZES = {
    "num_kv_heads": ("num_key_value_heads",),
    "ffn_hidden": ("intermediate_size", "n_inner"),
    "vocab_size": ("vocab_size",),
    "seq_len": ("max_position_embeddings", "n_positions"),
}


def _hf_size(data: dict, keys: tuple[str, ...], where: str, *, required_for: str | None = None):
    """(key, value) of the first of ``keys`` present (and not null when optional); ``(None, None)``
    when none is."""
    present = [k for k in keys if k in data and (required_for or data[k] is not None)]
    if not present:
        if required_for:
            raise ValueError(f"{where} has none of the fields {list(keys)} needed for {required_for}; "
                             "add one of them to the config")
        return None, None
    key = present[0]
    value = data[key]
    if not _is_int(value) or not 1 <= value <= MAX_SIZE:
        shown = "null" if value is None else json.dumps(value)
        raise ValueError(f"{where}: field {key!r} is {shown}; it must be a positive integer "
                         f"(at most {MAX_SIZE:,}): write e.g. \"{key}\": {_EXAMPLES.get(key, 8)}")
    return key, value


_EXAMPLES = {"num_hidden_layers": 12, "n_layer": 12, "hidden_size": 768, "n_embd": 768, "num_attention_heads": 12,
             "n_head": 12, "num_key_value_heads": 4, "intermediate_size": 3072, "n_inner": 3072,
             "vocab_size": 50257, "max_position_embeddings": 1024, "n_positions": 1024}


_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_LATENT_ATTENTION_FIELDS = ("kv_lora_rank", "q_lora_rank")


def _refuse_unmodelled(data: dict, where: str) -> None:
    """A ``ModelShape`` is a dense transformer with multi-head (or grouped-query) attention. A
    config with routed experts or latent (low-rank) attention would be read as one, and every
    count the planner gives (parameters, memory, FLOPs) would be off by what it leaves out: it
    is refused, naming the fields, rather than planned wrong."""
    problems = []
    experts = [(k, data[k]) for k in _EXPERT_FIELDS if _is_int(data.get(k)) and data[k] > 1]
    if experts:
        key, count = experts[0]
        problems.append(f"field {key!r} is {count}: routed experts (a mixture-of-experts model), whose "
                        f"{count} expert MLPs per layer the planner's dense layer would leave out")
    latent = [k for k in _LATENT_ATTENTION_FIELDS if data.get(k) is not None]
    if latent:
        problems.append(f"field {latent[0]!r} is {json.dumps(data[latent[0]])}: latent (low-rank) attention, "
                        "whose projections are not the planner's Q/K/V/O")
    if problems:
        raise ValueError(
            f"{where} describes a model the planner does not model yet: " + "; ".join(problems) + ". Its "
            "parameter count, memory and FLOPs would be a dense transformer's, wrong by what it leaves out. "
            "Measure the model itself instead: sptransform.parallelize(model, ...).explain() and held_share() "
            "give each rank's parameters, and sptransform verify --model config.json runs it on real ranks")


def shape_from_hf_dict(data: dict, *, name: str = "hf-config") -> ModelShape:
    """Build a ``ModelShape`` from a HF config dictionary. Every field read is checked (present
    where needed, a positive integer, heads dividing hidden and K/V heads dividing heads); an
    error names the config's own field. Configs of models a ``ModelShape`` cannot describe
    (routed experts, latent attention) are refused (``_refuse_unmodelled``)."""
    where = f"config {name!r}"
    if not isinstance(data, dict):
        raise ValueError(f"{where} is a JSON {type(data).__name__}, not an object: "
                         "a HF config.json holds one object of fields")
    _refuse_unmodelled(data, where)
    found = {ours: _hf_size(data, theirs, where, required_for=ours) for ours, theirs in _HF_FIELDS.items()}
    found.update({ours: _hf_size(data, theirs, where) for ours, theirs in _HF_OPTIONAL_SIZES.items()})
    values = {ours: value for ours, (_, value) in found.items() if value is not None}
    kv_key, _ = found["num_kv_heads"]
    _check_divisible(where, (found["hidden"][0], values["hidden"]), (found["num_heads"][0], values["num_heads"]),
                     (kv_key or found["num_heads"][0], values.get("num_kv_heads", values["num_heads"])),
                     rope="rope_theta" in data or "rope_scaling" in data)
    dropout_key = next((k for k in ("attn_pdrop", "attention_dropout") if data.get(k) is not None), None)
    dropout = data[dropout_key] if dropout_key else 0.0
    if dropout_key and (not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1):
        raise ValueError(f"{where}: field {dropout_key!r} is {json.dumps(dropout)}; it must be a probability "
                         f"in [0, 1): write e.g. \"{dropout_key}\": 0.1")
    tied = data.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise ValueError(f"{where}: field 'tie_word_embeddings' is {json.dumps(tied)}; write true or false")
    is_llama_like = "intermediate_size" in data or data.get("hidden_act") == "silu"
    return ModelShape(
        name=name,
        norm="rmsnorm" if "rms_norm_eps" in data else "layernorm",
        activation="swiglu" if is_llama_like else "gelu",
        position="rope" if "rope_theta" in data or "rope_scaling" in data else "learned",
        attention="sdpa" if data.get("_attn_implementation", data.get("attn_implementation")) == "sdpa" else "explicit",
        dropout=float(dropout),
        bias=not is_llama_like,
        qkv_projection="separate" if is_llama_like else "fused",
        tied_embeddings=tied,
        **values,
    )


def load_hf_config(path: str | Path) -> ModelShape:
    """Read and check a HF ``config.json`` (or the ``config.json`` in a folder); every problem with
    the file is a ``ValueError`` that names it."""
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{str(path)!r} is a folder without a config.json: give the path of a HF config.json")
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(path)!r}: no such file" + ("" if path.exists() else
                                                            "; give the path of a HF config.json"))
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{str(path)!r} is not a text file: give a HF config.json") from None
    except OSError as error:
        raise ValueError(f"cannot read {str(path)!r} ({error.strerror}): give a readable HF config.json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON ({error.msg} at line {error.lineno} column "
                         f"{error.colno}): fix the file, a HF config.json holds one object of fields") from None
    return shape_from_hf_dict(data, name=path.stem)


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
    """Look a preset up by name, or read a HF ``config.json`` (or a folder holding one) when given
    a path; ``ValueError`` names what is wrong."""
    if name in PRESETS:
        return PRESETS[name]
    path = Path(name)
    if path.exists() or name.endswith(".json") or "/" in name or os.sep in name:
        return load_hf_config(path)
    raise ValueError(
        f"unknown model {name!r}: use one of {sorted(PRESETS)} or a path to a HF config.json"
    )
