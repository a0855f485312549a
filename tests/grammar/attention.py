"""Attention as users write it: projections (separate, fused [q|k|v] split three ways, a low-rank
latent K/V), grouped K/V (expand or repeat_interleave, multi-query), the kernel (SDPA, explicit
softmax, einsum), masks (is_causal, a tensor, ALiBi), rotary on q/k, QK-norm, cross-attention to a
memory of another length (hand-written, or ``nn.MultiheadAttention``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Config
from .parts import RMSNorm, alibi_bias, apply_rope, rope_tables

MAX_LEN = 32


class Attention(nn.Module):
    def __init__(self, c: Config, *, causal: bool, cross: bool = False):
        super().__init__()
        self.c, self.causal, self.cross = c, causal, cross
        h, kvh, d, dim = c.heads, c.kv_heads, c.head_dim, c.hidden
        qkv = "separate" if cross and c.qkv != "latent" else c.qkv  # a query stream and a memory stream
        self.qkv_kind = qkv
        if qkv == "separate":
            self.q = nn.Linear(dim, h * d, bias=c.bias)
            self.k = nn.Linear(dim, kvh * d, bias=c.bias)
            self.v = nn.Linear(dim, kvh * d, bias=c.bias)
        elif qkv == "latent":  # DeepSeek's MLA without its rope split: K/V from a rank-`rank` latent
            self.q = nn.Linear(dim, h * d, bias=c.bias)
            self.kv_down = nn.Linear(dim, d, bias=False)
            self.kv_norm = RMSNorm(d)
            self.kv_up = nn.Linear(d, 2 * kvh * d, bias=False)
        else:
            self.qkv = nn.Linear(dim, (h + 2 * kvh) * d, bias=c.bias)
        self.o = nn.Linear(h * d, dim, bias=c.bias)
        if c.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(d), RMSNorm(d)
        self.rope = c.positions.startswith("rope") and not cross
        if self.rope:
            cos, sin = rope_tables(MAX_LEN, d // 2 if c.positions == "rope_partial" else d, torch.float32)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def project(self, x: torch.Tensor, memory: torch.Tensor | None):
        """q [b, h, s, d]; k, v [b, kvh, t, d]."""
        c, b, s = self.c, x.shape[0], x.shape[1]
        h, kvh, d = c.heads, c.kv_heads, c.head_dim
        src = x if memory is None else memory
        t = src.shape[1]

        def heads(y, n, length):  # [b, len, n*d] -> [b, n, len, d]
            return y.view(b, length, n, d).transpose(1, 2)

        if self.qkv_kind == "separate":
            return heads(self.q(x), h, s), heads(self.k(src), kvh, t), heads(self.v(src), kvh, t)
        if self.qkv_kind == "latent":
            k, v = self.kv_up(self.kv_norm(self.kv_down(src))).split(kvh * d, dim=-1)
            return heads(self.q(x), h, s), heads(k, kvh, t), heads(v, kvh, t)
        fused = self.qkv(x)
        if self.qkv_kind == "fused_unbind":  # timm
            return fused.reshape(b, s, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        if self.qkv_kind == "fused_split":
            q, k, v = fused.split([h * d, kvh * d, kvh * d], dim=-1)
        else:
            q, k, v = fused.chunk(3, dim=-1)
        return heads(q, h, s), heads(k, kvh, s), heads(v, kvh, s)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        c, b, s = self.c, x.shape[0], x.shape[1]
        q, k, v = self.project(x, memory)  # [b, heads, len, d]
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q = apply_rope(q, self.cos, self.sin, c.positions)
            k = apply_rope(k, self.cos, self.sin, c.positions)
        groups = c.heads // c.kv_heads
        if groups > 1:
            if c.kv == "gqa_repeat_interleave":
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            else:  # Llama's repeat_kv: expand a new axis, then merge it into the heads
                t = k.shape[2]
                k = k[:, :, None].expand(b, c.kv_heads, groups, t, c.head_dim).reshape(b, c.heads, t, c.head_dim)
                v = v[:, :, None].expand(b, c.kv_heads, groups, t, c.head_dim).reshape(b, c.heads, t, c.head_dim)
        out = self.attend(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, s, c.heads * c.head_dim))

    def bias_or_mask(self, q_len: int, k_len: int, dtype, device):
        """None, a boolean mask (True = attend) or an additive float bias [h, q, k] / [q, k]."""
        c = self.c
        alibi = c.positions == "alibi" and not self.cross
        causal_tensor = self.causal and (c.mask == "tensor" or alibi or c.kernel != "sdpa")
        if not alibi and not causal_tensor:
            return None
        keep = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril() if causal_tensor else None
        if not alibi:
            return keep
        bias = alibi_bias(c.heads, q_len, k_len, dtype).to(device)
        return bias if keep is None else bias.masked_fill(~keep, float("-inf"))

    def attend(self, q, k, v):
        c = self.c
        mask = self.bias_or_mask(q.shape[2], k.shape[2], q.dtype, q.device)
        if c.kernel == "sdpa":
            is_causal = self.causal and mask is None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        scale = c.head_dim ** -0.5
        if c.kernel == "einsum":
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
        else:
            scores = (q @ k.transpose(-2, -1)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = scores.softmax(dim=-1)
        return torch.einsum("bhqk,bhkd->bhqd", probs, v) if c.kernel == "einsum" else probs @ v


class MHACross(nn.Module):
    """``nn.MultiheadAttention(x, memory, memory)``: its fused ``in_proj_weight``, memory length != query's."""

    def __init__(self, c: Config):
        super().__init__()
        self.mha = nn.MultiheadAttention(c.hidden, c.heads, bias=c.bias, batch_first=True)

    def forward(self, x, memory):
        return self.mha(x, memory, memory, need_weights=False)[0]
