"""A small causal LM with routed experts written several ways (not transformers' code), for the
property test of expert parallelism: how the router scores, how the experts are stored and
applied (gathered per token-expert pair, ``w[idx]``, or the pairs sorted by expert through a
grouped matmul, or every expert on every token by a
batched matmul over the experts), where the routing weight is applied and how the pairs are summed back to tokens all vary, so that the region analysis meets shapes of
MoE code it was not written against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class RoutedConfig:
    vocab: int = 64
    hidden: int = 16
    inner: int = 24
    experts: int = 4
    top_k: int = 2
    layers: int = 2
    router: str = "softmax_topk"
    """``softmax_topk`` (scores then top-k, renormalised), ``topk_softmax`` (softmax of the top-k
    logits), ``sigmoid`` (sigmoid scores, top-k, normalised)."""
    gated: bool = True
    """``silu(gate) * up`` from one fused projection, else ``gelu(up)``."""
    layout: str = "out_in"
    """Expert weights ``[E, out, in]`` (``bmm(w, x[..., None])``) or ``[E, in, out]`` (``bmm(x[:, None], w)``)."""
    bias: bool = False
    combine: str = "view_sum"
    """How pairs become tokens: ``view_sum``, ``index_add`` (out of place), ``index_add_`` (in place,
    into zeros), ``einsum`` (with the routing weights)."""
    weights_before: bool = False
    """Scale each pair's input by its routing weight before the experts, not its output after."""
    shared: bool = False
    """A dense expert beside the routed ones, added to their sum."""
    dispatch: str = "gather"
    """``gather``: each pair gathers its expert's weights (``w[idx]``) for a ``bmm``; ``grouped``: the
    pairs sorted by expert, each projection one grouped matmul (transformers' op; offsets from a
    histogram of the sorted ids), biases gathered by the sorted ids, the pairs put back in order;
    ``dense``: every expert on every token (as Llama 4), ``[E, T, H]`` through a ``bmm`` over the
    experts, the routing weights a dense ``[T, E]`` matrix with zeros for experts not chosen;
    ``dense_einsum``: the same with each projection an ``einsum`` batched over the experts
    (``"eti,eoi->eto"``) and the gate taken apart by ``split``; ``loop``: Mixtral's reference
    loop, each expert its own ``nn.Linear`` modules run on the rows ``torch.where`` picks for it (a
    count known only at run time), summed back with ``index_add`` (``combine="index_add_"``: in
    place into zeros; otherwise out of place); ``loop_stacked``: the same loop over one 3-D
    parameter per projection, expert ``e``'s weight its slice ``W[e]`` (in ``layout``), its bias
    ``b[e]`` added after the product; ``split``: JetMoE's and ScatterMoE's way, the pairs sorted
    by expert, cut into one group of rows per expert by ``split`` with the counts ``.tolist()``
    gives, each group through its expert's slice ``W[e]``, the groups joined by ``cat`` (the gate
    taken apart by ``chunk``), cut again for the down projections, joined, and summed back to
    tokens with ``index_add``."""


