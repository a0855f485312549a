"""Models that read one parameter in several places and spellings: the token embedding reused as
the output head, written in each of the ways model code writes a tied head, and once more as a
bias-free projection inside the network.

``SharedWeightLM(head=...)`` is one tiny decoder (1 layer, hidden 32, 4 heads, vocabulary 48)
whose head is chosen by name (``HEADS``); ``forward(idx, targets)`` returns the cross-entropy
loss. The ``lambda`` and ``closure`` spellings store a function on the module, which pickle
refuses: spawned processes build those with ``build(head)`` and load the state instead.
``x_transformers_lm()`` is x-transformers' own tied model (its head is such a lambda).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, N_HEADS, SEQ, BATCH = 48, 32, 4, 16, 2

HEADS = {
    "linear_tied": "nn.Linear head whose .weight is the embedding's Parameter (HF tie_weights)",
    "matmul_t": "x @ self.tok.weight.t()",
    "mT": "x @ self.tok.weight.mT",
    "f_linear": "F.linear(x, self.tok.weight)",
    "einsum": "torch.einsum('bsh,vh->bsv', x, self.tok.weight)",
    "lambda": "self.to_logits = lambda t: t @ self.tok.weight.t() (x-transformers)",
    "closure": "a nested def over self, stored on the module",
    "partial": "functools.partial(F.linear, weight=self.tok.weight)",
    "scaled": "F.linear(x, w) * 0.5: a scale after the head",
    "cast": "F.linear(x, w.to(torch.float32).to(x.dtype)): the weight cast before use",
    "two_places": "the embedding as the head and, inside the block, as a bias-free projection "
                  "x + softmax(x @ E.T) @ E",
}


class SharedWeightLM(nn.Module):
    def __init__(self, head: str = "matmul_t"):
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head={head!r} is not one of {sorted(HEADS)}")
        self.head_kind = head
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        nn.init.normal_(self.tok.weight, std=0.2)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, HIDDEN))
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        if head == "linear_tied":
            self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
            self.lm_head.weight = self.tok.weight
        elif head == "lambda":
            self.to_logits = lambda t: t @ self.tok.weight.t()
        elif head == "closure":
            def to_logits(t):
                return torch.matmul(t, self.tok.weight.transpose(0, 1))
            self.to_logits = to_logits
        elif head == "partial":
            self.to_logits = functools.partial(F.linear, weight=self.tok.weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.tok.weight
        kind = self.head_kind
        if kind == "linear_tied":
            return self.lm_head(x)
        if kind in ("lambda", "closure", "partial"):
            return self.to_logits(x)
        if kind == "matmul_t":
            return x @ w.t()
        if kind == "mT":
            return x @ w.mT
        if kind == "einsum":
            return torch.einsum("bsh,vh->bsv", x, w)
        if kind == "scaled":
            return F.linear(x, w) * 0.5
        if kind == "cast":
            return F.linear(x, w.to(torch.float32).to(x.dtype))
        return F.linear(x, w)  # f_linear, two_places

    def forward(self, idx, targets):
        b, s = idx.shape
        x = self.tok(idx) + self.pos[:s]
        q, k, v = (t.view(b, s, N_HEADS, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(HIDDEN, -1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        if self.head_kind == "two_places":  # [b, s, h] -> [b, s, vocab] -> [b, s, h] through the embedding
            x = x + torch.softmax(x @ self.tok.weight.t(), -1) @ self.tok.weight
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        logits = self.logits(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build(head: str) -> SharedWeightLM:
    """The model, float64, seeded: the same weights on every call."""
    torch.manual_seed(0)
    return SharedWeightLM(head).double().train()


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return idx, torch.roll(idx, -1, 1)


class XTransformersLM(nn.Module):
    """x-transformers' ``TransformerWrapper`` with ``tie_embedding=True`` (its head is a lambda over
    the token embedding's weight), returning the cross-entropy loss."""

    def __init__(self, vocab: int = 96):
        super().__init__()
        from x_transformers import Decoder, TransformerWrapper

        self.vocab = vocab
        self.net = TransformerWrapper(num_tokens=vocab, max_seq_len=64, attn_layers=Decoder(dim=64, depth=2, heads=4),
                                      tie_embedding=True)

    def forward(self, ids, labels):
        logits = self.net(ids)
        return F.cross_entropy(logits.reshape(-1, self.vocab), labels.reshape(-1))


def x_transformers_lm() -> XTransformersLM:
    torch.manual_seed(0)
    return XTransformersLM().double().train()


def x_transformers_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 96, (4, 16), generator=g)
    return ids, torch.roll(ids, -1, 1)
