"""Blocks, containers and whole models composed from a ``Config``; ``build(config)`` returns the
model (seeded, in the config's dtype) and its inputs."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import MAX_LEN, Attention, MHACross
from .config import Config
from .parts import MLP, norm

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class Residual(nn.Module):
    """One sublayer ``f`` with its norms and residual: ``pre`` x + f(n(x)); ``post`` n(x + f(x))
    (BERT); ``sandwich`` x + n2(f(n(x))) (Gemma 2); ``pre_layer_scale`` x + g * f(n(x)) (CaiT)."""

    def __init__(self, c: Config, f: nn.Module, residual: str):
        super().__init__()
        self.residual, self.f, self.norm = residual, f, norm(c.norm, c.hidden)
        if residual == "sandwich":
            self.post_norm = norm(c.norm, c.hidden)
        if residual == "pre_layer_scale":
            self.gamma = nn.Parameter(torch.full((c.hidden,), 0.5))

    def forward(self, x, *memory):
        if self.residual == "post":
            return self.norm(x + self.f(x, *memory))
        y = self.f(self.norm(x), *memory)
        if self.residual == "sandwich":
            y = self.post_norm(y)
        elif self.residual == "pre_layer_scale":
            y = self.gamma * y
        return x + y


class Block(nn.Module):
    """Self-attention, cross-attention (decoders of an encoder-decoder), MLP; ``parallel``: GPT-J's
    x + attn(n(x)) + mlp(n(x)) (with cross-attention as a residual before it)."""

    def __init__(self, c: Config, *, causal: bool, cross: bool):
        super().__init__()
        self.parallel = c.residual == "parallel"
        residual = "pre" if self.parallel else c.residual
        if self.parallel:
            self.norm = norm(c.norm, c.hidden)
            self.attn, self.mlp = Attention(c, causal=causal), MLP(c.mlp, c.hidden, c.bias)
        else:
            self.attn = Residual(c, Attention(c, causal=causal), residual)
            self.mlp = Residual(c, MLP(c.mlp, c.hidden, c.bias), residual)
        self.cross = Residual(c, cross_attention(c), residual) if cross else None

    def forward(self, x, memory=None):
        if self.parallel:
            if self.cross is not None:
                x = self.cross(x, memory)
            h = self.norm(x)
            return x + self.attn(h) + self.mlp(h)
        x = self.attn(x)
        if self.cross is not None:
            x = self.cross(x, memory)
        return self.mlp(x)


def cross_attention(c: Config) -> nn.Module:
    return MHACross(c) if c.cross == "mha" else Attention(c, causal=False, cross=True)


class Stack(nn.Module):
    """The container: ``modulelist`` of blocks; ``alternating`` attention and feed-forward entries of
    one ModuleList; ``sequential`` (an nn.Sequential, self-attention only); ``shared`` one block
    applied ``layers + 1`` times (ALBERT)."""

    def __init__(self, c: Config, *, causal: bool, cross: bool):
        super().__init__()
        kind = c.container
        if kind == "sequential" and cross:
            kind = "modulelist"  # nn.Sequential passes one tensor: no memory
        if kind == "alternating" and c.residual == "parallel":
            kind = "modulelist"  # a parallel block has no separate entries
        self.kind = kind
        if kind == "alternating":
            entries = []
            for _ in range(c.layers):
                entries.append(Residual(c, Attention(c, causal=causal), c.residual))
                if cross:
                    entries.append(Residual(c, cross_attention(c), c.residual))
                entries.append(Residual(c, MLP(c.mlp, c.hidden, c.bias), c.residual))
            self.layers = nn.ModuleList(entries)
            self.takes_memory = [cross and i % 3 == 1 for i in range(len(entries))]
        elif kind == "sequential":
            self.layers = nn.Sequential(*[Block(c, causal=causal, cross=False) for _ in range(c.layers)])
        elif kind == "shared":
            self.block, self.repeats = Block(c, causal=causal, cross=cross), c.layers + 1
        else:
            self.layers = nn.ModuleList([Block(c, causal=causal, cross=cross) for _ in range(c.layers)])

    def forward(self, x, memory=None):
        if self.kind == "sequential":
            return self.layers(x)
        if self.kind == "shared":
            for _ in range(self.repeats):
                x = self.block(x, memory)
            return x
        if self.kind == "alternating":
            for layer, takes in zip(self.layers, self.takes_memory):
                x = layer(x, memory) if takes else layer(x)
            return x
        for layer in self.layers:
            x = layer(x, memory)
        return x


class Model(nn.Module):
    """``decoder`` (causal LM), ``encoder`` (bidirectional, token logits) or ``encdec`` (an encoder
    over ``memory_ids``, a causal decoder over ``ids`` cross-attending to it)."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        if c.embed == "functional":
            self.wte = nn.Parameter(torch.randn(c.vocab, c.hidden))
        else:
            self.tok = nn.Embedding(c.vocab, c.hidden)
        if c.positions == "learned":
            self.pos = nn.Embedding(MAX_LEN, c.hidden)
        if c.arch == "encdec":
            self.encoder = Stack(c, causal=False, cross=False)
            self.enc_norm = norm(c.norm, c.hidden)
        self.blocks = Stack(c, causal=c.arch != "encoder", cross=c.arch == "encdec")
        self.final_norm = norm(c.norm, c.hidden)
        if c.head in ("linear", "scaled_linear"):
            self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        elif c.head == "tied_lambda":  # x-transformers' tie_embedding
            self.to_logits = lambda t: t @ self.embedding_weight().t()
        elif c.head == "tied_closure":
            weight_of = self.embedding_weight

            def to_logits(t):
                return F.linear(t, weight_of())

            self.to_logits = to_logits

    def embedding_weight(self) -> torch.Tensor:
        return self.wte if self.c.embed == "functional" else self.tok.weight

    def embed(self, ids):
        c = self.c
        x = F.embedding(ids, self.wte) if c.embed == "functional" else self.tok(ids)
        if c.embed == "scaled":
            x = x * math.sqrt(c.hidden)
        if c.positions == "learned":
            x = x + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return x

    def logits(self, x):
        c, w = self.c, None if self.c.head in ("linear", "scaled_linear") else self.embedding_weight()
        if c.head == "linear":
            return self.lm_head(x)
        if c.head == "scaled_linear":
            return self.lm_head(x * c.hidden ** -0.5)
        if c.head == "tied_linear":
            return F.linear(x, w)
        if c.head == "tied_matmul_t":
            return x @ w.t()
        if c.head == "tied_mT":
            return x @ w.mT
        if c.head == "tied_einsum":
            return torch.einsum("bsd,vd->bsv", x, w)
        return self.to_logits(x)

    def forward(self, ids, memory_ids=None, labels=None):
        memory = None
        if self.c.arch == "encdec":
            memory = self.enc_norm(self.encoder(self.embed(memory_ids)))
        logits = self.logits(self.final_norm(self.blocks(self.embed(ids), memory)))
        if labels is None:
            return logits
        if logits.dtype == torch.bfloat16:
            logits = logits.float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(c: Config) -> tuple[nn.Module, tuple]:
    """The model (weights from ``c.seed``, in ``c.dtype``) and its inputs ``((ids,), {memory_ids=,
    labels=})`` (the keywords the config uses)."""
    torch.manual_seed(c.seed)
    model = Model(c).to(DTYPES[c.dtype])
    g = torch.Generator().manual_seed(c.seed)
    ids = torch.randint(0, c.vocab, (c.batch, c.seq), generator=g)
    kwargs = {}
    if c.arch == "encdec":
        kwargs["memory_ids"] = torch.randint(0, c.vocab, (c.batch, c.memory), generator=g)
    if c.loss == "inside":
        kwargs["labels"] = torch.randint(0, c.vocab, (c.batch, c.seq), generator=g)
    return model, ((ids,), kwargs)