class RoutedMLP(nn.Module):
    def __init__(self, c: RoutedConfig):
        super().__init__()
        self.c = c
        up = 2 * c.inner if c.gated else c.inner
        self.router = nn.Linear(c.hidden, c.experts, bias=False)

        def expert(out_features, in_features):
            shape = (c.experts, out_features, in_features) if c.layout == "out_in" else (c.experts, in_features, out_features)
            return nn.Parameter(torch.randn(shape) / in_features ** 0.5)

        if c.dispatch == "loop":
            self.experts = nn.ModuleList(
                nn.ModuleDict({"up": nn.Linear(c.hidden, up, bias=c.bias), "down": nn.Linear(c.inner, c.hidden, bias=c.bias)})
                for _ in range(c.experts))
        else:
            self.up = expert(up, c.hidden)
            self.down = expert(c.hidden, c.inner)
            self.up_bias = nn.Parameter(torch.randn(c.experts, up) / 10) if c.bias else None
            self.down_bias = nn.Parameter(torch.randn(c.experts, c.hidden) / 10) if c.bias else None
        self.shared = nn.Sequential(nn.Linear(c.hidden, c.inner), nn.GELU(), nn.Linear(c.inner, c.hidden)) \
            if c.shared else None

    def _route(self, h):
        c, logits = self.c, self.router(h)
        if c.router == "topk_softmax":
            top, idx = torch.topk(logits, c.top_k)
            return top.softmax(-1), idx
        scores = logits.softmax(-1) if c.router == "softmax_topk" else torch.sigmoid(logits)
        top, idx = torch.topk(scores, c.top_k)
        return top / top.sum(-1, keepdim=True), idx

    def _linear(self, weight, bias, flat, x):
        w = weight[flat]
        y = torch.bmm(w, x.unsqueeze(-1)).squeeze(-1) if self.c.layout == "out_in" else \
            torch.bmm(x.unsqueeze(1), w).squeeze(1)
        return y + bias[flat] if bias is not None else y

    def _grouped(self, weight, bias, ids, offs, x):
        from transformers.integrations import moe  # noqa: F401  (registers transformers' grouped matmul op)

        w = weight.transpose(-2, -1) if self.c.layout == "out_in" else weight
        y = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
        return y + bias[ids] if bias is not None else y

    def _experts(self, flat, pairs):
        c = self.c
        if c.dispatch == "grouped":
            ids, order = flat.sort(stable=True)
            offs = torch.histc(ids.double(), bins=c.experts, min=0, max=c.experts - 1).cumsum(0).to(torch.int32)
            a = self._grouped(self.up, self.up_bias, ids, offs, pairs[order])
            a = F.silu(a[:, :c.inner]) * a[:, c.inner:] if c.gated else F.gelu(a)
            return self._grouped(self.down, self.down_bias, ids, offs, a)[order.argsort()]
        a = self._linear(self.up, self.up_bias, flat, pairs)
        a = F.silu(a[:, :c.inner]) * a[:, c.inner:] if c.gated else F.gelu(a)
        return self._linear(self.down, self.down_bias, flat, a)

    def _dense(self, h, weights, idx):
        c = self.c
        dense = torch.zeros(h.shape[0], c.experts, dtype=h.dtype, device=h.device).scatter(1, idx, weights)

        def linear(weight, bias, x):  # x [E, T, in]
            if c.dispatch == "dense_einsum":
                y = torch.einsum("eti,eoi->eto" if c.layout == "out_in" else "eti,eio->eto", x, weight)
            elif c.layout == "out_in":
                y = torch.bmm(weight, x.transpose(1, 2)).transpose(1, 2)
            else:
                y = torch.bmm(x, weight)
            return y + bias.unsqueeze(1) if bias is not None else y

        x = h.unsqueeze(0).expand(c.experts, -1, -1)
        if c.weights_before:
            x = x * dense.t().unsqueeze(-1)
        a = linear(self.up, self.up_bias, x)
        if c.gated:
            gate, up = a.split(c.inner, dim=-1) if c.dispatch == "dense_einsum" else (a[..., :c.inner], a[..., c.inner:])
            a = F.silu(gate) * up
        else:
            a = F.gelu(a)
        y = linear(self.down, self.down_bias, a)
        if c.weights_before:
            return y.sum(0)
        if c.combine == "einsum":
            return torch.einsum("eth,te->th", y, dense)
        return (y * dense.t().unsqueeze(-1)).sum(0)

    def _expert_linear(self, e: int, which: str, x):
        if self.c.dispatch == "loop":
            return self.experts[e][which](x)
        weight, bias = getattr(self, which)[e], getattr(self, f"{which}_bias")
        y = F.linear(x, weight) if self.c.layout == "out_in" else x @ weight
        return y + bias[e] if bias is not None else y

    def _loop(self, h, weights, idx):
        c = self.c
        out = torch.zeros_like(h)
        for e in range(c.experts):
            tokens, slot = torch.where(idx == e)
            rows, w = h[tokens], weights[tokens, slot, None]
            a = self._expert_linear(e, "up", rows * w if c.weights_before else rows)
            a = F.silu(a[:, :c.inner]) * a[:, c.inner:] if c.gated else F.gelu(a)
            y = self._expert_linear(e, "down", a)
            y = y if c.weights_before else y * w
            if c.combine == "index_add_":
                out.index_add_(0, tokens, y)
            else:
                out = out.index_add(0, tokens, y)
        return out

    def _split_groups(self, h, weights, idx):
        c = self.c
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        tokens = order // c.top_k
        w = weights.reshape(-1)[order].unsqueeze(-1)
        counts = F.one_hot(flat, c.experts).sum(0).tolist()
        rows = h[tokens]
        if c.weights_before:
            rows = rows * w
        a = torch.cat([self._expert_linear(e, "up", group) for e, group in enumerate(rows.split(counts, dim=0))])
        if c.gated:
            gate, up = a.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.gelu(a)
        y = torch.cat([self._expert_linear(e, "down", group) for e, group in enumerate(a.split(counts, dim=0))])
        y = y if c.weights_before else y * w
        if c.combine == "index_add_":
            out = torch.zeros_like(h)
            out.index_add_(0, tokens, y)
            return out
        return torch.zeros_like(h).index_add(0, tokens, y)

    def forward(self, x):
        c = self.c
        h = x.reshape(-1, c.hidden)
        weights, idx = self._route(h)
        if c.dispatch in ("loop", "loop_stacked", "split"):
            out = self._split_groups(h, weights, idx) if c.dispatch == "split" else self._loop(h, weights, idx)
            if self.shared is not None:
                out = out + self.shared(h)
            return out.view_as(x)
        if c.dispatch in ("dense", "dense_einsum"):
            out = self._dense(h, weights, idx)
            if self.shared is not None:
                out = out + self.shared(h)
            return out.view_as(x)
        flat, pair_w = idx.reshape(-1), weights.reshape(-1, 1)
        pairs = h.repeat_interleave(c.top_k, 0)
        if c.weights_before:
            pairs = pairs * pair_w
        y = self._experts(flat, pairs)
        if not c.weights_before and c.combine != "einsum":
            y = y * pair_w
        tokens = torch.arange(h.shape[0], device=h.device).repeat_interleave(c.top_k)
        if c.combine == "view_sum":
            out = y.view(-1, c.top_k, c.hidden).sum(1)
        elif c.combine == "index_add":
            out = torch.zeros_like(h).index_add(0, tokens, y)
        elif c.combine == "index_add_":
            out = torch.zeros_like(h)
            out.index_add_(0, tokens, y)
        else:
            scale = torch.ones_like(weights) if c.weights_before else weights
            out = torch.einsum("tkh,tk->th", y.view(-1, c.top_k, c.hidden), scale)
        if self.shared is not None:
            out = out + self.shared(h)
        return out.view_as(x)


class RoutedLM(nn.Module):
    def __init__(self, c: RoutedConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(c.hidden) for _ in range(c.layers))
        self.moes = nn.ModuleList(RoutedMLP(c) for _ in range(c.layers))
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
