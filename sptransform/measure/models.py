"""A decoder-only transformer built from a ``ModelShape``, for measuring graphs only.

``ShapeModel`` follows the shape's choices: LayerNorm or RMSNorm (computed in
fp32 and cast back before the weight, as the Llama reference code does), GELU
(exact) or SwiGLU MLP, learned or rotary positions, one fused or three separate
Q/K/V projections, explicit softmax attention (QK^T, causal
mask, softmax, dropout, attention over V: the paper's layer) or one fused SDPA
kernel, grouped K/V heads, dropout on attention probabilities and residual
branches, tied or untied head, cross-entropy loss in ``forward``. It is built
under fake tensors by ``fake_model``: nothing is allocated, so one layer of a 1T
model can be traced on a laptop.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from sptransform.copying import faithful_deepcopy
from sptransform.planner.presets import ModelShape
from sptransform.torch_internals import FakeTensorMode


class _Attention(nn.Module):
    def __init__(self, shape: ModelShape, seq: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.kv_heads, shape.head_dim
        widths = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        self.widths, self.fused_qkv = widths, shape.qkv_projection == "fused"
        if self.fused_qkv:
            self.qkv = nn.Linear(shape.hidden, sum(widths), bias=shape.bias)
        else:
            self.q, self.k, self.v = (nn.Linear(shape.hidden, w, bias=shape.bias) for w in widths)
        self.proj = nn.Linear(self.heads * self.head_dim, shape.hidden, bias=shape.bias)
        self.dropout, self.fused = shape.dropout, shape.attention == "sdpa"
        self.rotary = shape.position == "rope"
        if not self.fused:
            self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)
        if self.rotary:
            inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
            angles = torch.outer(torch.arange(seq).float(), inv_freq).repeat(1, 2)  # [s, hd]
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        s = x.size(2)
        half = x.size(-1) // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos[:s].to(x.dtype) + turned * self.sin[:s].to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.fused_qkv:
            q, k, v = self.qkv(x).split(self.widths, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [b, a, s, hd]
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)  # [b, kv, s, hd]
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary:
            q, k = self._rotate(q), self._rotate(k)
        p = self.dropout if self.training else 0.0
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                               enable_gqa=self.kv_heads != self.heads)
        else:
            if self.kv_heads != self.heads:
                k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
                v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [b, a, s, s]
            att = att.masked_fill(~self.causal[:s, :s], float("-inf"))
            att = F.softmax(att, dim=-1)
            if p > 0:  # dropout(p=0) in training still copies, which would keep a second s x s tensor
                att = F.dropout(att, p, self.training)
            y = att @ v  # [b, a, s, hd]
        return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.swiglu = shape.activation == "swiglu"
        self.up = nn.Linear(shape.hidden, shape.ffn, bias=shape.bias)
        if self.swiglu:
            self.gate = nn.Linear(shape.hidden, shape.ffn, bias=shape.bias)
        self.down = nn.Linear(shape.ffn, shape.hidden, bias=shape.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class _RMSNorm(nn.Module):
    """RMSNorm as Llama's reference code writes it: statistics in fp32, the normalized
    tensor cast back to the input's dtype, then scaled. Autograd keeps the fp32 input,
    the per-token rstd and the cast normalized tensor (for the weight's gradient)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normalized = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normalized.to(x.dtype)


def _norm(shape: ModelShape) -> nn.Module:
    if shape.norm == "rmsnorm":
        return _RMSNorm(shape.hidden)
    return nn.LayerNorm(shape.hidden, bias=shape.bias)


class _Block(nn.Module):
    def __init__(self, shape: ModelShape, seq: int):
        super().__init__()
        self.norm1, self.attn = _norm(shape), _Attention(shape, seq)
        self.norm2, self.mlp = _norm(shape), _MLP(shape)
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class ShapeModel(nn.Module):
    """``shape`` as a module; ``num_layers`` overrides ``shape.num_layers`` (trace one layer of many)."""

    def __init__(self, shape: ModelShape, *, seq: int | None = None, num_layers: int | None = None):
        super().__init__()
        seq = seq or shape.seq_len
        self.wte = nn.Embedding(shape.vocab_size, shape.hidden)
        self.wpe = nn.Embedding(seq, shape.hidden) if shape.position == "learned" else None
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(_Block(shape, seq) for _ in range(num_layers or shape.num_layers))
        self.norm = _norm(shape)
        self.head = nn.Linear(shape.hidden, shape.vocab_size, bias=False)
        if shape.tied_embeddings:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)  # [b, s, h]
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.size(1), device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # [b, s, v]
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def fake_copy(module: nn.Module, *, dtype: torch.dtype | None = None) -> tuple[nn.Module, FakeTensorMode]:
    """A deep copy of ``module`` (e.g. built on the meta device) whose parameters and buffers are
    fake tensors, floating ones in ``dtype``; and the fake mode to make its inputs in."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    memo: dict[int, torch.Tensor] = {}
    with fake_mode:
        for t in [*module.parameters(), *module.buffers()]:
            fake = torch.empty(t.shape, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return faithful_deepcopy(module, memo).train(module.training), fake_mode


def fake_model(
    shape: ModelShape, *, seq: int, batch: int, dtype: torch.dtype = torch.bfloat16, num_layers: int = 1
) -> tuple[ShapeModel, tuple[torch.Tensor, torch.Tensor]]:
    """``ShapeModel`` with fake parameters in ``dtype`` and fake token inputs: allocates nothing."""
    if seq > shape.seq_len and shape.position == "learned":
        raise ValueError(f"seq={seq} is longer than {shape.name}'s {shape.seq_len} learned positions")
    with torch.device("meta"):
        template = ShapeModel(shape, seq=seq, num_layers=num_layers)
    model, fake_mode = fake_copy(template, dtype=dtype)
    with fake_mode:
        idx = torch.zeros(batch, seq, dtype=torch.long)
        targets = torch.zeros(batch, seq, dtype=torch.long)
    return model, (idx, targets)
