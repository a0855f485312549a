"""A zoo of small causal LMs written in styles ``transformers`` does not use, so that model
code nobody on this project has seen is what ``parallelize`` meets.

Every model is self-contained (its own blocks, norms and attention, written the way its style's
authors write them), tiny (2 layers, hidden 64, 4 heads unless its style needs other head
counts, a vocabulary between 97 and 257) and answers ``forward(idx, targets=None)``: the
cross-entropy loss with ``targets``, else the logits. ``ZOO`` maps a name to an ``Entry``:
how to build it, its inputs (2 x 16 tokens, a multiple of 4 so that tp=4 with SP can split
the sequence) and the style it is written in. Helpers shared between models are kept to
nothing but the loss, so no two models share a bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, HEADS, LAYERS, MAX_SEQ = 64, 4, 2, 64
BATCH, SEQ = 2, 16


def _loss_or_logits(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    if targets is None:
        return logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------------------------
# 1. Llama reference style: complex-number rotary (view_as_complex / view_as_real), a plain
#    tensor attribute for the frequencies, a mask made in forward, repeat_kv, w1/w2/w3 SwiGLU


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class LlamaRefRMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class LlamaRefAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class LlamaRefFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaRefBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.attention = LlamaRefAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = LlamaRefFeedForward(dim, 4 * dim, multiple_of=32)
        self.attention_norm = LlamaRefRMSNorm(dim)
        self.ffn_norm = LlamaRefRMSNorm(dim)

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaReference(nn.Module):
    """8 query heads, 4 K/V heads (tp=4 divides both)."""

    def __init__(self, vocab_size=128, dim=HIDDEN, n_layers=LAYERS, n_heads=8, n_kv_heads=4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = torch.nn.ModuleList(LlamaRefBlock(dim, n_heads, n_kv_heads) for _ in range(n_layers))
        self.norm = LlamaRefRMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(dim // n_heads, MAX_SEQ * 2)  # a plain attribute, as there

    def forward(self, idx, targets=None):
        _bsz, seqlen = idx.shape
        h = self.tok_embeddings(idx)
        freqs_cis = self.freqs_cis[0:seqlen]
        mask = torch.full((seqlen, seqlen), float("-inf"), device=idx.device)
        mask = torch.triu(mask, diagonal=1).type_as(h)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        h = self.norm(h)
        return _loss_or_logits(self.output(h).float(), targets)


# --------------------------------------------------------------------------------------------
# 2. attention written with torch.einsum (projections are nn.Linear)


class EinsumAttentionLM(nn.Module):
    def __init__(self, vocab=97, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(MAX_SEQ, d) * 0.02)
        self.blocks = nn.ModuleList()
        for _ in range(n_layer):
            self.blocks.append(nn.ModuleDict(dict(
                ln1=nn.LayerNorm(d), q=nn.Linear(d, d), k=nn.Linear(d, d), v=nn.Linear(d, d), o=nn.Linear(d, d),
                ln2=nn.LayerNorm(d), up=nn.Linear(d, 4 * d), down=nn.Linear(4 * d, d))))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def attend(self, blk, x):
        b, t, d = x.shape
        n = self.n_head
        q = blk["q"](x).view(b, t, n, d // n)
        k = blk["k"](x).view(b, t, n, d // n)
        v = blk["v"](x).view(b, t, n, d // n)
        scores = torch.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(d // n)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, t, d)
        return blk["o"](out)

    def forward(self, idx, targets=None):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = x + self.attend(blk, blk["ln1"](x))
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        return _loss_or_logits(self.head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 3. q @ k.mT with an explicit masked softmax over a boolean tril buffer, attention dropout;
#    no position information at all (NoPE)


class MatmulSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head = n_head
        self.query, self.key, self.value = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool))[None, None])

    def forward(self, x):
        B, T, C = x.size()
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.mT) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.causal[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MatmulMaskedSoftmaxLM(nn.Module):
    def __init__(self, vocab=101, n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.attn = nn.ModuleList(MatmulSelfAttention(n_embd, n_head, dropout) for _ in range(n_layer))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
                                 for _ in range(n_layer))
        self.ln1 = nn.ModuleList(nn.LayerNorm(n_embd) for _ in range(n_layer))
        self.ln2 = nn.ModuleList(nn.LayerNorm(n_embd) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab)

    def forward(self, idx, targets=None):
        x = self.tok(idx)
        for attn, mlp, ln1, ln2 in zip(self.attn, self.mlp, self.ln1, self.ln2):
            x = x + attn(ln1(x))
            x = x + mlp(ln2(x))
        return _loss_or_logits(self.lm_head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 4. GPT-J style interleaved rotary: rotate_every_two with torch.stack(...).flatten(-2), sin/cos
#    computed in forward and repeat_interleave'd, applied on [b, s, heads, head_dim]


def fixed_pos_embedding(seq_len: int, dim: int, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    sinusoid_inp = torch.einsum("i , j -> i j", torch.arange(seq_len, device=device).float(), inv_freq)
    return torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_pos_emb_gptj(x, sincos):
    sin, cos = (t[None, :, None, :].repeat_interleave(2, 3) for t in sincos)
    return (x * cos) + (rotate_every_two(x) * sin)


class GPTJStyleBlock(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln = nn.LayerNorm(d)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc_in = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln(x)
        q = self.q_proj(h).view(b, s, self.n_head, -1)
        k = self.k_proj(h).view(b, s, self.n_head, -1)
        v = self.v_proj(h).view(b, s, self.n_head, -1)
        sincos = fixed_pos_embedding(s, q.shape[-1], x.device)
        q, k = apply_rotary_pos_emb_gptj(q, sincos), apply_rotary_pos_emb_gptj(k, sincos)
        y = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3),
                                           is_causal=True)
        x = x + self.out_proj(y.permute(0, 2, 1, 3).reshape(b, s, d))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln2(x)), approximate="tanh"))


class GPTJInterleavedRotaryLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(GPTJStyleBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return _loss_or_logits(self.lm_head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 5. one fused [q | k | v] weight with fewer K/V heads (8 query heads, 4 K/V heads): unequal
#    segments, heads repeated with repeat_interleave, SDPA


class FusedGQABlock(nn.Module):
    def __init__(self, d, n_head, n_kv):
        super().__init__()
        self.n_head, self.n_kv, self.hd = n_head, n_kv, d // n_head
        self.norm1 = nn.RMSNorm(d, eps=1e-5)
        self.wqkv = nn.Linear(d, (n_head + 2 * n_kv) * self.hd, bias=False)
        self.wo = nn.Linear(n_head * self.hd, d, bias=False)
        self.norm2 = nn.RMSNorm(d, eps=1e-5)
        self.w_up = nn.Linear(d, 3 * d, bias=False)
        self.w_down = nn.Linear(3 * d, d, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.wqkv(self.norm1(x))
        q, k, v = qkv.split([self.n_head * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(b, s, self.n_head, self.hd).transpose(1, 2)
        k = k.view(b, s, self.n_kv, self.hd).transpose(1, 2).repeat_interleave(self.n_head // self.n_kv, dim=1)
        v = v.view(b, s, self.n_kv, self.hd).transpose(1, 2).repeat_interleave(self.n_head // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(y)
        return x + self.w_down(F.relu(self.w_up(self.norm2(x))).square())


class FusedQKVGroupedLM(nn.Module):
    def __init__(self, vocab=256, d=HIDDEN, n_head=8, n_kv=4, n_layer=LAYERS):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[FusedGQABlock(d, n_head, n_kv) for _ in range(n_layer)])
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.unembed = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        return _loss_or_logits(self.unembed(self.norm(self.blocks(self.embed(idx)))), targets)


# --------------------------------------------------------------------------------------------
# 6. multi-query attention: one K/V head, broadcast (not repeated) against the query heads


class MultiQueryLM(nn.Module):
    def __init__(self, vocab=113, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head, self.hd = n_head, d // n_head
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(MAX_SEQ, d)
        self.ln_1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.c_q = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.c_kv = nn.ModuleList(nn.Linear(d, 2 * self.hd) for _ in range(n_layer))
        self.c_proj = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.ln_2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
                                 for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=idx.device))
        for i in range(len(self.c_q)):
            h = self.ln_1[i](x)
            q = self.c_q[i](h).view(b, t, self.n_head, self.hd).transpose(1, 2)      # [b, n, t, hd]
            k, v = self.c_kv[i](h).unsqueeze(1).split(self.hd, dim=-1)              # [b, 1, t, hd] each
            w = torch.matmul(q, k.transpose(-1, -2)) / self.hd ** 0.5               # broadcast over heads
            w = torch.where(mask, w, torch.full([], -1e4, dtype=w.dtype, device=w.device))
            y = torch.matmul(w.softmax(-1), v).transpose(1, 2).reshape(b, t, -1)
            x = x + self.c_proj[i](y)
            x = x + self.mlp[i](self.ln_2[i](x))
        return _loss_or_logits(self.lm_head(self.ln_f(x)), targets)


class FusedMultiQueryLM(nn.Module):
    """Falcon-7B's attention: one fused linear makes the query heads and the single K/V head,
    viewed ``[b, t, heads + 2, hd]``; the queries a slice of it, K and V taken by an index
    (``[..., [-2], :]``) beside that slice, SDPA with the K/V head expanded; parallel
    attention and MLP off one LayerNorm, no biases."""

    def __init__(self, vocab=113, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head, self.hd = n_head, d // n_head
        self.wte = nn.Embedding(vocab, d)
        self.ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.qkv = nn.ModuleList(nn.Linear(d, d + 2 * self.hd, bias=False) for _ in range(n_layer))
        self.dense = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))
                                 for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        x = self.wte(idx)
        for i in range(len(self.qkv)):
            h = self.ln[i](x)
            fused = self.qkv[i](h).view(b, t, self.n_head + 2, self.hd)
            q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [b, heads or 1, t, hd]
            y = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), is_causal=True)
            x = x + self.dense[i](y.transpose(1, 2).reshape(b, t, -1)) + self.mlp[i](h)
        return _loss_or_logits(self.lm_head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 7. RMSNorm written (x * self.weight.float()).to(dtype), Llama-HF-like otherwise (rotate_half RoPE
#    with registered cos/sin caches, SwiGLU)


class CastRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (hidden_states * self.weight.float()).to(input_dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class CastRMSNormLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head, self.hd = n_head, d // n_head
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList()
        for _ in range(n_layer):
            self.layers.append(nn.ModuleDict({
                "input_layernorm": CastRMSNorm(d), "post_attention_layernorm": CastRMSNorm(d),
                "q_proj": nn.Linear(d, d, bias=False), "k_proj": nn.Linear(d, d, bias=False),
                "v_proj": nn.Linear(d, d, bias=False), "o_proj": nn.Linear(d, d, bias=False),
                "gate_proj": nn.Linear(d, 2 * d, bias=False), "up_proj": nn.Linear(d, 2 * d, bias=False),
                "down_proj": nn.Linear(2 * d, d, bias=False)}))
        self.norm = CastRMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        freqs = torch.outer(torch.arange(MAX_SEQ).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.embed_tokens(idx)
        cos, sin = self.cos_cached[:s][None, None], self.sin_cached[:s][None, None]
        for layer in self.layers:
            h = layer["input_layernorm"](x)
            q = layer["q_proj"](h).view(b, s, self.n_head, self.hd).transpose(1, 2)
            k = layer["k_proj"](h).view(b, s, self.n_head, self.hd).transpose(1, 2)
            v = layer["v_proj"](h).view(b, s, self.n_head, self.hd).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer["o_proj"](a.transpose(1, 2).reshape(b, s, -1))
            h = layer["post_attention_layernorm"](x)
            x = x + layer["down_proj"](F.silu(layer["gate_proj"](h)) * layer["up_proj"](h))
        return _loss_or_logits(self.lm_head(self.norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 8. Gemma style: norm scaled by (1 + weight), embeddings times sqrt(hidden) as a tensor made in
#    forward, GeGLU


class OnePlusRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim).normal_(0.0, 0.1))  # stored as an offset from 1

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaNormLM(nn.Module):
    def __init__(self, vocab=256, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.embedder = nn.Embedding(vocab, d)
        nn.init.normal_(self.embedder.weight, std=d ** -0.5)  # times sqrt(d) in forward: unit scale
        self.pre_attn = nn.ModuleList(OnePlusRMSNorm(d) for _ in range(n_layer))
        self.pre_mlp = nn.ModuleList(OnePlusRMSNorm(d) for _ in range(n_layer))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d, bias=False) for _ in range(n_layer))
        self.o = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.gate = nn.ModuleList(nn.Linear(d, 2 * d, bias=False) for _ in range(n_layer))
        self.up = nn.ModuleList(nn.Linear(d, 2 * d, bias=False) for _ in range(n_layer))
        self.down = nn.ModuleList(nn.Linear(2 * d, d, bias=False) for _ in range(n_layer))
        self.final_norm = OnePlusRMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.embedder(idx)
        x = x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype)
        for i in range(len(self.qkv)):
            q, k, v = self.qkv[i](self.pre_attn[i](x)).chunk(3, dim=-1)
            q, k, v = (t.view(b, s, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
            x = x + self.o[i](y)
            h = self.pre_mlp[i](x)
            x = x + self.down[i](F.gelu(self.gate[i](h), approximate="tanh") * self.up[i](h))
        return _loss_or_logits(self.head(self.final_norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 8b. the head tied as a plain matmul with the transposed embedding: x @ self.tok.weight.T


class TiedMatmulHeadLM(nn.Module):
    def __init__(self, vocab=192, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.tok = nn.Embedding(vocab, d)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.pos = nn.Parameter(torch.zeros(1, MAX_SEQ, d))
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(d), q=nn.Linear(d, d), k=nn.Linear(d, d), v=nn.Linear(d, d), o=nn.Linear(d, d),
            ln2=nn.LayerNorm(d), fc1=nn.Linear(d, 4 * d), fc2=nn.Linear(4 * d, d))) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.tok(idx) + self.pos[:, :s]
        for blk in self.blocks:
            h = blk["ln1"](x)
            q, k, v = (blk[n](h).view(b, s, self.n_head, -1).transpose(1, 2) for n in "qkv")
            x = x + blk["o"](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
            x = x + blk["fc2"](F.gelu(blk["fc1"](blk["ln2"](x))))
        return _loss_or_logits(self.ln_f(x) @ self.tok.weight.T, targets)


# --------------------------------------------------------------------------------------------
# 9. OPT style attention: on [b*heads, s, head_dim] with bmm and a pre-scaled query


class OPTStyleAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, causal_mask):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, tgt_len) + causal_mask
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, tgt_len)
        attn_probs = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, -1)
        return self.out_proj(attn_output)


class BmmAttentionLM(nn.Module):
    def __init__(self, vocab=160, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.attn = nn.ModuleList(OPTStyleAttention(d, n_head) for _ in range(n_layer))
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)) for _ in range(n_layer))
        self.final_layer_norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        seq = idx.shape[1]
        hidden = self.embed_tokens(idx)
        causal = torch.triu(torch.full((seq, seq), torch.finfo(hidden.dtype).min, device=idx.device), 1)
        for attn, ln1, ln2, mlp in zip(self.attn, self.ln1, self.ln2, self.mlp):
            hidden = hidden + attn(ln1(hidden), causal[None, None])
            hidden = hidden + mlp(ln2(hidden))
        return _loss_or_logits(self.lm_head(self.final_layer_norm(hidden)), targets)


# --------------------------------------------------------------------------------------------
# 9b. OPT style MLP: on [b*s, h] (reshape before the linears, residual on the flat tokens),
#     learned positions with an offset, functional dropout


class SDPASelfAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.n_head, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))


class OPTStyleLayer(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.self_attn = SDPASelfAttention(d, n_head)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.dropout = dropout

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn(self.self_attn_layer_norm(hidden_states))
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        # fully connected, on the flattened tokens
        hidden_states_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc1(hidden_states)
        hidden_states = F.relu(hidden_states)
        hidden_states = self.fc2(hidden_states)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        return (residual + hidden_states).view(hidden_states_shape)


class OPTFlatMLPLM(nn.Module):
    def __init__(self, vocab=160, d=HIDDEN, n_head=HEADS, n_layer=LAYERS, dropout=0.1):
        super().__init__()
        self.offset = 2
        self.embed_tokens = nn.Embedding(vocab, d)
        self.embed_positions = nn.Embedding(MAX_SEQ + self.offset, d)
        self.layers = nn.ModuleList(OPTStyleLayer(d, n_head, dropout) for _ in range(n_layer))
        self.final_layer_norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        bsz, seq = idx.shape
        positions = torch.arange(seq, device=idx.device).unsqueeze(0).expand(bsz, -1) + self.offset
        hidden = self.embed_tokens(idx) + self.embed_positions(positions)
        for layer in self.layers:
            hidden = layer(hidden)
        return _loss_or_logits(self.lm_head(self.final_layer_norm(hidden)), targets)


# --------------------------------------------------------------------------------------------
# 10. nn.Embedding(padding_idx=...) on a row that is not on the first vocab shard, inputs that
#     contain it and targets that ignore it (ignore_index)


class PaddedEmbeddingLM(nn.Module):
    PAD = 150

    def __init__(self, vocab=200, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d, padding_idx=self.PAD)
        self.positions = nn.Embedding(MAX_SEQ, d)
        self.attn = nn.ModuleList(SDPASelfAttention(d, n_head) for _ in range(n_layer))
        self.norm1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.norm2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.ff = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n_layer))
        self.out_norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        s = idx.shape[1]
        x = self.tokens(idx) + self.positions.weight[:s]
        for attn, n1, n2, ff in zip(self.attn, self.norm1, self.norm2, self.ff):
            x = x + attn(n1(x))
            x = x + ff(n2(x))
        logits = self.out(self.out_norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


class TorchEncoderLayerLM(nn.Module):
    """torch's own nn.TransformerEncoderLayer (nn.MultiheadAttention inside, its fused in_proj)
    with a causal mask, as a decoder."""

    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(MAX_SEQ, d)
        layer = nn.TransformerEncoderLayer(d, n_head, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.layers = nn.ModuleList(_clone_layer(layer) for _ in range(n_layer))
        self.out_norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        s = idx.shape[1]
        x = self.tokens(idx) + self.positions.weight[:s]
        mask = nn.Transformer.generate_square_subsequent_mask(s, device=idx.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return _loss_or_logits(self.out(self.out_norm(x)), targets)


def _clone_layer(layer: nn.Module) -> nn.Module:
    import copy

    clone = copy.deepcopy(layer)
    for p in clone.parameters():  # fresh values, not copies of the first layer's
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return clone


def padded_inputs(model, generator):
    idx = torch.randint(0, 200, (BATCH, SEQ), generator=generator)
    idx[0, -4:] = PaddedEmbeddingLM.PAD  # right padding on the first row
    idx[1, 5] = PaddedEmbeddingLM.PAD
    targets = torch.roll(idx, -1, 1)
    targets[idx == PaddedEmbeddingLM.PAD] = -100
    targets[targets == PaddedEmbeddingLM.PAD] = -100
    return idx, targets


# --------------------------------------------------------------------------------------------
# 11. tied head via F.linear(x, self.wte.weight), learned absolute positions, GPT-2 dropouts


class TiedFLinearLM(nn.Module):
    def __init__(self, vocab=131, d=HIDDEN, n_head=HEADS, n_layer=LAYERS, p=0.1):
        super().__init__()
        self.n_head = n_head
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(MAX_SEQ, d)
        for table in (self.wte, self.wpe):
            nn.init.normal_(table.weight, std=0.02)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(d), c_attn=nn.Linear(d, 3 * d), c_proj=nn.Linear(d, d), ln_2=nn.LayerNorm(d),
            c_fc=nn.Linear(d, 4 * d), mlp_proj=nn.Linear(4 * d, d), resid_drop=nn.Dropout(p))) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            q, k, v = blk["c_attn"](blk["ln_1"](x)).split(x.size(-1), dim=2)
            q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["resid_drop"](blk["c_proj"](y.transpose(1, 2).contiguous().view(b, t, -1)))
            x = x + blk["resid_drop"](blk["mlp_proj"](F.gelu(blk["c_fc"](blk["ln_2"](x)))))
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return _loss_or_logits(logits, targets)


# --------------------------------------------------------------------------------------------
# 12. ALiBi: per-head slopes (a buffer) times the key-query distance, added to the scores


def get_alibi_slopes(n_heads: int) -> torch.Tensor:
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_2(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    return torch.tensor(power_of_2(closest) + power_of_2(2 * closest)[0::2][: n_heads - closest])


class AlibiLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.word_embeddings = nn.Embedding(vocab, d)
        self.word_embeddings_layernorm = nn.LayerNorm(d)
        self.register_buffer("slopes", get_alibi_slopes(n_head), persistent=False)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            input_layernorm=nn.LayerNorm(d), query_key_value=nn.Linear(d, 3 * d), dense=nn.Linear(d, d),
            post_attention_layernorm=nn.LayerNorm(d), dense_h_to_4h=nn.Linear(d, 4 * d),
            dense_4h_to_h=nn.Linear(4 * d, d))) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.word_embeddings_layernorm(self.word_embeddings(idx))
        pos = torch.arange(s, device=idx.device)
        distance = (pos[None, :] - pos[:, None]).float()                       # key - query
        bias = self.slopes[:, None, None] * distance[None]                      # [heads, s, s]
        bias = bias.masked_fill(distance[None] > 0, float("-inf"))
        for layer in self.h:
            qkv = layer["query_key_value"](layer["input_layernorm"](x)).view(b, s, self.n_head, 3, -1)
            q, k, v = qkv.unbind(dim=3)                                         # per-head interleaved q/k/v
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
            ctx = scores.softmax(-1) @ v
            x = x + layer["dense"](ctx.transpose(1, 2).reshape(b, s, -1))
            h = layer["post_attention_layernorm"](x)
            x = x + layer["dense_4h_to_h"](F.gelu(layer["dense_h_to_4h"](h)))
        return _loss_or_logits(self.lm_head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 13. logit soft-capping, tanh(x / c) * c, on the attention scores and on the final logits


class SoftCapLM(nn.Module):
    def __init__(self, vocab=97, d=HIDDEN, n_head=HEADS, n_layer=LAYERS, attn_cap=20.0, final_cap=15.0):
        super().__init__()
        self.n_head, self.attn_cap, self.final_cap = n_head, attn_cap, final_cap
        self.emb = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.RMSNorm(d) for _ in range(2 * n_layer))
        self.q = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.k = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.v = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.proj = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.ff = nn.ModuleList(nn.Sequential(nn.Linear(d, 3 * d, bias=False), nn.SiLU(), nn.Linear(3 * d, d, bias=False))
                                for _ in range(n_layer))
        self.final = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.emb(idx) * 4.0
        causal = torch.ones(s, s, device=idx.device, dtype=torch.bool).tril_()
        for i, (proj, ff) in enumerate(zip(self.proj, self.ff)):
            h = self.norms[2 * i](x)
            q, k, v = (w[i](h).view(b, s, self.n_head, -1).transpose(1, 2) for w in (self.q, self.k, self.v))
            scores = torch.matmul(q, k.transpose(-2, -1)) * q.size(-1) ** -0.5
            scores = torch.tanh(scores / self.attn_cap) * self.attn_cap
            scores = scores.masked_fill(causal.logical_not(), float("-inf"))
            x = x + proj(torch.matmul(scores.softmax(-1), v).transpose(1, 2).flatten(2))
            x = x + ff(self.norms[2 * i + 1](x))
        logits = self.head(self.final(x))
        logits = torch.tanh(logits / self.final_cap) * self.final_cap
        return _loss_or_logits(logits, targets)


# --------------------------------------------------------------------------------------------
# 14. sliding-window causal mask (window 4, shorter than the sequence) built from aranges, SDPA


class SlidingWindowLM(nn.Module):
    WINDOW = 4

    def __init__(self, vocab=144, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(MAX_SEQ, d)
        self.blocks = nn.ModuleList()
        for _ in range(n_layer):
            self.blocks.append(nn.ModuleList([nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d),
                                              nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, 2 * d),
                                              nn.Linear(2 * d, d)]))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        i = torch.arange(s, device=idx.device)[:, None]
        j = torch.arange(s, device=idx.device)[None, :]
        window = (j <= i) & (j > i - self.WINDOW)
        x = self.embed(idx) + self.pos(torch.arange(s, device=idx.device))[None]
        for ln1, wq, wk, wv, wo, ln2, up, down in self.blocks:
            h = ln1(x)
            q, k, v = (w(h).view(b, s, self.n_head, -1).transpose(1, 2) for w in (wq, wk, wv))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=window)
            x = x + wo(y.transpose(1, 2).flatten(2))
            x = x + down(F.mish(up(ln2(x))))
        return _loss_or_logits(self.head(self.norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 15. partial rotary: NeoX rotate_half on the first half of each head, the rest passed through


class PartialRotaryLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS, rotary_pct=0.5):
        super().__init__()
        self.n_head, self.hd = n_head, d // n_head
        self.rot = int(self.hd * rotary_pct)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.rot, 2).float() / self.rot))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.embed_in = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            input_layernorm=nn.LayerNorm(d), query_key_value=nn.Linear(d, 3 * d), dense=nn.Linear(d, d),
            post_attention_layernorm=nn.LayerNorm(d), dense_h_to_4h=nn.Linear(d, 4 * d),
            dense_4h_to_h=nn.Linear(4 * d, d))) for _ in range(n_layer))
        self.final_layer_norm = nn.LayerNorm(d)
        self.embed_out = nn.Linear(d, vocab, bias=False)

    def rope(self, t, cos, sin):
        t_rot, t_pass = t[..., : self.rot], t[..., self.rot:]
        t_rot = t_rot * cos + rotate_half(t_rot) * sin
        return torch.cat((t_rot, t_pass), dim=-1)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        freqs = torch.arange(s, device=idx.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.embed_in(idx)
        for layer in self.layers:
            qkv = layer["query_key_value"](layer["input_layernorm"](x))
            qkv = qkv.view(b, s, self.n_head, 3 * self.hd).permute(0, 2, 1, 3)
            q, k, v = qkv[..., : self.hd], qkv[..., self.hd: 2 * self.hd], qkv[..., 2 * self.hd:]
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer["dense"](a.permute(0, 2, 1, 3).reshape(b, s, -1))
            x = x + layer["dense_4h_to_h"](F.gelu(layer["dense_h_to_4h"](layer["post_attention_layernorm"](x))))
        return _loss_or_logits(self.embed_out(self.final_layer_norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 16. per-head q/k norms: RMSNorm over head_dim after the head split (torch's nn.RMSNorm)


class PerHeadQKNormLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        hd = d // n_head
        self.n_head = n_head
        self.tok = nn.Embedding(vocab, d)
        self.attn_norm = nn.ModuleList(nn.RMSNorm(d) for _ in range(n_layer))
        self.q = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.k = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.v = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.q_norm = nn.ModuleList(nn.RMSNorm(hd, eps=1e-6) for _ in range(n_layer))
        self.k_norm = nn.ModuleList(nn.RMSNorm(hd, eps=1e-6) for _ in range(n_layer))
        self.o = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.mlp_norm = nn.ModuleList(nn.RMSNorm(d) for _ in range(n_layer))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.ReLU(), nn.Linear(4 * d, d, bias=False))
                                 for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.tok(idx)
        for i in range(len(self.q)):
            h = self.attn_norm[i](x)
            q = self.q_norm[i](self.q[i](h).view(b, s, self.n_head, -1)).transpose(1, 2)
            k = self.k_norm[i](self.k[i](h).view(b, s, self.n_head, -1)).transpose(1, 2)
            v = self.v[i](h).view(b, s, self.n_head, -1).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o[i](y.transpose(1, 2).reshape(b, s, -1))
            x = x + self.mlp[i](self.mlp_norm[i](x))
        return _loss_or_logits(self.head(self.norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 17. q/k norm over the whole projection (hidden, before the head split), OLMo-2 style


class WholeQKNormLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            q_proj=nn.Linear(d, d, bias=False), k_proj=nn.Linear(d, d, bias=False),
            v_proj=nn.Linear(d, d, bias=False), o_proj=nn.Linear(d, d, bias=False),
            q_norm=nn.RMSNorm(d, eps=1e-6), k_norm=nn.RMSNorm(d, eps=1e-6),
            post_attention_layernorm=nn.RMSNorm(d), up=nn.Linear(d, 4 * d, bias=False),
            down=nn.Linear(4 * d, d, bias=False), post_feedforward_layernorm=nn.RMSNorm(d))) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.embed(idx)
        for layer in self.layers:
            q = layer["q_norm"](layer["q_proj"](x)).view(b, s, self.n_head, -1).transpose(1, 2)
            k = layer["k_norm"](layer["k_proj"](x)).view(b, s, self.n_head, -1).transpose(1, 2)
            v = layer["v_proj"](x).view(b, s, self.n_head, -1).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
            x = x + layer["post_attention_layernorm"](layer["o_proj"](y))          # OLMo-2: norms after
            x = x + layer["post_feedforward_layernorm"](layer["down"](F.silu(layer["up"](x))))
        return _loss_or_logits(self.lm_head(self.norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 18. parallel attention + MLP block (GPT-J / PaLM): one norm, one residual add


class ParallelBlock(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln = nn.LayerNorm(d, bias=False)
        self.attn_in = nn.Linear(d, 3 * d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_in = nn.Linear(d, 4 * d, bias=False)
        self.ff_out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln(x)
        q, k, v = self.attn_in(h).split(d, dim=-1)
        q, k, v = (t.unflatten(-1, (self.n_head, -1)).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        return x + self.attn_out(attn) + self.ff_out(F.gelu(self.ff_in(h)))


class ParallelBlockLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(ParallelBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x)
        return _loss_or_logits(self.head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 19. post-norm block (the 2017 Transformer, BERT): x = norm(x + sublayer(x))


class PostNormLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.embedding = nn.Embedding(vocab, d)
        self.position = nn.Embedding(MAX_SEQ, d)
        self.attn_q = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.attn_k = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.attn_v = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.attn_out = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.norm1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.ffn = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)) for _ in range(n_layer))
        self.norm2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.decoder = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.embedding(idx) * math.sqrt(x_dim := self.embedding.embedding_dim) + self.position.weight[:s]
        for wq, wk, wv, out, n1, ffn, n2 in zip(self.attn_q, self.attn_k, self.attn_v, self.attn_out, self.norm1,
                                                self.ffn, self.norm2):
            q, k, v = (w(x).reshape(b, s, self.n_head, x_dim // self.n_head).transpose(1, 2) for w in (wq, wk, wv))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = n1(x + out(y.transpose(1, 2).reshape(b, s, x_dim)))
            x = n2(x + ffn(x))
        return _loss_or_logits(self.decoder(x), targets)


# --------------------------------------------------------------------------------------------
# 20. SwiGLU from one fused up/gate linear, split with chunk(2, dim=-1)


class ChunkSwiGLULM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.wte = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList()
        for _ in range(n_layer):
            self.layers.append(nn.ModuleDict(dict(
                attn_norm=nn.RMSNorm(d), wq=nn.Linear(d, d, bias=False), wk=nn.Linear(d, d, bias=False),
                wv=nn.Linear(d, d, bias=False),
                wo=nn.Linear(d, d, bias=False), ffn_norm=nn.RMSNorm(d), w12=nn.Linear(d, 2 * 96, bias=False),
                w3=nn.Linear(96, d, bias=False))))
        self.norm = nn.RMSNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.wte(idx)
        for L in self.layers:
            h = L["attn_norm"](x)
            q = L["wq"](h).view(b, s, self.n_head, -1).transpose(1, 2)
            k = L["wk"](h).view(b, s, self.n_head, -1).transpose(1, 2)
            v = L["wv"](h).view(b, s, self.n_head, -1).transpose(1, 2)
            x = x + L["wo"](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
            gate, up = L["w12"](L["ffn_norm"](x)).chunk(2, dim=-1)
            x = x + L["w3"](F.silu(gate) * up)
        return _loss_or_logits(self.out(self.norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 20b. one fused qkv linear viewed as [b, s, 3, heads, d] and permuted (timm / x-transformers)


class QKV3HeadsViewLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.embed = nn.Embedding(vocab, d)
        self.norm1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(n_layer))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.norm2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.fc1 = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(n_layer))
        self.fc2 = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        B, N = idx.shape
        x = self.embed(idx)
        for i in range(len(self.qkv)):
            qkv = self.qkv[i](self.norm1[i](x)).reshape(B, N, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            x = x + self.proj[i](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, N, -1))
            x = x + self.fc2[i](F.gelu(self.fc1[i](self.norm2[i](x))))
        return _loss_or_logits(self.head(self.norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 21. mixture of experts with data-dependent routing: top-2 of 4 experts, tokens gathered with
#     torch.where and scattered back with index_add_ (Mixtral's loop)


class Expert(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False), nn.Linear(d, f, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class IndexMoE(nn.Module):
    def __init__(self, d, f, n_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, f) for _ in range(n_experts))

    def forward(self, x):
        b, s, d = x.shape
        flat = x.view(-1, d)
        routing = F.softmax(self.gate(flat), dim=1, dtype=torch.float)
        weights, selected = torch.topk(routing, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected == e)
            out.index_add_(0, token_idx, expert(flat[token_idx]) * weights[token_idx, slot, None])
        return out.view(b, s, d)


class MoEIndexLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.embed = nn.Embedding(vocab, d)
        self.norm1 = nn.ModuleList(nn.RMSNorm(d) for _ in range(n_layer))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d, bias=False) for _ in range(n_layer))
        self.o = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_layer))
        self.norm2 = nn.ModuleList(nn.RMSNorm(d) for _ in range(n_layer))
        self.moe = nn.ModuleList(IndexMoE(d, 32) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.embed(idx)
        for n1, qkv, o, n2, moe in zip(self.norm1, self.qkv, self.o, self.norm2, self.moe):
            q, k, v = (t.view(b, s, self.n_head, -1).transpose(1, 2) for t in qkv(n1(x)).chunk(3, -1))
            x = x + o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
            x = x + moe(n2(x))
        return _loss_or_logits(self.head(self.norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 22. mixture of experts routed densely: the top-2 weights scattered into a [tokens, experts]
#     matrix (scatter), every expert run on every token and weighted (no data-dependent shapes)


class ScatterMoE(nn.Module):
    def __init__(self, d, f, n_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.up = nn.Parameter(torch.randn(n_experts, d, f) * d ** -0.5)
        self.down = nn.Parameter(torch.randn(n_experts, f, d) * f ** -0.5)

    def forward(self, x):
        logits = self.router(x)
        top, which = logits.topk(self.top_k, dim=-1)
        dense = torch.zeros_like(logits).scatter(-1, which, top.softmax(-1))     # [b, s, experts]
        h = F.gelu(torch.einsum("bsd,edf->bsef", x, self.up))
        y = torch.einsum("bsef,efd->bsed", h, self.down)
        return (y * dense.unsqueeze(-1)).sum(dim=2)


class MoEScatterLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.embed = nn.Embedding(vocab, d)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.attn = nn.ModuleList(SDPASelfAttention(d, n_head) for _ in range(n_layer))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.moe = nn.ModuleList(ScatterMoE(d, 32) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for ln1, attn, ln2, moe in zip(self.ln1, self.attn, self.ln2, self.moe):
            x = x + attn(ln1(x))
            x = x + moe(ln2(x))
        return _loss_or_logits(self.head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 23. a custom torch.autograd.Function whose backward is not the plain one: identity forward,
#     doubled gradient backward (a gradient-scaling trick), on the residual stream


class DoubleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * 2.0


class CustomAutogradLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d), proj=nn.Linear(d, d), ln2=nn.LayerNorm(d),
            fc=nn.Linear(d, 4 * d), out=nn.Linear(4 * d, d))) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        x = self.tok(idx)
        for blk in self.blocks:
            q, k, v = (t.view(b, s, self.n_head, -1).transpose(1, 2) for t in blk["qkv"](blk["ln1"](x)).chunk(3, -1))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
            x = x + DoubleGrad.apply(blk["proj"](a))
            x = x + blk["out"](F.gelu(blk["fc"](blk["ln2"](x))))
        return _loss_or_logits(self.head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 24. attention scores with torch.baddbmm on [b*heads, s, head_dim] (Megatron-LM's kernel call,
#     beta=0 on an empty buffer), batch-first


class BaddbmmAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head, self.hd = n_head, d // n_head
        self.query_key_value = nn.Linear(d, 3 * d)
        self.dense = nn.Linear(d, d)
        self.norm_factor = math.sqrt(self.hd)

    def forward(self, hidden_states):  # [b, s, h]
        b, sq, _ = hidden_states.shape
        query, key, value = (t.reshape(b, sq, self.n_head, self.hd).transpose(1, 2).reshape(b * self.n_head, sq, self.hd)
                             for t in self.query_key_value(hidden_states).chunk(3, dim=-1))
        scores = torch.baddbmm(torch.empty(b * self.n_head, sq, sq, dtype=query.dtype, device=query.device),
                               query, key.transpose(1, 2), beta=0.0, alpha=1.0 / self.norm_factor)
        scores = scores.view(b, self.n_head, sq, sq)
        mask = torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=scores.device), diagonal=1)
        probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1)
        context = torch.bmm(probs.view(b * self.n_head, sq, sq), value)
        context = context.view(b, self.n_head, sq, self.hd).transpose(1, 2).reshape(b, sq, -1)
        return self.dense(context)


class BaddbmmAttentionLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.attn = nn.ModuleList(BaddbmmAttention(d, n_head) for _ in range(n_layer))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.word_embeddings(idx)
        for ln1, attn, ln2, mlp in zip(self.ln1, self.attn, self.ln2, self.mlp):
            x = x + attn(ln1(x))
            x = x + mlp(ln2(x))
        return _loss_or_logits(self.head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 24b. sequence-first [s, b, h] (Megatron-LM style): the fused QKV interleaved per head
#      ([s, b, heads, 3*d] split into q, k, v), SDPA on [b, heads, s, d], the loss on [s, b]


class SeqFirstAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head, self.hd = n_head, d // n_head
        self.query_key_value = nn.Linear(d, 3 * d)
        self.dense = nn.Linear(d, d)

    def forward(self, hidden_states):  # [s, b, h]
        sq, b, _ = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(sq, b, self.n_head, 3 * self.hd)
        query, key, value = torch.split(mixed, self.hd, dim=3)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        context = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.dense(context.permute(2, 0, 1, 3).reshape(sq, b, -1))


class SequenceFirstLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d)
        self.position_embeddings = nn.Embedding(MAX_SEQ, d)
        self.input_layernorm = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.self_attention = nn.ModuleList(SeqFirstAttention(d, n_head) for _ in range(n_layer))
        self.post_attention_layernorm = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n_layer))
        self.final_layernorm = nn.LayerNorm(d)
        self.output_layer = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        position_ids = torch.arange(s, device=idx.device).unsqueeze(0)
        x = self.word_embeddings(idx) + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()  # [s, b, h] from here on
        for ln1, attn, ln2, mlp in zip(self.input_layernorm, self.self_attention, self.post_attention_layernorm,
                                       self.mlp):
            x = x + attn(ln1(x))
            x = x + mlp(ln2(x))
        logits = self.output_layer(self.final_layernorm(x))  # [s, b, vocab]
        if targets is None:
            return logits.transpose(0, 1).contiguous()
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.transpose(0, 1).reshape(-1))
        return loss


# --------------------------------------------------------------------------------------------
# 25. dead code and aliases: tensors computed and never used, the same module registered under
#     two names, a view kept as an alias


class DeadCodeLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(d), c_attn=nn.Linear(d, 3 * d), c_proj=nn.Linear(d, d), ln_2=nn.LayerNorm(d),
            c_fc=nn.Linear(d, 4 * d), mlp_proj=nn.Linear(4 * d, d))) for _ in range(n_layer))
        for blk in self.blocks:
            blk["out_alias"] = blk["c_proj"]  # the same module under a second name
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        x = self.wte(idx)
        debug_norms = []
        for blk in self.blocks:
            h = blk["ln_1"](x)
            _entropy = -(h.softmax(-1) * h.log_softmax(-1)).sum(-1)  # computed, never used
            q, k, v = blk["c_attn"](h).split(x.size(-1), dim=2)
            q_alias = q                                         # an alias
            q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q_alias, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            flat = y.transpose(1, 2).reshape(b, t, -1)
            same = flat.view(b * t, -1)                         # a view, then back
            x = x + blk["out_alias"](same.view(b, t, -1))
            debug_norms.append(x.norm(dim=-1).mean())           # collected, never returned
            x = x + blk["mlp_proj"](F.gelu(blk["c_fc"](blk["ln_2"](x))))
        return _loss_or_logits(self.lm_head(self.ln_f(x)), targets)


# --------------------------------------------------------------------------------------------
# 25b. an unused linear probe: a projection of each layer's input computed and thrown away (its
#      parameters get no gradient on one device either)


class UnusedProbeLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            norm=nn.LayerNorm(d), attn=SDPASelfAttention(d, n_head), norm2=nn.LayerNorm(d),
            mlp=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)), probe=nn.Linear(d, 8)))
            for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for layer in self.layers:
            h = layer["norm"](x)
            _probe = layer["probe"](h).softmax(-1)  # computed, never used
            x = x + layer["attn"](h)
            x = x + layer["mlp"](layer["norm2"](x))
        return _loss_or_logits(self.head(self.norm(x)), targets)


# --------------------------------------------------------------------------------------------
# 26. no nn.Linear at all: raw nn.Parameter weights [hidden, heads, head_dim] contracted with einsum


class EinsumProjectionLM(nn.Module):
    def __init__(self, vocab=257, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        hd = d // n_head
        self.embedding = nn.Parameter(torch.randn(vocab, d) * 0.02)
        self.wq = nn.ParameterList(nn.Parameter(torch.randn(d, n_head, hd) * d ** -0.5) for _ in range(n_layer))
        self.wk = nn.ParameterList(nn.Parameter(torch.randn(d, n_head, hd) * d ** -0.5) for _ in range(n_layer))
        self.wv = nn.ParameterList(nn.Parameter(torch.randn(d, n_head, hd) * d ** -0.5) for _ in range(n_layer))
        self.wo = nn.ParameterList(nn.Parameter(torch.randn(n_head, hd, d) * d ** -0.5) for _ in range(n_layer))
        self.w_in = nn.ParameterList(nn.Parameter(torch.randn(d, 4 * d) * d ** -0.5) for _ in range(n_layer))
        self.w_out = nn.ParameterList(nn.Parameter(torch.randn(4 * d, d) * (4 * d) ** -0.5) for _ in range(n_layer))
        self.scale = nn.ParameterList(nn.Parameter(torch.ones(d)) for _ in range(2 * n_layer + 1))
        self.unembedding = nn.Parameter(torch.randn(d, vocab) * d ** -0.5)

    def norm(self, x, i):
        return F.rms_norm(x, (x.shape[-1],), self.scale[i])

    def forward(self, idx, targets=None):
        s = idx.shape[1]
        x = F.embedding(idx, self.embedding)
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=idx.device))
        for i in range(len(self.wq)):
            h = self.norm(x, 2 * i)
            q = torch.einsum("bsd,dnh->bnsh", h, self.wq[i])
            k = torch.einsum("bsd,dnh->bnsh", h, self.wk[i])
            v = torch.einsum("bsd,dnh->bnsh", h, self.wv[i])
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
            x = x + torch.einsum("bnsh,nhd->bsd", a, self.wo[i])
            h = self.norm(x, 2 * i + 1)
            x = x + torch.einsum("bsf,fd->bsd", F.gelu(torch.einsum("bsd,df->bsf", h, self.w_in[i])), self.w_out[i])
        logits = torch.einsum("bsd,dv->bsv", self.norm(x, len(self.scale) - 1), self.unembedding)
        return _loss_or_logits(logits, targets)


# --------------------------------------------------------------------------------------------
# 28. in-place writes: a key assembled in a buffer (new_empty + copy_ into two slices, as
#     DeepSeek's MLA attention does) and read through the buffer; in-place ops read through
#     their own result


class BufferKeyAttention(nn.Module):
    """Keys and values from a compressed latent (MLA): ``kv_a`` -> norm -> ``kv_b``."""

    def __init__(self, d, n_head, rank=16):
        super().__init__()
        self.n_head, self.hd = n_head, d // n_head
        self.q, self.o = nn.Linear(d, d), nn.Linear(d, d)
        self.kv_a = nn.Linear(d, rank + self.hd // 2, bias=False)
        self.kv_norm = nn.LayerNorm(rank)
        self.kv_b = nn.Linear(rank, n_head * (self.hd // 2 + self.hd), bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        half = self.hd // 2
        q = self.q(x).view(b, s, self.n_head, self.hd).transpose(1, 2)
        latent, shared = self.kv_a(x).split([self.kv_norm.normalized_shape[0], half], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, s, self.n_head, half + self.hd).transpose(1, 2)
        k_own, v = kv.split([half, self.hd], dim=-1)
        shared = shared.view(b, 1, s, half).expand(-1, self.n_head, -1, -1)
        key = k_own.new_empty(b, self.n_head, s, self.hd)
        key[..., :half].copy_(k_own)
        key[..., half:].copy_(shared)
        return self.o(F.scaled_dot_product_attention(q, key, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class InPlaceAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head, self.hd = n_head, d // n_head
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.n_head, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        q = q.mul_(self.hd ** -0.25)  # read through the in-place op's result
        scores = (q @ k.transpose(-1, -2)).mul_(self.hd ** -0.25)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu_(1)
        probs = scores.masked_fill_(mask, float("-inf")).softmax(-1)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, -1))


class InPlaceLM(nn.Module):
    attention = BufferKeyAttention

    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2 * n_layer))
        self.attn = nn.ModuleList(self.attention(d, n_head) for _ in range(n_layer))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                 for _ in range(n_layer))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok(idx)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(self.norms[2 * i](x))
            x = x + mlp(self.norms[2 * i + 1](x))
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class BufferKeyLM(InPlaceLM):
    attention = BufferKeyAttention


class InPlaceResultLM(InPlaceLM):
    attention = InPlaceAttention


# --------------------------------------------------------------------------------------------
# the registry


# --------------------------------------------------------------------------------------------
# 30. a selective state-space mixer (Mamba-style) beside attention layers: the expanded channels
#     convolved per channel, a small projection of them (step size, input and output matrices) read
#     back into the scan, the step-size projection applied as ``weight @ x``, a Python loop over time


class SelectiveScan(nn.Module):
    def __init__(self, d=HIDDEN, expand=2, state=8, rank=4, kernel=3):
        super().__init__()
        self.inner, self.state, self.rank = expand * d, state, rank
        self.in_proj = nn.Linear(d, 2 * self.inner, bias=False)
        self.conv = nn.Conv1d(self.inner, self.inner, kernel, groups=self.inner, padding=kernel - 1)
        self.params_proj = nn.Linear(self.inner, rank + 2 * state, bias=False)
        self.step = nn.Linear(rank, self.inner)
        self.log_decay = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float)).repeat(self.inner, 1))
        self.skip = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :t])                       # [b, inner, t]
        step, into, out_of = self.params_proj(u.transpose(1, 2)).split([self.rank, self.state, self.state], -1)
        step = F.softplus(self.step.weight @ step.transpose(1, 2) + self.step.bias[:, None])  # [b, inner, t]
        decay = -torch.exp(self.log_decay)                                       # [inner, state]
        h = x.new_zeros(b, self.inner, self.state)
        ys = []
        for i in range(t):
            dt = step[:, :, i, None]
            h = torch.exp(dt * decay) * h + dt * into[:, i, None, :] * u[:, :, i, None]
            ys.append((h * out_of[:, i, None, :]).sum(-1))
        y = (torch.stack(ys, -1) + u * self.skip[:, None]) * F.silu(gate.transpose(1, 2))
        return self.out_proj(y.transpose(1, 2))


class SelectiveScanLM(nn.Module):
    """Layers alternate a selective-scan mixer and causal attention, each with an MLP; RMSNorm."""

    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.n_head = n_head
        self.wte = nn.Embedding(vocab, d)
        self.mixers = nn.ModuleList(SelectiveScan(d) if i % 2 == 0 else nn.ModuleDict(dict(
            qkv=nn.Linear(d, 3 * d, bias=False), proj=nn.Linear(d, d, bias=False))) for i in range(n_layer))
        self.norms = nn.ModuleList(nn.RMSNorm(d) for _ in range(2 * n_layer))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
                                  for _ in range(n_layer))
        self.norm_f = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        x = self.wte(idx)
        for i, mixer in enumerate(self.mixers):
            h = self.norms[2 * i](x)
            if isinstance(mixer, SelectiveScan):
                x = x + mixer(h)
            else:
                q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in mixer["qkv"](h).chunk(3, -1))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + mixer["proj"](y.transpose(1, 2).reshape(b, t, -1))
            x = x + self.mlps[i](self.norms[2 * i + 1](x))
        return _loss_or_logits(self.lm_head(self.norm_f(x)), targets)


# 31. a dynamic top-k key mask (sparse attention): each head scores the keys with a linear that
#     reads the values of all heads, keeps the `keep` best-scored keys per query (topk, scatter
#     into a 0/1 mask) and adds the kept scores to the attention logits, the rest masked out


class TopKMaskAttention(nn.Module):
    def __init__(self, d=HIDDEN, n_head=HEADS, keep=6):
        super().__init__()
        self.n_head, self.keep = n_head, keep
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.key_score = nn.Linear(d, n_head)
        self.proj = nn.Linear(d, d, bias=False)
        self.register_buffer("future", torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, -1)
        score = self.key_score(v).transpose(1, 2)                                  # [b, heads, keys]
        bias = score[:, :, None, :].expand(b, self.n_head, t, t).masked_fill(self.future[:t, :t], float("-inf"))
        best = torch.topk(bias, min(self.keep, t), dim=-1).indices
        kept = torch.zeros_like(bias).scatter(-1, best, 1.0)
        bias = bias.masked_fill(kept == 0, float("-inf"))
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.mT / math.sqrt(q.size(-1)) + bias, dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class TopKMaskLM(nn.Module):
    def __init__(self, vocab=128, d=HIDDEN, n_layer=LAYERS):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.attn = nn.ModuleList(TopKMaskAttention(d) for _ in range(n_layer))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                  for _ in range(n_layer))
        self.norms = nn.ModuleList(nn.RMSNorm(d) for _ in range(2 * n_layer))
        self.norm_f = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlps)):
            x = x + attn(self.norms[2 * i](x))
            x = x + mlp(self.norms[2 * i + 1](x))
        return _loss_or_logits(self.lm_head(self.norm_f(x)), targets)


# 32. queries and keys convolved over time, each head on its own (one grouped convolution over
#     [q | k], one group per head, after a causal left pad), then sliced apart


class ConvQKAttention(nn.Module):
    def __init__(self, d=HIDDEN, n_head=HEADS, kernel=3):
        super().__init__()
        self.n_head, self.kernel = n_head, kernel
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.conv = nn.Conv1d(2 * d, 2 * d, kernel, groups=2 * n_head)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        qk = torch.cat([self.q(x), self.k(x)], -1).transpose(1, 2)               # [b, 2d, t]
        qk = self.conv(F.pad(qk, (self.kernel - 1, 0))).transpose(1, 2)         # causal in time
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (qk[..., :d], qk[..., d:], self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class ConvQKLM(TopKMaskLM):
    def __init__(self, vocab=128, d=HIDDEN, n_layer=LAYERS):
        super().__init__(vocab, d, n_layer)
        self.attn = nn.ModuleList(ConvQKAttention(d) for _ in range(n_layer))


# 33. OLMo-2 again, every norm written out as transformers writes it (a cast up, pow, mean,
#     rsqrt): the query and key norms over the whole projections, norms after each block


class WrittenRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))  # float32 at least (float64 kept)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class WrittenQKNormLM(WholeQKNormLM):
    def __init__(self, vocab=128, d=HIDDEN, n_head=HEADS, n_layer=LAYERS):
        super().__init__(vocab, d, n_head, n_layer)
        for layer in self.layers:
            for name in ("q_norm", "k_norm", "post_attention_layernorm", "post_feedforward_layernorm"):
                layer[name] = WrittenRMSNorm(d)
        self.norm = WrittenRMSNorm(d)


# --------------------------------------------------------------------------------------------
# 34. a Mamba-2 mixer in its quadratic (attention-like) form: one in_proj for [gate | x B C | dt],
#     a depthwise causal convolution over x, B and C together, one group of B and C for all heads
#     (read whole by every head), the decay as exp of differences of cumulative sums with -inf
#     above the diagonal, a gated RMSNorm over all channels, out_proj


class SSDMixer(nn.Module):
    def __init__(self, d=HIDDEN, heads=HEADS, head_dim=16, state=8, kernel=4):
        super().__init__()
        self.heads, self.head_dim, self.state = heads, head_dim, state
        self.inner = heads * head_dim
        channels = self.inner + 2 * state
        self.in_proj = nn.Linear(d, self.inner + channels + heads, bias=False)
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)
        self.a_log = nn.Parameter(torch.log(torch.arange(1, heads + 1, dtype=torch.float)))
        self.dt_bias = nn.Parameter(torch.linspace(-1.0, 0.5, heads))
        self.skip = nn.Parameter(torch.ones(heads))
        self.norm_weight = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, d, bias=False)

    def forward(self, u):
        b, t, _ = u.shape
        gate, xbc, dt = self.in_proj(u).split([self.inner, self.inner + 2 * self.state, self.heads], dim=-1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :t].transpose(1, 2))
        x, into, out_of = xbc.split([self.inner, self.state, self.state], dim=-1)
        x = x.view(b, t, self.heads, self.head_dim)
        dt = F.softplus(dt + self.dt_bias)                                     # [b, t, heads]
        total = torch.cumsum(dt * -torch.exp(self.a_log), dim=1)              # [b, t, heads]
        causal = torch.ones(t, t, dtype=torch.bool, device=u.device).tril()
        gap = (total[:, :, None, :] - total[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
        weights = torch.einsum("btn,bsn->bts", out_of, into)[..., None] * torch.exp(gap) * dt[:, None]
        y = torch.einsum("btsh,bshp->bthp", weights, x) + x * self.skip[:, None]
        y = y.reshape(b, t, self.inner) * F.silu(gate)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        return self.out_proj(y)


class SSDMixerLM(nn.Module):
    """Every layer a Mamba-2 mixer then a gelu MLP, pre-norm (RMSNorm)."""

    def __init__(self, vocab=128, d=HIDDEN, n_layer=LAYERS):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mixers = nn.ModuleList(SSDMixer(d) for _ in range(n_layer))
        self.norms = nn.ModuleList(nn.RMSNorm(d) for _ in range(2 * n_layer))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                  for _ in range(n_layer))
        self.norm_f = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        for i, mixer in enumerate(self.mixers):
            x = x + mixer(self.norms[2 * i](x))
            x = x + self.mlps[i](self.norms[2 * i + 1](x))
        return _loss_or_logits(self.lm_head(self.norm_f(x)), targets)


# 35. keys and values through a short causal convolution whose taps depend on the token: static
#     per-channel taps plus per-head taps projected from the layer input, applied to windows made
#     by unfold + flip along time; a relative position bias from per-head states mixed through one
#     [d_rel, extent] bank shared by every head and gathered by distance; a sigmoid-gated output


class TokenTapConv(nn.Module):
    def __init__(self, d=HIDDEN, n_head=HEADS, kernel=3):
        super().__init__()
        self.n_head, self.kernel = n_head, kernel
        self.static = nn.Parameter(torch.randn(kernel, d) * 0.3)
        self.taps = nn.Linear(d, n_head * kernel, bias=False)

    def forward(self, x, source):
        b, t, c = x.shape
        taps = self.taps(source).view(b, t, self.n_head, 1, self.kernel)
        taps = taps + self.static.T.reshape(self.n_head, c // self.n_head, self.kernel)
        past = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))                   # [b, c, t + k - 1]
        windows = past.unfold(-1, self.kernel, 1).flip(-1)                      # [b, c, t, k]: lag 0 first
        windows = windows.transpose(1, 2).reshape(b, t, self.n_head, -1, self.kernel)
        return x + (windows * taps).sum(-1).reshape(b, t, c)


class TokenTapAttention(nn.Module):
    def __init__(self, d=HIDDEN, n_head=HEADS, d_rel=8, extent=6):
        super().__init__()
        self.n_head, self.extent = n_head, extent
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.k_conv, self.v_conv = TokenTapConv(d, n_head), TokenTapConv(d, n_head)
        self.rel = nn.Linear(d, n_head * d_rel, bias=False)
        self.bank = nn.Parameter(torch.randn(d_rel, extent) * 0.2)
        self.gate = nn.Linear(d, d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.n_head, -1).transpose(1, 2)
        k = self.k_conv(self.k(x), x).view(b, t, self.n_head, -1).transpose(1, 2)
        v = self.v_conv(self.v(x), x).view(b, t, self.n_head, -1).transpose(1, 2)
        states = self.rel(x).view(b, t, self.n_head, -1)
        profile = (states @ self.bank).transpose(1, 2)                          # [b, heads, t, extent]
        pos = torch.arange(t, device=x.device)
        distance = pos[:, None] - pos[None, :]
        index = distance.clamp(0, self.extent - 1).expand(b, self.n_head, t, t)
        bias = profile.gather(-1, index).masked_fill(distance >= self.extent, 0.0)
        bias = bias.masked_fill(distance < 0, float("-inf"))
        att = torch.softmax(q @ k.mT / math.sqrt(q.size(-1)) + bias, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y * torch.sigmoid(self.gate(x)))


class TokenTapLM(TopKMaskLM):
    def __init__(self, vocab=128, d=HIDDEN, n_layer=LAYERS):
        super().__init__(vocab, d, n_layer)
        self.attn = nn.ModuleList(TokenTapAttention(d) for _ in range(n_layer))


@dataclass(frozen=True)
class Entry:
    build: Callable[[], nn.Module]
    style: str
    inputs: Callable | None = None
    """``inputs(model, generator) -> (idx, targets)``; default: ids below the vocabulary, targets
    the ids shifted by one."""


def _vocab(model: nn.Module) -> int:
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return model.embedding.shape[0]  # EinsumProjectionLM


def default_inputs(model, generator):
    idx = torch.randint(0, _vocab(model), (BATCH, SEQ), generator=generator)
    return idx, torch.roll(idx, -1, 1)


ZOO: dict[str, Entry] = {
    "llama_reference": Entry(LlamaReference, "complex-number rotary (view_as_complex/view_as_real), freqs as a plain "
                             "attribute, mask made in forward, repeat_kv (8 heads / 4 K/V), w1/w2/w3 SwiGLU"),
    "einsum_attention": Entry(EinsumAttentionLM, "attention scores and context with torch.einsum, the context "
                              "einsum producing [b, s, heads, d] directly; learned positions as a raw Parameter"),
    "matmul_masked_softmax": Entry(MatmulMaskedSoftmaxLM, "q @ k.mT, masked_fill over a boolean tril buffer, "
                                   "softmax, attention dropout 0.1; no positions (NoPE)"),
    "gptj_interleaved_rotary": Entry(GPTJInterleavedRotaryLM, "GPT-J rotary: rotate_every_two via "
                                     "torch.stack(...).flatten(-2), sin/cos from einsum in forward, repeat_interleave"),
    "fused_qkv_grouped": Entry(FusedQKVGroupedLM, "one fused [q | k | v] weight with 8 query and 4 K/V heads "
                               "(unequal segments), repeat_interleave, squared-ReLU MLP, nn.RMSNorm"),
    "multi_query": Entry(MultiQueryLM, "multi-query attention: one K/V head broadcast (not repeated) over 4 query "
                         "heads, torch.where mask"),
    "fused_multi_query": Entry(FusedMultiQueryLM, "Falcon-7B attention: one fused [query heads | K | V] linear "
                               "viewed [b, t, heads + 2, hd], K/V taken by an index beside the queries' slice, "
                               "parallel attention and MLP"),
    "cast_rmsnorm": Entry(CastRMSNormLM, "RMSNorm as (x * self.weight.float()).to(dtype), rotate_half RoPE from "
                          "registered cos/sin caches"),
    "gemma_norm": Entry(GemmaNormLM, "x * (1 + weight) norm, embeddings times a sqrt(hidden) tensor made in "
                        "forward, GeGLU"),
    "tied_matmul_head": Entry(TiedMatmulHeadLM, "head tied as x @ self.tok.weight.T (a matmul, no linear), "
                              "positions as a raw [1, max, h] Parameter"),
    "bmm_attention": Entry(BmmAttentionLM, "OPT attention: bmm on [b*heads, s, d], query pre-scaled, additive "
                           "float mask"),
    "opt_flat_mlp": Entry(OPTFlatMLPLM, "OPT MLP on [b*s, h] (reshape before the linears, residual on the flat "
                          "tokens), positions with an offset, functional dropout 0.1"),
    "padding_idx": Entry(PaddedEmbeddingLM, "nn.Embedding(padding_idx=150) of 200 rows (not on the first shard), "
                         "pad tokens in the inputs and ignore_index targets", padded_inputs),
    "torch_encoder_layer": Entry(TorchEncoderLayerLM, "torch's nn.TransformerEncoderLayer (nn.MultiheadAttention, "
                                 "fused in_proj) with a causal mask, as a decoder"),
    "tied_flinear": Entry(TiedFLinearLM, "head tied via F.linear(x, self.wte.weight), learned absolute positions, "
                          "dropout 0.1 (embeddings, residuals)"),
    "alibi": Entry(AlibiLM, "ALiBi: per-head slopes buffer times key-query distance added to the scores; "
                   "per-head interleaved fused QKV (unbind)"),
    "softcap": Entry(SoftCapLM, "tanh(x/c)*c soft-capping on attention scores and final logits, scores with "
                     "torch.matmul"),
    "sliding_window": Entry(SlidingWindowLM, "sliding-window causal mask (window 4 < 16 tokens) from aranges, "
                            "SDPA attn_mask, Mish MLP"),
    "partial_rotary": Entry(PartialRotaryLM, "rotary on half of each head (NeoX rotate_half + pass-through), "
                            "per-head [q k v] fused layout"),
    "qk_norm_per_head": Entry(PerHeadQKNormLM, "per-head q/k RMSNorm over head_dim (torch nn.RMSNorm) after the "
                              "head split"),
    "qk_norm_whole": Entry(WholeQKNormLM, "q/k RMSNorm over the whole projection (before the head split), norms "
                           "after attention and MLP (OLMo-2)"),
    "parallel_block": Entry(ParallelBlockLM, "parallel attention + MLP from one norm, one residual add "
                            "(GPT-J/PaLM), bias-free LayerNorm"),
    "post_norm": Entry(PostNormLM, "post-norm blocks x = norm(x + f(x)), scaled embeddings, position table sliced"),
    "swiglu_chunk": Entry(ChunkSwiGLULM, "SwiGLU from one fused up/gate linear split by chunk(2, dim=-1)"),
    "qkv_3_heads_view": Entry(QKV3HeadsViewLM, "fused qkv viewed as [b, s, 3, heads, d], permute(2, 0, 3, 1, 4), "
                              "unbind (timm / x-transformers)"),
    "moe_index": Entry(MoEIndexLM, "mixture of experts, top-2 of 4, tokens gathered with torch.where and "
                       "scattered with index_add_ (data-dependent shapes)"),
    "moe_scatter": Entry(MoEScatterLM, "mixture of experts with dense routing: top-2 weights scattered into "
                         "[tokens, experts], experts as batched einsum Parameters"),
    "custom_autograd": Entry(CustomAutogradLM, "torch.autograd.Function on the residual stream: identity forward, "
                             "backward doubles the gradient"),
    "baddbmm_attention": Entry(BaddbmmAttentionLM, "attention scores by torch.baddbmm(empty, q, k^T, beta=0, "
                               "alpha=1/sqrt(d)) on [b*heads, s, d] (Megatron-LM's call)"),
    "sequence_first": Entry(SequenceFirstLM, "[s, b, h] layout (Megatron): per-head interleaved QKV split from "
                            "[s, b, heads, 3d], loss on [s, b]"),
    "dead_code": Entry(DeadCodeLM, "tensors computed but never used (an entropy, norms), one module under two "
                       "names, a view alias"),
    "unused_probe": Entry(UnusedProbeLM, "a linear probe of each layer's input computed and thrown away (no "
                          "gradient on one device either)"),
    "einsum_projections": Entry(EinsumProjectionLM, "no nn.Linear: raw Parameters [hidden, heads, d] contracted "
                                "with einsum, F.embedding, F.rms_norm, vocabulary 257"),
    "buffer_key": Entry(BufferKeyLM, "key assembled in a new_empty buffer by copy_ into two slices and read "
                        "through the buffer (DeepSeek MLA's expand_kv), K/V from a normed latent"),
    "selective_scan": Entry(SelectiveScanLM, "Mamba-style selective scan beside attention: per-channel conv, a "
                            "projection of the channels read back into a Python loop over time, weight @ x"),
    "topk_mask": Entry(TopKMaskLM, "dynamic sparse attention: per-head key scores from a linear over all "
                       "heads' values, topk keys per query scattered into a 0/1 mask, scores added to the logits"),
    "conv_qk": Entry(ConvQKLM, "queries and keys concatenated, left-padded and convolved over time per head "
                     "(nn.Conv1d with one group per head), sliced apart after"),
    "qk_norm_written": Entry(WrittenQKNormLM, "qk_norm_whole with every RMSNorm written out (a cast up, pow, "
                             "mean, rsqrt) as transformers' OLMo-2 has it"),
    "inplace_result": Entry(InPlaceResultLM, "in-place mul_, triu_, masked_fill_ read through their own results"),
    "ssd_mixer": Entry(SSDMixerLM, "Mamba-2 mixer, quadratic form: one in_proj split [gate | conv(x B C) | dt], "
                       "depthwise causal conv, one B/C group for all heads, gated RMSNorm over all channels"),
    "token_taps": Entry(TokenTapLM, "keys and values convolved over time with per-token taps (unfold + flip "
                        "windows, taps from a linear per head), relative bias from per-head states times one "
                        "shared bank gathered by distance, sigmoid-gated output"),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple]:
    """``(model in train() mode, (idx, targets))`` for one zoo entry; deterministic in ``seed``."""
    entry = ZOO[name]
    torch.manual_seed(seed)
    model = entry.build().train()
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = (entry.inputs or default_inputs)(model, generator)
    return model, inputs
