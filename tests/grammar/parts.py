"""Norms, positions and MLPs, each spelling as users write it (the names are ``config.CHOICES``)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- norms ------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Llama's: ``x * rsqrt(mean(x^2) + eps) * w``; ``one_plus``: Gemma's ``x * (1 + w)`` with w at 0;
    ``float32``: computed in float32 and cast back to the input's dtype."""

    def __init__(self, dim: int, one_plus: bool = False, float32: bool = False):
        super().__init__()
        self.one_plus, self.float32 = one_plus, float32
        self.weight = nn.Parameter(torch.zeros(dim) if one_plus else torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        if self.float32:
            x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        w = (1 + self.weight) if self.one_plus else self.weight
        if self.float32:
            return (x * w.float()).to(dtype)
        return x * w


class ManualLayerNorm(nn.Module):
    """LayerNorm written out: mean, var (unbiased=False), weight and bias."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


def norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "layernorm_manual":
        return ManualLayerNorm(dim)
    return RMSNorm(dim, one_plus=kind == "rms_one_plus", float32=kind == "rms_float32")


# -- positions --------------------------------------------------------------------------------


def rope_tables(seq: int, rot_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)  # [s, rot/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kind: str) -> torch.Tensor:
    """``x``: [b, h, s, d]. ``rope_interleaved``: pairs (x0, x1), (x2, x3) (GPT-J, Meta's reference);
    ``rope_halves``: rotate_half (HF Llama); ``rope_partial``: halves on the first half of d only
    (GPT-NeoX's rotary_pct, Phi)."""
    s = x.shape[-2]
    cos, sin = cos[:s], sin[:s]
    if kind == "rope_interleaved":
        pairs = x.unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    rot = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    a, b = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos2 + torch.cat([-b, a], dim=-1) * sin2
    return torch.cat([rotated, x_pass], dim=-1) if kind == "rope_partial" else rotated


def alibi_bias(heads: int, q_len: int, k_len: int, dtype) -> torch.Tensor:
    """[h, q, k]: -slope_h * distance (BLOOM's ALiBi with slopes 2^(-8 h / H))."""
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64)
    distance = (torch.arange(q_len)[:, None] - torch.arange(k_len)[None, :]).abs().to(torch.float64)
    return (-slopes[:, None, None] * distance).to(dtype)


# -- MLPs -------------------------------------------------------------------------------------


class MLP(nn.Module):
    """``gelu``: up, GELU, down (nn.Sequential-free, as nanoGPT); ``swiglu``/``geglu``: separate gate
    and up (Llama/T5v1.1); ``fused_gate_up``: one [gate|up] linear chunked (Phi-3, ChatGLM);
    ``cast_weight``: ``F.linear(x, w.to(x.dtype))`` (weights cast before use, AMP-style code)."""

    def __init__(self, kind: str, dim: int, bias: bool):
        super().__init__()
        self.kind, ffn = kind, 2 * dim
        if kind in ("swiglu", "geglu"):
            self.gate = nn.Linear(dim, ffn, bias=bias)
        if kind == "fused_gate_up":
            self.gate_up = nn.Linear(dim, 2 * ffn, bias=bias)
        else:
            self.up = nn.Linear(dim, ffn, bias=bias)
        self.down = nn.Linear(ffn, dim, bias=bias)

    def forward(self, x):
        if self.kind == "gelu":
            return self.down(F.gelu(self.up(x)))
        if self.kind == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        if self.kind == "geglu":
            return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))
        if self.kind == "fused_gate_up":
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        up = self.up
        h = F.gelu(F.linear(x, up.weight.to(x.dtype), None if up.bias is None else up.bias.to(x.dtype)))
        return F.linear(h, self.down.weight.to(x.dtype), None if self.down.bias is None else self.down.bias.to(x.dtype))


def embed_scale(dim: int) -> float:
    return math.sqrt(dim)
