"""Small single-device transformers written the way users write them, with the
knobs the property tests draw: norm, MLP kind, K/V heads, bias, tied head,
dropout, and batch- or sequence-first layout. No parallelism inside."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 61
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 4
    layers: int = 1
    ffn: int = 64
    max_len: int = 64
    norm: str = "layernorm"  # or "rmsnorm"
    mlp: str = "gelu"  # or "swiglu"
    bias: bool = True
    tied: bool = True
    dropout: float = 0.0
    seq_first: bool = False
    sdpa: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.c = c
        hd = c.hidden // c.heads
        self.q = nn.Linear(c.hidden, c.heads * hd, bias=c.bias)
        self.kv = nn.Linear(c.hidden, 2 * c.kv_heads * hd, bias=c.bias)  # fused [k|v]
        self.o = nn.Linear(c.heads * hd, c.hidden, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):  # x: [b, s, h]
        b, s, _ = x.shape
        c, hd = self.c, self.c.hidden // self.c.heads
        q = self.q(x).view(b, s, c.heads, hd).transpose(1, 2)
        k, v = self.kv(x).split(c.kv_heads * hd, dim=-1)
        k = k.view(b, s, c.kv_heads, hd).transpose(1, 2)
        v = v.view(b, s, c.kv_heads, hd).transpose(1, 2)
        rep = c.heads // c.kv_heads
        if c.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
        else:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = self.drop(att) @ v
        return self.drop(self.o(y.transpose(1, 2).reshape(b, s, -1)))


class MLP(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.c = c
        self.up = nn.Linear(c.hidden, c.ffn, bias=c.bias)
        if c.mlp == "swiglu":
            self.gate = nn.Linear(c.hidden, c.ffn, bias=c.bias)
        self.down = nn.Linear(c.ffn, c.hidden, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        if self.c.mlp == "swiglu":
            h = F.silu(self.gate(x)) * self.up(x)
        else:
            h = F.gelu(self.up(x))
        return self.drop(self.down(h))


def make_norm(c: TinyConfig) -> nn.Module:
    return RMSNorm(c.hidden) if c.norm == "rmsnorm" else nn.LayerNorm(c.hidden, bias=c.bias)


class Block(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = make_norm(c), Attention(c), make_norm(c), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.c = c
        self.tok = nn.Embedding(c.vocab, c.hidden)
        self.pos = nn.Embedding(c.max_len, c.hidden)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = make_norm(c)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.tok.weight

    def forward(self, ids, targets):
        if self.c.seq_first:  # ids: [s, b]; the blocks still see [b, s, h]
            ids, targets = ids.t(), targets.t()
        s = ids.shape[1]
        x = self.drop(self.tok(ids) + self.pos(torch.arange(s, device=ids.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class SeqFirstLM(nn.Module):
    """Megatron-style layout: activations are [s, b, h] throughout."""

    def __init__(self, c: TinyConfig):
        super().__init__()
        self.c = c
        self.tok = nn.Embedding(c.vocab, c.hidden)
        self.pos = nn.Embedding(c.max_len, c.hidden)
        hd = c.hidden // c.heads
        self.ln1, self.ln2, self.lnf = (nn.LayerNorm(c.hidden) for _ in range(3))
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.o = nn.Linear(c.hidden, c.hidden)
        self.up, self.down = nn.Linear(c.hidden, c.ffn), nn.Linear(c.ffn, c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.hd = hd

    def forward(self, ids, targets):  # ids: [s, b]
        s, b = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(s, device=ids.device)).unsqueeze(1)  # [s, b, h]
        h = self.ln1(x)
        q, k, v = self.qkv(h).view(s, b, self.c.heads, 3 * self.hd).split(self.hd, dim=-1)  # per-head [q|k|v]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, nh, s, hd]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.permute(2, 0, 1, 3).reshape(s, b, -1))
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class LayoutConfig:
    """The layouts attention code hands between ops, as litgpt writes them (Llama 2/3, Qwen 3,
    Gemma 2): a fused [q|k|v] projection viewed to heads and transposed, rotary on the first
    ``rope_dims`` of each head joined back with ``cat`` (an empty second part when it covers
    the whole head), grouped K/V heads expanded to the query heads, and either SDPA or an
    explicit attention with tanh soft-capping whose matmuls view transposed, expanded tensors."""

    vocab: int = 61
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    layers: int = 1
    rope_dims: int = 8  # of head_dim = hidden // heads
    expand: str = "repeat_interleave"  # litgpt; or "expand" (HF's repeat_kv: expand + reshape)
    attention: str = "softcap"  # Gemma 2; or "sdpa"
    softcap: float = 5.0


class LayoutAttention(nn.Module):
    def __init__(self, c: LayoutConfig):
        super().__init__()
        self.c, hd = c, c.hidden // c.heads
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * hd, bias=False)
        self.proj = nn.Linear(c.heads * hd, c.hidden, bias=False)

    def _rope(self, x, cos, sin):  # x: [b, heads, s, hd], rotate-half on the first rope_dims
        n = self.c.rope_dims
        x1, x2 = x[..., : n // 2], x[..., n // 2 : n]
        roped = x[..., :n] * cos + torch.cat((-x2, x1), dim=-1) * sin
        return torch.cat((roped, x[..., n:]), dim=-1)

    def _expand(self, x):  # [b, kv_heads, s, hd] -> [b, heads, s, hd]
        rep = self.c.heads // self.c.kv_heads
        if self.c.expand == "expand":
            b, g, s, hd = x.shape
            return x[:, :, None].expand(b, g, rep, s, hd).reshape(b, g * rep, s, hd)
        return x.repeat_interleave(rep, dim=1)

    def forward(self, x, cos, sin):  # x: [b, s, h]
        b, s, _ = x.shape
        c, hd = self.c, self.c.hidden // self.c.heads
        q, k, v = self.qkv(x).split((c.heads * hd, c.kv_heads * hd, c.kv_heads * hd), dim=-1)
        q = q.view(b, s, c.heads, hd).transpose(1, 2)  # [b, heads, s, hd], not contiguous
        k = k.view(b, s, c.kv_heads, hd).transpose(1, 2)
        v = v.view(b, s, c.kv_heads, hd).transpose(1, 2)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        k, v = self._expand(k), self._expand(v)
        if c.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5)
        else:
            scores = q @ k.mT * hd**-0.5
            scores = torch.tanh(scores / c.softcap) * c.softcap
            mask = torch.ones(s, s, dtype=q.dtype, device=q.device).triu(diagonal=1) * torch.finfo(q.dtype).min
            y = F.softmax(scores + mask, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, s, c.heads * hd))


class LayoutLM(nn.Module):
    """Tokens in, the cross-entropy loss out (the loss inside the module, as a training wrapper
    has it). Pre-norm attention blocks without an MLP: the layouts are the attention's, and
    each op less is less for inductor to compile in the tests."""

    def __init__(self, c: LayoutConfig, max_len: int = 64):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.hidden)
        self.norms = nn.ModuleList(RMSNorm(c.hidden) for _ in range(c.layers))
        self.blocks = nn.ModuleList(LayoutAttention(c) for _ in range(c.layers))
        self.norm, self.head = RMSNorm(c.hidden), nn.Linear(c.hidden, c.vocab, bias=False)
        angles = torch.arange(max_len)[:, None] / 10000 ** (torch.arange(c.rope_dims // 2) / (c.rope_dims // 2))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, ids, targets):
        s = ids.shape[1]
        x, cos, sin = self.tok(ids), self.cos[:s], self.sin[:s]
        for norm, attention in zip(self.norms, self.blocks):
            x = x + attention(norm(x), cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
