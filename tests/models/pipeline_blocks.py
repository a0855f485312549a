"""Small causal LMs whose attention the tensor-parallel analysis does not recognise as an
attention region, but whose layers a pipeline can still cut between (issue 23, item 2):

* ``AlternatingLM``: an x-transformers-like ``ModuleList`` that alternates attention and
  feed-forward entries (``[norm, block]`` pairs, ``x = block(norm(x)) + x``), so a "layer" is
  two list entries;
* ``QKNormLM``: OLMo-2-like, QK-norm (an RMSNorm over the whole q and k projections, before the
  head split) and norms after each sublayer (``x = x + norm(attn(x))``);
* ``MultiQueryLM``: Falcon-like, one fused QKV linear with one K/V head for all query heads
  and a parallel attention + MLP block (``x = x + attn(ln(x)) + mlp(ln(x))``).

Each answers ``forward(idx, targets)`` with the cross-entropy loss. Written by hand, so that a
CI without x-transformers or litgpt runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class BlocksConfig:
    vocab: int = 96
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    ffn: int = 64
    max_len: int = 64


def _causal_attention(q, k, v):  # [b, heads, s, d] each -> [b, s, heads * d]
    b, _, s, _ = q.shape
    scores = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, s, -1)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class _LM(nn.Module):
    """Embedding, the subclass's ``body``, final norm, head and loss."""

    def __init__(self, c: BlocksConfig):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.norm = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def body(self, x):
        raise NotImplementedError

    def forward(self, idx, targets):
        x = self.body(self.embed(idx))  # [b, s, hidden]
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------------------------
# x-transformers-like: one list of [norm, attention] and [norm, feed-forward] entries


class _AltAttention(nn.Module):
    def __init__(self, c: BlocksConfig):
        super().__init__()
        self.heads = c.heads
        self.to_q = nn.Linear(c.hidden, c.hidden, bias=False)
        self.to_k = nn.Linear(c.hidden, c.hidden, bias=False)
        self.to_v = nn.Linear(c.hidden, c.hidden, bias=False)
        self.to_out = nn.Linear(c.hidden, c.hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * q.size(-1) ** -0.5
        intermediates = [sim.clone()]  # noqa: F841 (x-transformers keeps qk_similarities for its caller)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, s, -1))


class AlternatingLM(_LM):
    def __init__(self, c: BlocksConfig = BlocksConfig()):
        super().__init__(c)
        self.layers = nn.ModuleList()
        for _ in range(c.layers):
            self.layers.append(nn.ModuleList([nn.LayerNorm(c.hidden), _AltAttention(c)]))
            feed_forward = nn.Sequential(nn.Linear(c.hidden, c.ffn), nn.GELU(), nn.Linear(c.ffn, c.hidden))
            self.layers.append(nn.ModuleList([nn.LayerNorm(c.hidden), feed_forward]))

    def body(self, x):
        for norm, block in self.layers:
            x = block(norm(x)) + x
        return x


# --------------------------------------------------------------------------------------------
# OLMo-2-like: QK-norm over the whole projections, norms after each sublayer


class _QKNormBlock(nn.Module):
    def __init__(self, c: BlocksConfig):
        super().__init__()
        self.heads = c.heads
        self.q_proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.o_proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.q_norm = _RMSNorm(c.hidden)  # over all heads at once: the head split comes after
        self.k_norm = _RMSNorm(c.hidden)
        self.post_attention_norm = _RMSNorm(c.hidden)
        self.gate = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.hidden, bias=False)
        self.post_feedforward_norm = _RMSNorm(c.hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(b, s, self.heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.heads, -1).transpose(1, 2)
        x = x + self.post_attention_norm(self.o_proj(_causal_attention(q, k, v)))
        return x + self.post_feedforward_norm(self.down(F.silu(self.gate(x)) * self.up(x)))


class QKNormLM(_LM):
    def __init__(self, c: BlocksConfig = BlocksConfig()):
        super().__init__(c)
        self.blocks = nn.ModuleList(_QKNormBlock(c) for _ in range(c.layers))

    def body(self, x):
        for block in self.blocks:
            x = block(x)
        return x


# --------------------------------------------------------------------------------------------
# Falcon-like: fused QKV with one K/V head (multi-query), parallel attention and MLP


class _MultiQueryBlock(nn.Module):
    def __init__(self, c: BlocksConfig):
        super().__init__()
        self.heads, self.head_dim = c.heads, c.hidden // c.heads
        self.ln = nn.LayerNorm(c.hidden)
        self.query_key_value = nn.Linear(c.hidden, (c.heads + 2) * self.head_dim, bias=False)
        self.dense = nn.Linear(c.hidden, c.hidden, bias=False)
        self.up = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.ln(x)
        fused = self.query_key_value(y).view(b, s, self.heads + 2, self.head_dim)
        q = fused[:, :, :-2].transpose(1, 2)                                     # [b, heads, s, d]
        k = fused[:, :, -2:-1].transpose(1, 2).expand(b, self.heads, s, self.head_dim)
        v = fused[:, :, -1:].transpose(1, 2).expand(b, self.heads, s, self.head_dim)
        attention = self.dense(_causal_attention(q, k, v))
        mlp = self.down(F.gelu(self.up(y)))
        return x + attention + mlp


class MultiQueryLM(_LM):
    def __init__(self, c: BlocksConfig = BlocksConfig()):
        super().__init__(c)
        self.h = nn.ModuleList(_MultiQueryBlock(c) for _ in range(c.layers))

    def body(self, x):
        for block in self.h:
            x = block(x)
        return x


BLOCK_MODELS = {"alternating": AlternatingLM, "qk_norm": QKNormLM, "multi_query": MultiQueryLM}
