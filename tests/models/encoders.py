"""Small models beyond causal LMs, written the way users write them: torch's encoder, decoder
and ``nn.Transformer`` (their ``nn.MultiheadAttention``: fused ``in_proj_weight``), a block that
cross-attends to a memory of another length (batch- and sequence-first, ``kdim``/``vdim``,
no bias, torch's explicit path for ``need_weights``), and timm's attention
(``qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)``). Every model takes
``(ids, memory_ids, labels)`` and returns the loss."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, H = 64, 32, 4


class TorchEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, H, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)

    def forward(self, ids, memory_ids, labels):
        return F.cross_entropy(self.head(self.enc(self.tok(ids))).flatten(0, 1), labels.flatten())


class TorchDecoder(nn.Module):
    """``nn.TransformerDecoder`` (self- and cross-attention) or ``nn.Transformer``."""

    def __init__(self, whole_transformer: bool = False):
        super().__init__()
        self.whole = whole_transformer
        self.tok, self.src = nn.Embedding(V, D), nn.Embedding(V, D)
        if whole_transformer:
            self.m = nn.Transformer(D, H, 1, 1, 64, dropout=0.0, batch_first=True)
        else:
            self.m = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, H, 64, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(D, V)

    def forward(self, ids, memory_ids, labels):
        x, memory = self.tok(ids), self.src(memory_ids)
        out = self.m(memory, x) if self.whole else self.m(x, memory)
        return F.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())


class CrossAttention(nn.Module):
    """A split block before ``nn.MultiheadAttention(x, memory, memory)``: the query stream is
    sequence-split under SP, the memory whole and of another length. Inside torch's function the
    projections are pieces of parameters: ``in_proj_weight.split([E, 2E])`` (and its bias), or
    with ``kdim``/``vdim`` three weights and ``in_proj_bias.chunk(3)``. ``self_attention``:
    ``attn(x, x, x)`` instead (the fused projection, one linear); ``need_weights``: torch's
    explicit ``baddbmm``/``softmax``/``bmm`` path instead of SDPA."""

    def __init__(self, batch_first: bool = True, kdim: int | None = None, bias: bool = True,
                 need_weights: bool = False, self_attention: bool = False):
        super().__init__()
        self.batch_first, self.need_weights, self.self_attention = batch_first, need_weights, self_attention
        self.tok, self.mem = nn.Embedding(V, D), None if self_attention else nn.Embedding(V, kdim or D)
        self.mlp = nn.Sequential(nn.Linear(D, 64), nn.GELU(), nn.Linear(64, D))
        self.attn = nn.MultiheadAttention(D, H, batch_first=batch_first, kdim=kdim, vdim=kdim, bias=bias)
        self.head = nn.Linear(D, V)

    def forward(self, ids, memory_ids, labels):
        x = self.tok(ids)
        x = x + self.mlp(x)
        memory = None if self.self_attention else self.mem(memory_ids)
        if not self.batch_first:
            x, memory = x.transpose(0, 1), None if memory is None else memory.transpose(0, 1)
        memory = x if memory is None else memory  # the query itself: torch's fused self-attention path
        x = x + self.attn(x, memory, memory, need_weights=self.need_weights)[0]
        if not self.batch_first:
            x = x.transpose(0, 1)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class TimmBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, H, c // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


class TimmLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.blocks = nn.Sequential(TimmBlock(), TimmBlock())
        self.head = nn.Linear(D, V)

    def forward(self, ids, memory_ids, labels):
        return F.cross_entropy(self.head(self.blocks(self.tok(ids))).flatten(0, 1), labels.flatten())


MODELS = {
    "torch_encoder": TorchEncoder,
    "torch_decoder": TorchDecoder,
    "torch_transformer": lambda: TorchDecoder(whole_transformer=True),
    "mha_cross": CrossAttention,
    "mha_cross_seq_first": lambda: CrossAttention(batch_first=False),
    "mha_cross_seq_first_kdim": lambda: CrossAttention(batch_first=False, kdim=24),
    "mha_cross_no_bias_need_weights": lambda: CrossAttention(bias=False, need_weights=True),
    "mha_self_seq_first_need_weights": lambda: CrossAttention(batch_first=False, self_attention=True, need_weights=True),
    "timm_attention": TimmLike,
}


def inputs(query: int = 16, memory: int = 24, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (batch, query), generator=g), torch.randint(0, V, (batch, memory), generator=g),
            torch.randint(0, V, (batch, query), generator=g))
