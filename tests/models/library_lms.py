"""Real models of libraries other than ``transformers`` (litgpt, x-transformers), shrunk, each
wrapped to answer ``forward(idx, targets)`` with the cross-entropy loss: what a user of those
libraries hands to ``sptransform``. Used by ``tools/sweep_libraries.py`` and
``tests/integration/test_library_pipeline_gloo.py`` (issue 23: pipeline stages on any model).

A builder raises ``ImportError`` when its library is missing (CI installs neither). The classes
are importable by module name (``models.library_lms`` with ``tests/`` on the path): verify's
real processes unpickle them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BATCH, SEQ = 128, 2, 16


class LossLM(nn.Module):
    """``model(idx)`` returns logits; this returns their mean cross-entropy against ``targets``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@dataclass(frozen=True)
class LibraryModel:
    library: str
    name: str
    """litgpt: its ``Config.from_name`` name; x-transformers: a label of the ``Decoder`` options."""
    float32_inside: bool = False
    """The library computes something (litgpt's RMSNorm: ``x.float()``) in float32 whatever the
    model's dtype, so a float64 run is exact only to float32's rounding."""
    options: tuple = ()
    """x-transformers: ``Decoder`` keyword options, as (name, value) pairs."""


LITGPT = {
    # one per kind of block litgpt writes
    "pythia": LibraryModel("litgpt", "pythia-14m"),               # GPT-NeoX: parallel residual, partial rotary
    "llama3": LibraryModel("litgpt", "Llama-3.2-1B", True),       # RMSNorm, GQA, SwiGLU
    "gemma2": LibraryModel("litgpt", "Gemma-2-2b", True),         # post-norms, softcapping, sliding window
    "olmo2": LibraryModel("litgpt", "OLMo-2-1124-7B", True),      # QK-norm, norms after each sublayer
    "falcon": LibraryModel("litgpt", "falcon-7b"),                # multi-query, shared attention norm
    "qwen3": LibraryModel("litgpt", "Qwen3-0.6B", True),          # QK-norm per head
    "phi2": LibraryModel("litgpt", "phi-2"),                      # parallel residual, partial rotary, biases
    "mistral": LibraryModel("litgpt", "Mistral-7B-v0.1", True),   # sliding window
    "gemma3": LibraryModel("litgpt", "Gemma-3-1b-it", True),      # local/global layers, QK-norm, one K/V head
}
XTRANSFORMERS = {
    "xt_decoder": LibraryModel("x-transformers", "Decoder"),
    "xt_rotary_glu": LibraryModel("x-transformers", "Decoder rotary, GLU, RMSNorm",
                                  options=(("rotary_pos_emb", True), ("ff_glu", True), ("use_rmsnorm", True))),
    "xt_gqa_sandwich": LibraryModel("x-transformers", "Decoder GQA, sandwich norm",
                                    options=(("attn_kv_heads", 2), ("sandwich_norm", True))),
}
MODELS = {**LITGPT, **XTRANSFORMERS}


def _litgpt(name: str) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    base = Config.from_name(name)
    heads = 4
    groups = heads if base.n_query_groups == base.n_head else (1 if base.n_query_groups == 1 else 2)
    overrides = dict(n_layer=2, n_embd=64, n_head=heads, n_query_groups=groups, head_size=16, intermediate_size=128,
                     vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=64)
    if base.sliding_window_size is not None:
        overrides["sliding_window_size"] = 8  # shorter than the 16 tokens, so the window matters
    return GPT(Config.from_name(name, **overrides))


def _x_transformers(options: tuple) -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=64,
                              attn_layers=Decoder(dim=64, depth=2, heads=4, **dict(options)))


def build(key: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple]:
    """(``LossLM`` of the shrunk model in ``dtype``, ``(idx, targets)``); ``ImportError`` without its library."""
    spec = MODELS[key]
    torch.manual_seed(0)
    inner = _litgpt(spec.name) if spec.library == "litgpt" else _x_transformers(spec.options)
    model = LossLM(inner).to(dtype)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return model, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
