"""Coverage as users see it: every causal-LM class of the installed ``transformers``, shrunk
automatically from its own default config, trained on one device and then checked with
``sptransform.verify`` at tp=2 with sequence parallelism and at tp=4 without.

    python tools/sweep_transformers.py                         # all families -> docs/supported_models.md
    python tools/sweep_transformers.py --only llama gpt2 opt   # a few model types
    python tools/sweep_transformers.py --limit 10 --jobs 2 --json results.json
    python tools/sweep_transformers.py --worker llama --result r.json   # one family, in this process

Why ``tools/``: this is neither a benchmark (``benchmarks/`` compares speed and bytes) nor part
of the library (nothing in ``sptransform`` depends on it, and the analysis is measured by it,
not extended): it is a development tool that measures the library from the outside, as a user
would call it, and regenerates a document.

What runs, per family (``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), each in its
own subprocess bounded by ``--timeout`` seconds (a crash or a hang is recorded, never stops the
sweep; what finished before it is kept):

1. build: ``ModelClass.config_class()`` (the class's own defaults), shrunk by field name
   (``shrink_config``; per-family overrides only where the generic rules cannot know, each
   with its reason in ``FAMILY_OVERRIDES``), float32, ``attn_implementation="sdpa"`` (``"eager"``
   when the class refuses sdpa), ``model.train()`` with the configured dropout;
2. single device: forward with ``input_ids`` and ``labels`` (2 x 16 tokens), backward, one SGD
   step; it works when the loss and every gradient are finite;
3. ``sptransform.verify(model, tp=2, sp=True, example_inputs=..., processes=False)`` (simulated ranks) and
4. ``sptransform.verify(model, tp=4, sp=False, example_inputs=...)``: ``equal``, ``different``
   (wrong: a row beyond rtol, or the parallel model raised while running), ``refused``
   (``parallelize`` raised ValueError/TypeError: the reason), ``error`` (verify itself raised
   something else: a crash inside sptransform before the parallel model ran).

The shrink (``TARGET``): 2 layers, hidden 64, 8 attention heads of size 8, 4 K/V heads (a
family with one K/V head keeps one, one whose K/V heads equal its heads keeps that), MLP 128,
MoE experts of 32 (4 experts, top-2), vocabulary 128, 64 positions, sliding windows of 8
tokens (shorter than the 16-token sequence, so the window matters). 8 heads / 4 K/V heads
rather than 4 / 2: with 2 K/V heads tp=4 cannot split them and every GQA family would be
refused at tp=4 for that one reason, hiding everything else the tp=4 column measures
(``--heads 4 --kv-heads 2`` runs that configuration).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "supported_models.md")

BATCH, SEQ = 2, 16


@dataclass(frozen=True)
class Target:
    layers: int = 2
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 128
    moe_intermediate: int = 32
    experts: int = 4
    experts_per_token: int = 2
    vocab: int = 128
    positions: int = 64
    window: int = 8

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Engine:
    """Where and how the parallel side runs: ``processes`` (real gloo processes, as users run; else
    simulated ranks in one process), the models' dtype, and which columns (``COLUMNS`` keys)."""

    processes: bool = False
    dtype: str = "float32"
    columns: tuple[str, ...] = ("tp2_sp", "tp4")  # DEFAULT_COLUMNS

    def args(self) -> list[str]:
        return (["--processes"] if self.processes else []) + ["--dtype", self.dtype, "--columns", *self.columns]

    def describe(self) -> str:
        real = self.processes or (self.columns and set(self.columns) <= REAL_RANKS_ONLY)
        return ("real gloo processes" if real else "simulated ranks") + f", {self.dtype}"


# -- which classes ------------------------------------------------------------------------

NOT_RUN = {
    # multimodal wrappers: the text decoder inside is swept under its own model type
    "gemma3": "multimodal wrapper (Gemma3ForConditionalGeneration: vision tower + text decoder); the decoder is swept as gemma3_text",
    "gemma3n": "multimodal wrapper (vision + audio towers); the decoder is swept as gemma3n_text",
    "gemma4": "multimodal wrapper (vision + audio towers); the decoder is swept as gemma4_text",
    "gemma4_unified": "multimodal wrapper; the decoder is swept as gemma4_unified_text",
    # need inputs beyond token ids
    "gemma4_assistant": "speculative-decoding drafter: every layer reads the K/V of the main Gemma 4 model "
                        "(its validator requires all layers K/V-shared); no standalone forward",
    "gemma4_unified_assistant": "speculative-decoding drafter: every layer reads the K/V of the main model; "
                                "no standalone forward",
    "got_ocr2": "multimodal (OCR): a vision encoder whose image tokens the decoder needs; no text-only causal LM",
    "moss_transcribe_diarize": "speech (audio encoder + decoder): needs audio features",
    "git": "image captioning decoder: needs pixel_values (its loss drops the image tokens' positions)",
    "musicgen": "audio-codebook decoder: input_ids of shape [batch * num_codebooks, seq], one embedding per codebook",
    "musicgen_melody": "audio-codebook decoder: input_ids of shape [batch * num_codebooks, seq], one embedding per codebook",
}
"""model_type -> why it is not run (listed in the table as ``not run: reason``)."""


def families(only: list[str] | None = None) -> list[dict]:
    """One entry per model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: ``{"model_type",
    "class", "run": bool, "why": reason when not run}``. A class reached from several model
    types runs once, under the first; the others say ``same class as X``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # a class reached from several model types runs under the one its config class names
    # (GPT2LMHeadModel under gpt2, not gpt-sw3), else under the first
    canonical: dict[str, str] = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if model_type in NOT_RUN:
            continue
        cls = getattr(transformers, class_name, None)
        own = getattr(getattr(cls, "config_class", None), "model_type", None) == model_type
        if class_name not in canonical or own:
            canonical[class_name] = model_type if own or class_name not in canonical else canonical[class_name]
    out = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        entry = {"model_type": model_type, "class": class_name, "run": True, "why": None}
        if model_type in NOT_RUN:
            entry.update(run=False, why=NOT_RUN[model_type])
        elif canonical[class_name] != model_type:
            entry.update(run=False, why=f"same class as {canonical[class_name]}")
        out.append(entry)
    if only:
        missing = sorted(set(only) - {e["model_type"] for e in out})
        if missing:
            raise SystemExit(f"sweep_transformers: not a causal-LM model type: {', '.join(missing)}")
        out = [e for e in out if e["model_type"] in only]
    return out


# -- the shrink -----------------------------------------------------------------------------

LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers",
              "num_layers_per_stack",
              "num_blocks",)
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "embedding_dim", "emb_dim", "n_embed", "dim", "model_dim",
               "embed_dim", "hidden_size_global",)
RATIO_TO_HIDDEN_KEYS = (
    # sizes some families set beside hidden (equal to it, or a multiple): kept in the same ratio
    "word_embed_proj_dim", "embedding_size", "input_embedding_size", "lru_width", "attention_hidden_size",
    "mamba_d_ssm", "hidden_size_per_layer_input", "dim_model_base", "backbone_hidden_size",
)
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads", "attention_heads",
             "num_decoder_attention_heads", "swa_num_attention_heads", "linear_num_heads",
             "linear_num_value_heads", "index_n_heads",)
KV_HEAD_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_n_heads", "multi_query_group_num",
                "swa_num_key_value_heads", "linear_num_key_heads", "num_query_groups",)
HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "d_head", "dim_head", "attention_head_size", "kv_channels",
                 "swa_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "index_head_dim",
                 "indexer_head_dim", "query_pre_attn_scalar",)
INTERMEDIATE_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "decoder_ffn_dim", "d_ff", "dff",
                     "dim_ff", "d_inner", "feed_forward_size", "intermediate_size_mlp", "dense_intermediate_size",
                     "expert_ffn_hidden_size",)
MOE_INTERMEDIATE_KEYS = ("moe_intermediate_size", "shared_expert_intermediate_size",
                         "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size",
                         "shared_intermediate_size", "expert_intermediate_size",)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num",)
TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k", "top_k_experts",
             "top_k",)
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts",)
VOCAB_KEYS = ("vocab_size", "decoder_vocab_size", "shape_vocab_size", "pronunciation_vocab_size",
              "vocab_size_per_layer_input", "encoder_hash_byte_group_vocab", "unpadded_vocab_size",)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                 "context_length", "seq_length", "model_max_length", "max_sequence_length",)
WINDOW_KEYS = ("sliding_window", "sliding_window_size", "attention_window_size", "window_size", "local_attention",
               "local_attention_window_len", "keep_window_size", "attention_chunk_size",)
EVERY_N_KEYS = (
    # "every n-th layer is different": 2 makes one of the two layers the different one
    "global_attn_every_n_layers", "no_rope_layer_interval", "sliding_window_pattern", "_sliding_window_pattern",
    "attn_layer_period", "expert_layer_period", "moe_layer_freq", "layer_group_size", "n_layers_per_attn_res_block",
)
OFFSET_KEYS = ("attn_layer_offset", "expert_layer_offset",)
SSM_STATE_KEYS = ("state_size", "mamba_d_state", "ssm_state_size",)
SSM_RANK_KEYS = ("time_step_rank", "mamba_dt_rank",)
SSM_CHUNK_KEYS = ("chunk_size", "mamba_chunk_size",)
SSM_GROUP_KEYS = ("n_groups", "mamba_n_groups", "mamba_ngroups",)
SSM_HEAD_KEYS = ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads",)
SSM_HEAD_DIM_KEYS = ("mamba_d_head", "mamba_head_dim", "mamba_headdim",)
LOW_RANK_KEYS = ("q_lora_rank", "kv_lora_rank", "o_lora_rank", "hc_lowrank", "adapter_rank", "laurel_rank",
                 "router_hidden_size", "gated_norm_rank",)
LAYER_INDEX_LIST_KEYS = ("mlp_only_layers", "moe_layers", "hybrid_layer_ids", "full_attn_idxs", "attn_layer_indices",
                         "local_layer_ids", "global_attn_indexes", "cross_attention_layers",)
PER_LAYER_DICT_KEYS = ("per_layer_config",)
"""Dicts keyed by layer index (per-layer overrides)."""
PATTERN_STRING_RE = re.compile(r"pattern|block_type|layer_type")
"""A string field is a per-layer pattern (one character a layer) only if its name says so."""
TOKEN_ID_RE = re.compile(r"(_token_id|_token_ids|_token_index|_id)$")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shrink_config(d: dict, target: Target, notes: list[str], path: str = "") -> dict:
    """Shrink one config dict (and its sub-config dicts) by field name. ``notes`` gets one line
    per kind of change that a reader of the table needs (what was not simply made small)."""
    d = copy.deepcopy(d)
    layers_before = next((d[k] for k in LAYER_KEYS if _int(d.get(k))), None)
    hidden_before = next((d[k] for k in HIDDEN_KEYS if _int(d.get(k))), None)
    heads_before = next((d[k] for k in HEAD_KEYS if _int(d.get(k))), None)
    positions_before = next((d[k] for k in POSITION_KEYS if _int(d.get(k))), None)
    where = f"{path}." if path else ""

    for key, value in list(d.items()):
        if key in PER_LAYER_DICT_KEYS and isinstance(value, dict):
            d[key] = {k: shrink_config(v, target, [], where + key) if isinstance(v, dict) else v
                      for k, v in value.items()}
        elif isinstance(value, dict) and (key.endswith("config") or key.endswith("_cfg")):
            d[key] = shrink_config(value, target, notes, where + key)

    # per-layer lists (layer types, per-layer sizes) and layer-index lists: keep two layers that
    # show the list's variety: layer 0 and the first layer that differs from it in any list
    if layers_before and layers_before > target.layers:
        per_layer = {k: v for k, v in d.items()
                     if (isinstance(v, list) or (isinstance(v, str) and PATTERN_STRING_RE.search(k)))
                     and len(v) == layers_before and not k.endswith("_token_ids")}
        as_flags = {k: [i in set(v) for i in range(layers_before)] for k, v in d.items()
                    if k in LAYER_INDEX_LIST_KEYS and isinstance(v, list) and all(_int(i) for i in v)}
        by_index = {k: [v.get(i, v.get(str(i))) for i in range(layers_before)] for k, v in d.items()
                    if k in PER_LAYER_DICT_KEYS and isinstance(v, dict)}
        columns = [*per_layer.values(), *as_flags.values(), *by_index.values()]
        differ = [next((i for i in range(1, layers_before) if col[i] != col[0]), None) for col in columns]
        differ = [i for i in differ if i is not None]
        keep = [0, min(differ)] if differ else list(range(target.layers))
        keep += [i for i in range(layers_before) if i not in keep][: target.layers - len(keep)]
        keep = sorted(keep)[: target.layers]
        for k, v in per_layer.items():
            picked = [v[i] for i in keep]
            d[k] = "".join(picked) if isinstance(v, str) else picked
        for k, flags in as_flags.items():
            d[k] = [j for j, i in enumerate(keep) if flags[i]]
        for k, column in by_index.items():
            d[k] = {j: column[i] for j, i in enumerate(keep) if column[i] is not None}
        if keep != list(range(target.layers)) and columns:
            notes.append(f"{where}per-layer lists keep layers {keep} of {layers_before}")

    for key, value in list(d.items()):
        if key in LAYER_KEYS and _int(value) and value > target.layers:
            d[key] = target.layers
        elif key in HIDDEN_KEYS and _int(value) and value > target.hidden:
            d[key] = target.hidden
        elif key in RATIO_TO_HIDDEN_KEYS and _int(value) and value > 0 and hidden_before:
            d[key] = max(8, round(value * target.hidden / hidden_before / 8) * 8)
        elif key in HEAD_KEYS and _int(value) and value > 1:
            d[key] = target.heads
        elif key in KV_HEAD_KEYS and _int(value):
            if value == 1:
                notes.append(f"{where}{key}=1 kept (multi-query)")
            elif heads_before is not None and value == heads_before:
                d[key] = target.heads
            else:
                d[key] = target.kv_heads
        elif key in HEAD_DIM_KEYS and _int(value) and value > 0:
            d[key] = target.head_dim
        elif key in INTERMEDIATE_KEYS and _int(value) and value > 0:
            d[key] = target.intermediate
        elif key in INTERMEDIATE_KEYS and isinstance(value, list) and value and all(_int(v) for v in value):
            d[key] = [target.intermediate] * len(value)
        elif key in MOE_INTERMEDIATE_KEYS and _int(value) and value > 0:
            d[key] = target.moe_intermediate
        elif key in EXPERT_KEYS and _int(value) and value > target.experts:
            d[key] = target.experts
        elif key in TOPK_KEYS and _int(value) and value > target.experts_per_token:
            d[key] = target.experts_per_token
        elif key in SHARED_EXPERT_KEYS and _int(value) and value > 1:
            d[key] = 1
        elif key in VOCAB_KEYS and _int(value) and value > target.vocab:
            d[key] = target.vocab
        elif key in POSITION_KEYS and _int(value) and value > target.positions:
            d[key] = target.positions
        elif key in WINDOW_KEYS and _int(value) and value > target.window:
            d[key] = target.window
        elif key in EVERY_N_KEYS and _int(value) and value > 2:
            d[key] = 2
        elif key in OFFSET_KEYS and _int(value) and value > 1:
            d[key] = 1
        elif key in SSM_STATE_KEYS and _int(value) and value > 16:
            d[key] = 16
        elif key in SSM_RANK_KEYS and _int(value) and value > 8:
            d[key] = 8
        elif key in SSM_CHUNK_KEYS and _int(value) and value > 8:
            d[key] = 8
        elif key in SSM_GROUP_KEYS and _int(value) and value > 1:
            d[key] = 1
        elif key in SSM_HEAD_KEYS and _int(value) and value > target.heads:
            d[key] = target.heads
        elif key in LOW_RANK_KEYS and _int(value) and value > 32:
            d[key] = 32

    # size fields the default config leaves None although the model needs them (filled with the target)
    if "head_dim" in d and d["head_dim"] is None and heads_before:
        d["head_dim"] = target.head_dim
        notes.append(f"{where}head_dim None -> {target.head_dim}")
    for key in ("num_key_value_heads",):
        if key in d and d[key] is None and heads_before:
            d[key] = target.kv_heads
            notes.append(f"{where}{key} None -> {target.kv_heads}")
    moe_on = any(_int(d.get(k)) and d[k] > 0 for k in EXPERT_KEYS + MOE_INTERMEDIATE_KEYS + TOPK_KEYS)
    if moe_on:
        for keys, value in ((EXPERT_KEYS, target.experts), (TOPK_KEYS, target.experts_per_token),
                            (SHARED_EXPERT_KEYS, 1)):
            for key in keys:
                if key in d and d[key] is None:
                    d[key] = value
                    notes.append(f"{where}{key} None -> {value}")
    # MLA head sizes (DeepSeek): rope and no-rope parts of the query/key head, value head
    if _int(d.get("qk_rope_head_dim")):
        d["qk_rope_head_dim"] = target.head_dim
        if _int(d.get("qk_nope_head_dim")):
            d["qk_nope_head_dim"] = target.head_dim
        if _int(d.get("v_head_dim")):
            d["v_head_dim"] = 2 * target.head_dim
        if _int(d.get("head_dim")):
            d["head_dim"] = d["qk_rope_head_dim"]
        if _int(d.get("qk_head_dim")):
            d["qk_head_dim"] = d["qk_rope_head_dim"] + d.get("qk_nope_head_dim", 0)
    # SSM heads x head size = the SSM's inner width (mamba_d_ssm, else expand x hidden); a Mamba-2
    # config without attention calls its SSM heads num_heads / head_dim
    expand = next((d[k] for k in ("mamba_expand", "expand") if isinstance(d.get(k), (int, float))), None)
    hidden = next((d[k] for k in HIDDEN_KEYS if _int(d.get(k))), None)
    pure_ssm = any(k in d for k in SSM_STATE_KEYS) and "num_attention_heads" not in d
    head_keys = SSM_HEAD_KEYS + (("num_heads",) if pure_ssm else ())
    dim_keys = SSM_HEAD_DIM_KEYS + (("head_dim",) if pure_ssm else ())
    ssm_heads = next((d[k] for k in head_keys if _int(d.get(k))), None)
    inner = d["mamba_d_ssm"] if _int(d.get("mamba_d_ssm")) else (int(expand * hidden) if expand and hidden else None)
    for key in dim_keys:
        if _int(d.get(key)) and inner and ssm_heads:
            d[key] = inner // ssm_heads
    # layers that are counted rather than listed
    layers = next((d[k] for k in LAYER_KEYS if _int(d.get(k))), None)
    if layers_before and layers:
        for key in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "num_kv_shared_layers"):
            if _int(d.get(key)) and d[key] >= layers:
                d[key] = layers - 1
        for key in ("max_window_layers", "moe_layer_end_index"):
            if _int(d.get(key)):
                d[key] = layers if d[key] >= layers_before - 1 else min(d[key], layers - 1)
    # expert groups (DeepSeek-style group-limited routing): 2 groups of 2, one group chosen
    experts = next((d[k] for k in EXPERT_KEYS if _int(d.get(k)) and d[k] > 0), None)
    for key in ("n_group", "num_expert_group"):
        if _int(d.get(key)) and d[key] > 1 and experts:
            d[key] = 2 if experts % 2 == 0 else 1
    if _int(d.get("topk_group")) and d["topk_group"] > 1:
        d["topk_group"] = 1
    if _int(d.get("index_topk")):
        d["index_topk"] = min(d["index_topk"], SEQ // 2)
    # rope: keep the type and factors, scale the original context with the context
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(key), dict):
            d[key] = _shrink_rope(d[key], positions_before, target)
    if _int(d.get("original_max_position_embeddings")) and positions_before:
        d["original_max_position_embeddings"] = max(
            1, round(d["original_max_position_embeddings"] * target.positions / positions_before))
    if _int(d.get("rotary_dim")):  # GPT-J / CodeGen: rotary on part of the head, same fraction
        head_before = hidden_before // heads_before if hidden_before and heads_before else None
        frac = d["rotary_dim"] / head_before if head_before else 0.5
        d["rotary_dim"] = max(2, int(target.head_dim * frac) // 2 * 2)
    # special token ids must lie inside the smaller vocabulary
    vocab = next((d[k] for k in ("vocab_size",) if _int(d.get(k))), target.vocab)
    remap: dict[int, int] = {}

    def fix(token):
        if _int(token) and token >= vocab:
            remap.setdefault(token, vocab - 1 - len(remap))
            return remap[token]
        return token

    for key, value in list(d.items()):
        if TOKEN_ID_RE.search(key) and key not in ("lang_id",):
            d[key] = [fix(t) for t in value] if isinstance(value, list) else fix(value)
    return d


def _shrink_rope(rope: dict, positions_before, target: Target) -> dict:
    rope = dict(rope)
    if all(isinstance(v, dict) for v in rope.values()) and rope:  # per layer type
        return {k: _shrink_rope(v, positions_before, target) for k, v in rope.items()}
    if _int(rope.get("original_max_position_embeddings")) and positions_before:
        rope["original_max_position_embeddings"] = max(
            1, round(rope["original_max_position_embeddings"] * target.positions / positions_before))
    half = target.head_dim // 2
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), list):
            rope[key] = rope[key][:half]
    if isinstance(rope.get("mrope_section"), list):
        sections = rope["mrope_section"]
        total = sum(sections)
        scaled = [max(1, s * half // total) for s in sections]
        scaled[0] += half - sum(scaled)
        rope["mrope_section"] = scaled
    return rope


FAMILY_OVERRIDES: dict[str, tuple[dict, str]] = {
    "cohere_compass_text": ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
                            "its default config has no RoPE parameters, which the model reads per layer type "
                            "(the unshrunk default does not build either)"),
    "dbrx": ({"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
             "its default attention config has no rope_theta, which the model reads, and clip_qkv None, which it "
             "passes to clamp as both bounds (the unshrunk default fails too); 8.0 is DBRX's released value"),
    "gemma3n_text": ({"num_kv_shared_layers": 0},
                     "the last layers reuse the K/V of an earlier layer of the same type; with 2 layers there is "
                     "none, so K/V sharing is off"),
    "gemma4_assistant": ({"hidden_size_per_layer_input": 0},
                         "its default sets 256 where its own validator requires 0 (the unshrunk default fails too)"),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"]},
                 "its default config leaves layer_types None, which the model indexes (the unshrunk default does not "
                 "build either)"),
    "qwen4_exp_text": ({"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 8,
                   "indexer_budget": 8, "indexer_compress_ratio": 2},
                  "its default config leaves the indexed-attention (QSA) sizes None while its layer types use it"),
    "reformer": ({"axial_pos_shape": [4, 4], "axial_pos_embds_dim": [32, 32], "local_attn_chunk_length": 8,
                  "lsh_attn_chunk_length": 8, "num_buckets": 2},
                 "axial position embeddings must factor the (training) sequence length, 16 = 4 x 4, and their "
                 "widths sum to hidden; attention chunks must divide the sequence"),
    "zamba": ({"layers_block_type": ["hybrid", "hybrid"]},
              "one shared attention block serves the hybrid layers; transformers' weight tying needs at least two"),
}
"""model_type -> (config fields set after the generic shrink, dotted into sub-configs; why the
generic rules cannot)."""

FAMILY_SETUP = {
    "xmod": (lambda model: model.set_default_language("en_XX"),
             "set_default_language('en_XX') (X-MOD routes every token through a language adapter)"),
}
"""model_type -> (call on the built model, note): what a user must do before the first forward."""


# -- one family, in this process ------------------------------------------------------------


def build(model_type: str, class_name: str, target: Target):
    """(model, attn_implementation, notes) for one family."""
    import torch
    import transformers

    cls = getattr(transformers, class_name)
    config_cls = cls.config_class
    notes: list[str] = []
    with contextlib.redirect_stderr(io.StringIO()):
        base = config_cls()
    d = base.to_dict()
    shrunk = shrink_config(d, target, notes)
    override, why = FAMILY_OVERRIDES.get(model_type, ({}, None))
    if override:
        for dotted, value in override.items():
            *parents, key = dotted.split(".")
            node = shrunk
            for parent in parents:
                node = node[parent]
            node[key] = value
        notes.append(f"override {', '.join(f'{k}={v}' for k, v in override.items())}: {why}")
    for key in ("is_decoder",):
        if key in shrunk:
            shrunk[key] = True
    shrunk["use_cache"] = False
    shrunk.pop("transformers_version", None)
    shrunk.pop("dtype", None)
    shrunk.pop("torch_dtype", None)
    config = config_cls.from_dict(shrunk)
    errors = []
    for attn in ("sdpa", "eager"):
        try:
            torch.manual_seed(0)
            with contextlib.redirect_stderr(io.StringIO()):
                model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32)
            setup = FAMILY_SETUP.get(model_type)
            if setup:
                setup[0](model)
                notes.append(setup[1])
            return model.float().train(), attn, notes
        except Exception as error:  # e.g. "does not support ... scaled_dot_product_attention yet"
            errors.append(f"{attn}: {type(error).__name__}: {_first_line(error)}")
    raise RuntimeError("; ".join(errors))


def token_inputs(model) -> dict:
    import torch

    vocab = model.get_input_embeddings().num_embeddings
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "out_features", None):  # ids that are also valid labels
        vocab = min(vocab, head.out_features)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def train_one_device(model, inputs) -> dict:
    """Forward with labels, backward, one SGD step on a deep copy: ok when the loss and every
    gradient are finite. Also counts parameters that get no gradient."""
    import torch

    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    torch.manual_seed(1)
    out = m(**inputs, use_cache=False) if _takes(m, "use_cache") else m(**inputs)
    loss = out.loss if hasattr(out, "loss") else out[0]
    if loss is None or loss.dim() != 0:
        return {"status": "fail", "reason": "the model returns no scalar loss for labels="}
    if not torch.isfinite(loss):
        return {"status": "fail", "reason": f"loss is {loss.item()}"}
    loss.backward()
    params = dict(m.named_parameters())
    no_grad = [n for n, p in params.items() if p.requires_grad and p.grad is None]
    bad = [n for n, p in params.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if bad:
        return {"status": "fail", "reason": f"non-finite gradient of {bad[0]} (+{len(bad) - 1})"}
    opt.step()
    return {"status": "ok", "loss": float(loss), "params": len(params),
            "numel": sum(p.numel() for p in params.values()), "no_grad": no_grad}


def _takes(model, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def run_verify(model, inputs, *, tp: int, sp: bool, processes: bool = False, pp: int = 1, dp: int = 1, ep: int = 1,
               recompute: str | float | int = "none", compile: str = "inductor", rtol: float = 1e-4,
               experts: str | None = None, shard_whole: bool = False) -> dict:
    """``sptransform.verify`` of one layout, as a JSON-able dict (``status``: equal / different /
    refused / error). ``pp > 1``, ``dp > 1`` and a ``recompute`` need real processes
    (``processes=True``). ``experts``: run a copy of an MoE model with this
    ``experts_implementation`` (expert parallelism splits ``batched_mm`` experts)."""
    import copy

    import sptransform

    if experts is not None and hasattr(model, "set_experts_implementation") and \
            getattr(model.config, "_experts_implementation", None) not in (None, experts):
        model = copy.deepcopy(model)
        try:
            model.set_experts_implementation(experts)
        except Exception:  # a model whose experts have no such implementation runs as it is
            pass
    start = time.monotonic()
    try:
        report = sptransform.verify(model, tp=tp, sp=sp, pp=pp, dp=dp, ep=ep, example_inputs=inputs,
                                    processes=processes, recompute=recompute, compile=compile, rtol=rtol,
                                    shard_whole=shard_whole)
    except TimeoutError as error:  # verify's own limit (timeout_s) on its spawned processes
        return {"status": "timeout", "reason": f"TimeoutError: {_first_line(error)}",
                "seconds": time.monotonic() - start}
    except Exception as error:  # verify itself raised (not a refusal, not a finished comparison)
        where = traceback.extract_tb(error.__traceback__)[-1]
        return {"status": "error", "reason": f"{type(error).__name__}: {_first_line(error)} "
                f"({os.path.basename(where.filename)}:{where.lineno})", "seconds": time.monotonic() - start}
    result = {"status": report.status, "seconds": round(time.monotonic() - start, 2), "notes": report.notes,
              "linears": list(report.linears) if getattr(report, "linears", None) else None,
              "held_share": report.held_share, "ranks": report.ranks, "rtol": rtol}
    if report.status == "refused":
        result["reason"] = _first_line(report.error)
    elif report.status == "different":
        failing = sorted(report.failing, key=lambda r: -r.rel_error if not math.isnan(r.rel_error) else 0)
        result["failing"] = [dict(name=r.name, kind=r.kind, placement=r.placement, rel_error=_num(r.rel_error))
                             for r in failing]
        result["rows"] = len(report.rows)
        result["worst"] = _num(report.worst)
        if report.error:
            result["raised"] = _first_line(report.error)
        result["reason"] = describe_failure(result)
    else:
        result["worst"] = _num(report.worst)
    return result


def describe_failure(result: dict) -> str:
    """One line for a ``different`` verify result: what raised, how many rows are off, the worst,
    and which gradients (layer numbers folded: ``layers.N.input_layernorm.weight``)."""
    failing = result.get("failing", [])
    parts = []
    if result.get("raised"):
        parts.append(f"the parallel model raised: {result['raised']}")
    if failing:
        worst = failing[0]
        parts.append(f"{len(failing)} of {result.get('rows', '?')} rows off; worst {worst['kind']} of "
                     f"{worst['name']} ({worst['placement']}) rel error {_fmt(worst['rel_error'])}")
        grads = list(dict.fromkeys(re.sub(r"\.\d+\.", ".N.", f["name"]) for f in failing if f["kind"] == "grad"))
        outputs = [f["name"] for f in failing if f["kind"] == "output"]
        if outputs:
            parts.append(f"outputs off: {', '.join(outputs)}")
        if grads:
            parts.append(f"grads off: {', '.join(grads[:6])}{f' (+{len(grads) - 6} more)' if len(grads) > 6 else ''}")
    return "; ".join(parts)


def _num(x: float):
    return x if math.isfinite(x) else str(x)


def _fmt(x) -> str:
    return f"{x:.1e}" if isinstance(x, (int, float)) else str(x)


def _first_line(error) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _shorten_paths(text)


def _shorten_paths(text: str) -> str:
    text = re.sub(r"\"?/[^\s\"]*/site-packages/", "", text)
    text = re.sub(r"\"?" + re.escape(ROOT) + "/", "", text)
    return text.replace('.py",', ".py,")


def worker(model_type: str, class_name: str, target: Target, result_path: str, engine: Engine = Engine()) -> None:
    """Run one family and write its result to ``result_path`` after every stage (so that a crash
    or a timeout in a later stage keeps the earlier ones)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    result: dict = {"model_type": model_type, "class": class_name, "stage": "build"}

    def save():
        with open(result_path + ".tmp", "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(result_path + ".tmp", result_path)

    save()
    try:
        model, attn, notes = build(model_type, class_name, target)
    except Exception as error:
        result["build"] = {"status": "fail", "reason": f"{type(error).__name__}: {_first_line(error)}"}
        save()
        return
    model = model.to(getattr(torch, engine.dtype))
    result["build"] = {"status": "ok", "attn": attn}
    result["notes"] = notes
    inputs = token_inputs(model)
    result["stage"] = "single"
    save()
    try:
        result["single"] = train_one_device(model, inputs)
    except Exception as error:
        result["single"] = {"status": "fail", "reason": f"{type(error).__name__}: {_first_line(error)}"}
    save()
    if result["single"]["status"] != "ok":
        return
    for key, _ in COLUMNS:
        if key not in engine.columns:
            continue
        result["stage"] = key
        save()
        result[key] = run_verify(model, inputs, processes=engine.processes or key in REAL_RANKS_ONLY, **LAYOUTS[key])
        save()
    result["stage"] = "done"
    save()


# -- the sweep: one subprocess per family -------------------------------------------------------

COLUMNS = (("tp2_sp", "tp=2+SP"), ("tp4", "tp=4"), ("pp2", "pp=2"), ("ep2", "dp=2, ep=2"),
           ("ep2_grouped", "dp=2, ep=2, grouped_mm"), ("tp2_ep2", "tp=2+SP, dp=2, ep=2"),
           ("tp2_ep2_grouped", "tp=2+SP, dp=2, ep=2, grouped_mm"), ("tp2_whole", "tp=2+SP, shard_whole"),
           ("recompute", "tp=2+SP, recompute selective"), ("budget", "tp=2+SP, recompute budget 0.5"))
"""Result key and column title of each verify run (``LAYOUTS``: its arguments)."""

LAYOUTS: dict[str, dict] = {
    "tp2_sp": dict(tp=2, sp=True),
    "tp4": dict(tp=4, sp=False),
    # two pipeline stages on one tensor-parallel rank each: the cut between blocks alone
    "pp2": dict(tp=1, sp=False, pp=2),
    # experts split over 2 data-parallel ranks (MoE families, their experts as batched_mm)
    "ep2": dict(tp=1, sp=False, dp=2, ep=2, experts="batched_mm"),
    # the same with the experts as transformers runs them by default (a grouped matmul of the sorted pairs)
    "ep2_grouped": dict(tp=1, sp=False, dp=2, ep=2, experts="grouped_mm"),
    # the same on 4 ranks, the experts' matrices split by their hidden dims over tp=2 too
    "tp2_ep2": dict(tp=2, sp=True, dp=2, ep=2, experts="batched_mm"),
    "tp2_ep2_grouped": dict(tp=2, sp=True, dp=2, ep=2, experts="grouped_mm"),
    # what tp keeps whole stored in 1/tp pieces (held per rank: 1/2 wherever a dim divides)
    "tp2_whole": dict(tp=2, sp=True, shard_whole=True),
    # the partitioned forward and backward compiled by inductor (issue 24: its layouts)
    "recompute": dict(tp=2, sp=True, recompute="selective", compile="inductor"),
    "budget": dict(tp=2, sp=True, recompute=0.5, compile="inductor"),
}
"""Column key -> ``run_verify``'s layout arguments."""

REAL_RANKS_ONLY = frozenset({"pp2", "ep2", "ep2_grouped", "tp2_ep2", "tp2_ep2_grouped", "tp2_whole", "recompute", "budget"})
"""Columns that run on real gloo processes whatever ``--processes`` says: simulated ranks run
neither torch's pipelining nor AOTAutograd (which partitions and compiles for ``recompute``)."""

DEFAULT_COLUMNS = ("tp2_sp", "tp4")
"""What a sweep runs unless ``--columns`` says otherwise (the others spawn processes per family)."""


def run_family(entry: dict, timeout: float, script: str = __file__, worker_args: tuple = ()) -> dict:
    """Run ``script --worker`` for one family in a subprocess (its own session, killed as a group
    at the timeout); returns the worker's result, completed with what happened to the process."""
    if not entry["run"]:
        return {"model_type": entry["model_type"], "class": entry["class"], "not_run": entry["why"]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory(prefix="sweep-") as folder:
        path = os.path.join(folder, "result.json")
        log = os.path.join(folder, "stderr.txt")
        cmd = [sys.executable, script, "--worker", entry["model_type"], "--result", path, *worker_args]
        start = time.monotonic()
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
        seconds = time.monotonic() - start
        result = {"model_type": entry["model_type"], "class": entry["class"], "stage": "start"}
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
        with open(log, errors="replace") as f:
            tail = [line.strip() for line in f.read().splitlines() if line.strip()]
    result["seconds"] = round(seconds, 1)
    if timed_out:
        result["ended"] = f"timeout: still in {result.get('stage')} after {timeout:g} s"
    elif proc.returncode != 0:
        last = next((line for line in reversed(tail) if not line.startswith(("File ", "^", "~"))), "")
        result["ended"] = f"crashed (exit {proc.returncode}) in {result.get('stage')}: {_shorten_paths(last)[:300]}"
    return result


def target_args(target: Target) -> list[str]:
    return ["--heads", str(target.heads), "--kv-heads", str(target.kv_heads), "--hidden", str(target.hidden)]


def outcome(result: dict, key: str) -> tuple[str, str]:
    """(status word, reason) of one column: equal / refused / wrong / error / timeout / crashed /
    not run / ''; the reason as the table shows it."""
    if "not_run" in result:
        return "not run", result["not_run"]
    if key in result:
        r = result[key]
        status = {"different": "wrong"}.get(r["status"], r["status"])
        return status, describe_failure(r) if status == "wrong" else r.get("reason", "")
    if result.get("ended") and result.get("stage") == key:  # the process died or hung in this column
        word = "timeout" if result["ended"].startswith("timeout") else "crashed"
        return word, result["ended"]
    return "", ""  # not reached: the build or one device failed, or an earlier column ended the process


def single_outcome(result: dict) -> tuple[str, str]:
    if "not_run" in result:
        return "not run", result["not_run"]
    build = result.get("build")
    if build is None or (build.get("status") == "ok" and "single" not in result):
        if result.get("ended"):
            return ("timeout" if result["ended"].startswith("timeout") else "crashed"), result["ended"]
        return "?", ""
    if build.get("status") == "fail":
        return "build fails", build["reason"]
    single = result["single"]
    if single["status"] == "ok":
        return "trains", ""
    return "fails", single["reason"]


_PATH_IN_PARENS = re.compile(r"\([^()]*(?:\([^()]*\)[^()]*)*\)")


_SOURCE = re.compile(
    # "at FILE.py, line N, in FN: SOURCE LINE" up to where sptransform's message goes on
    r" at \S+\.py, line \d+, in [^:]+: .*?(?=( \(parameter '| was not recognized| cannot run on| cannot keep|"
    r" reduces|: no column-parallel|: reshape |: needed |: its |; |$))")


def reason_class(reason: str) -> str:
    """A refusal's kind, for counting: the message without its specifics (source locations and
    lines, graph node and parameter names, numbers, what follows the first ';'). The ops named
    stay: 'no sharding rule for aten.einsum' and 'for aten.stack' are different work."""
    text = _SOURCE.sub("", reason)
    text = text.split("; ")[0]
    text = re.sub(r" \(node [^)]*\)", "", text)
    text = re.sub(r" \(aten\.[^()]*(\([^()]*\)[^()]*)*\)", "", text)  # where a size check failed
    text = re.sub(r" \(parameter '[^']*'\)", "", text)
    text = re.sub(r"parameter p_\w+", "parameter …", text)  # a graph input's name (a norm weight)
    text = re.sub(r"one graph \((\w+)\b.*\)(?=\. The forward)", r"one graph (\1)", text)  # torch's own message
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\(\d+(, \d+)*\)", "(…)", text)
    text = re.sub(r"\{[\d, ]+\}", "{…}", text)
    text = re.sub(r"\b\d+\b", "N", text)
    text = re.sub(r"\s+", " ", text).strip(" :,.")
    return text[:300]


def _cell(text: str, limit: int = 400) -> str:
    text = (text or "").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def totals(results: list[dict]) -> dict:
    run = [r for r in results if "not_run" not in r]
    t = {
        "model_types": len(results),
        "not_run": len(results) - len(run),
        "tried": len(run),
        "build": sum(r.get("build", {}).get("status") == "ok" for r in run),
        "trains": sum(single_outcome(r)[0] == "trains" for r in run),
    }
    for key, _ in COLUMNS:
        counts: dict[str, int] = {}
        for r in run:
            word = outcome(r, key)[0]
            if word:
                counts[word] = counts.get(word, 0) + 1
        t[key] = counts
        t[f"{key}_partly_whole"] = sum(1 for r in run if outcome(r, key)[0] == "equal" and _partly_whole(r, key))
        reasons: dict[str, int] = {}
        for r in run:
            word, reason = outcome(r, key)
            if word == "refused":
                k = reason_class(reason)
                reasons[k] = reasons.get(k, 0) + 1
        t[f"{key}_reasons"] = dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
    return t


def render(results: list[dict], meta: dict) -> str:
    """The generated section of docs/supported_models.md (between its markers)."""
    t = totals(results)
    lines = [
        "## Causal LMs in transformers",
        "",
        f"Generated by `python tools/sweep_transformers.py` ({meta['when']}; transformers {meta['transformers']}, "
        f"torch {meta['torch']}; {meta['seconds']:.0f} s with --jobs {meta['jobs']}). Every model type of "
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built from its class's default config shrunk by field name "
        f"({meta['target']}), {meta.get('engine', 'simulated ranks, float32').split(', ')[-1]}, in train() mode "
        f"with its configured dropout, batch {BATCH} x {SEQ} "
        "tokens with labels; then `sptransform.verify` at tp=2 with SP and at tp=4 without "
        f"({meta.get('engine', 'simulated ranks, float32').split(', ')[0]}, 1 SGD step, rtol 1e-4). *held* = the "
        "share of the parameter bytes one rank stores (measured on its tensors; 1/tp when every weight is split). *wrong* = verify said `different` (a row beyond rtol, or the parallel model "
        "raised while running); *error* = verify itself raised; *refused* = `parallelize` raised a "
        "ValueError/TypeError naming why." + (f" {meta['updated']}" if meta.get("updated") else ""),
        "",
        "### Totals",
        "",
        f"* model types: {t['model_types']}; not run: {t['not_run']} (listed at the end: the same class as "
        "another model type, multimodal wrappers, inputs beyond token ids)",
        f"* **tried: {t['tried']}**; built from the shrunk config: {t['build']}; **train on one device: "
        f"{t['trains']}**",
    ]
    for key, title in COLUMNS:
        if key not in meta.get("columns", DEFAULT_COLUMNS):
            continue
        c = t[key]
        order = ["equal", "refused", "wrong", "error", "timeout", "crashed"]
        parts = [f"{word} {c.get(word, 0)}" for word in order]
        parts += [f"{word} {n}" for word, n in c.items() if word not in order]
        lines.append(f"* **{title}**: " + ", ".join(parts)
                     + f" (of the equal, {t[f'{key}_partly_whole']} run some linears whole on every rank)")
    lines += ["", "### Refusal reasons", "",
              "| reason (specifics elided) | tp=2+SP | tp=4 |", "| --- | ---: | ---: |"]
    kinds = list(dict.fromkeys([*t["tp2_sp_reasons"], *t["tp4_reasons"]]))
    kinds.sort(key=lambda k: -(t["tp2_sp_reasons"].get(k, 0) + t["tp4_reasons"].get(k, 0)))
    for k in kinds:
        lines.append(f"| {_cell(k)} | {t['tp2_sp_reasons'].get(k, 0)} | {t['tp4_reasons'].get(k, 0)} |")
    lines += wrong_and_error_tables(results, "family")
    lines += ["", "### All families", "",
              "| family | class | attn | shrink notes | one device | tp=2+SP | tp=4 | reason |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted((r for r in results if "not_run" not in r), key=lambda r: r["model_type"]):
        single, single_reason = single_outcome(r)
        words = [outcome(r, key) for key, _ in COLUMNS]
        reasons = []
        if single_reason:
            reasons.append(single_reason)
        if words[0][1] and words[0][1] == words[1][1]:
            reasons.append(f"both: {words[0][1]}")
        else:
            reasons += [f"{title}: {reason}" for (word, reason), (_, title) in zip(words, COLUMNS) if reason]
        if r.get("ended") and r["ended"] not in " ".join(reasons):
            reasons.append(r["ended"])
        no_grad = r.get("single", {}).get("no_grad") or []
        notes = list(r.get("notes", []))
        if no_grad:
            notes.append(f"{len(no_grad)} params get no gradient on one device")
        cells = [word + _split_cell(r, key) for (word, _), (key, _) in zip(words, COLUMNS)]
        lines.append(f"| {r['model_type']} | {r['class']} | {r.get('build', {}).get('attn', '')} | "
                     f"{_cell('; '.join(notes), 300)} | {single} | {cells[0]} | {cells[1]} | "
                     f"{_cell(' / '.join(reasons))} |")
    lines += ["", "### Not run", "", "| model type | class | why |", "| --- | --- | --- |"]
    for r in results:
        if "not_run" in r:
            lines.append(f"| {r['model_type']} | {r['class']} | {_cell(r['not_run'])} |")
    return "\n".join(lines) + "\n"


LAYOUTS_INTRO = (
    "Generated by `python tools/sweep_transformers.py --render-layouts …` from sweeps run with "
    "`--columns pp2` / `recompute` / `budget` on a sample of families (the rule is in the README). Each "
    "runs `sptransform.verify` on **real gloo processes**: pp=2 is `tp=1, pp=2` (two pipeline stages, "
    "`step()` with 1F1B and 2 microbatches, compared in eval() mode); *recompute* is `tp=2, sp=True, "
    "recompute='selective'` and *budget* `recompute=0.5`, their partitioned forward and backward compiled "
    "by inductor (`compile='inductor'`). 1 SGD step, rtol 1e-4; words as in the section below.")


def render_layouts(runs: list[dict], title: str = "Pipeline stages and recompute on real ranks",
                   intro: str = LAYOUTS_INTRO) -> str:
    """The section 'transformers-layouts': one table column per run, ``{"key": a COLUMNS key,
    "results": a sweep's results, "meta": its meta}`` (a run is one column of one sweep: pp=2 in
    float32, the same in float64, recompute ...), one row per family any run tried."""
    titles = dict(COLUMNS)
    heads = [f"{titles[run['key']]}, {run['meta'].get('engine', '').split(', ')[-1]}" for run in runs]
    lines = [f"## {title}", "", intro, ""]
    for run, head in zip(runs, heads):
        results, meta = run["results"], run["meta"]
        tried = [r for r in results if "not_run" not in r]
        trains = sum(single_outcome(r)[0] == "trains" for r in tried)
        counts: dict[str, int] = {}
        for r in tried:
            word = outcome(r, run["key"])[0]
            if word:
                counts[word] = counts.get(word, 0) + 1
        order = ["equal", "refused", "wrong", "error", "timeout", "crashed"]
        parts = [f"{w} {counts.get(w, 0)}" for w in order] + [f"{w} {n}" for w, n in counts.items() if w not in order]
        libraries = meta.get("libraries") or {"transformers": meta.get("transformers", "?")}
        versions = ", ".join(f"{name} {version}" for name, version in libraries.items())
        lines.append(f"* **{head}**: " + ", ".join(parts) + f" (of {len(tried)} tried, {trains} train on one "
                     f"device; {meta.get('when', '?')}, {versions}, torch {meta.get('torch', '?')}, "
                     f"{meta.get('seconds', 0):.0f} s with --jobs {meta.get('jobs', 1)})")
    families = sorted({r["model_type"] for run in runs for r in run["results"] if "not_run" not in r})
    by_run = [{r["model_type"]: r for r in run["results"]} for run in runs]
    lines += ["", "| family | " + " | ".join(heads) + " | reason |", "| --- | " + "--- | " * len(runs) + "--- |"]
    for family in families:
        cells, reasons = [], []
        for run, results, head in zip(runs, by_run, heads):
            r = results.get(family)
            if r is None:  # this sweep did not run the family (a sample cut short, another --only)
                cells.append("not run")
                continue
            word, reason = outcome(r, run["key"])
            if not word:  # not reached: the build or one device failed (or an earlier column ended it)
                word, reason = "–", single_outcome(r)[1] or r.get("ended", "")
                reason = f"one device: {reason}" if reason else ""
            cells.append(word + _split_cell(r, run["key"]))
            if reason and all(reason != seen for _, seen in reasons):
                reasons.append((head, reason))
        why = " / ".join(f"{head}: {reason}" if len(runs) > 1 else reason for head, reason in reasons)
        lines.append(f"| {family} | " + " | ".join(cells) + f" | {_cell(why, 500)} |")
    return "\n".join(lines) + "\n"


def _partly_whole(result: dict, key: str) -> bool:
    linears = (result.get(key) or {}).get("linears")
    return bool(linears) and linears[0] < linears[1]


def _split_cell(result: dict, key: str) -> str:
    """`` (k/n linears split, held 0.52)`` for an equal model: how many linears run split (when some run
    whole on every rank) and the share of the parameter bytes one rank holds."""
    if outcome(result, key)[0] != "equal":
        return ""
    parts = []
    if _partly_whole(result, key):
        k, n = result[key]["linears"]
        parts.append(f"{k}/{n} linears split")
    if result[key].get("held_share") is not None:
        parts.append(f"held {result[key]['held_share']:.2f}")
    return f" ({', '.join(parts)})" if parts else ""


def wrong_and_error_tables(results: list[dict], what: str) -> list[str]:
    """Markdown lines: every wrong (verify said different) and every error (verify raised) row."""
    lines = []
    for word, title in (("wrong", "Wrong (verify: different)"), ("error", "Error (verify itself raised)")):
        rows = [(r, t, reason) for r in results for key, t in COLUMNS
                for w, reason in [outcome(r, key)] if w == word]
        if rows:
            lines += ["", f"### {title}", "", f"| {what} | layout | what |", "| --- | --- | --- |"]
            lines += [f"| {r['model_type']} | {t} | {_cell(reason, 600)} |" for r, t, reason in rows]
    return lines


BEGIN, END = "<!-- BEGIN {} (generated) -->", "<!-- END {} -->"
DOC_HEADER = """# Supported models

What `sptransform.parallelize` does with models nobody here wrote, measured from the outside with
`sptransform.verify` (simulated ranks, one process). The sections between the markers are generated:
`python tools/sweep_transformers.py` (every causal LM in the installed `transformers`) and
`python tools/sweep_zoo.py` (the hand-written models of `tests/models/zoo.py`, in styles `transformers`
does not use). `tests/integration/test_sweep.py` and `tests/integration/test_zoo.py` check a subset in CI
against an expectation table, so a family that turns wrong, or a known-wrong one that changes, fails a test.
"""


def merge_json(out: str, paths: list[str]) -> None:
    """One --json file of several sweeps' results (in the order given; a family twice is an error):
    the first one's meta, the seconds summed, totals recounted."""
    if not paths:
        raise SystemExit("sweep_transformers: --merge-json OUT needs at least one JSON to merge")
    results, meta, seconds = [], None, 0.0
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        meta = meta or dict(saved["meta"])
        if saved["meta"].get("columns") != meta.get("columns") or saved["meta"].get("engine") != meta.get("engine"):
            raise SystemExit(f"sweep_transformers: {path} ran other columns or another engine than {paths[0]}")
        seconds += saved["meta"].get("seconds", 0.0)
        results += saved["results"]
    seen = [r["model_type"] for r in results]
    twice = sorted({m for m in seen if seen.count(m) > 1})
    if twice:
        raise SystemExit(f"sweep_transformers: {', '.join(twice)} in several of the files to merge")
    meta["seconds"] = seconds
    with open(out, "w") as f:
        json.dump({"meta": meta, "totals": totals(results), "results": results}, f, indent=1, default=str)


_GENERATED_BY = re.compile(r"Generated by `python tools/sweep_transformers.py` \((?P<when>[^;]+); transformers "
                           r"(?P<transformers>[^,]+), torch (?P<torch>[^;]+); (?P<seconds>\d+) s with --jobs "
                           r"(?P<jobs>\d+)\)")
_SPLIT_CELL = re.compile(r"^(?P<word>[\w ]+?)(?: \((?:(?P<k>\d+)/(?P<n>\d+) linears split)?(?:, )?"
                         r"(?:held (?P<held>[\d.]+))?\))?$")


def _cells(line: str) -> list[str]:
    """The cells of one generated table row (``_cell`` escapes '|' as '\\|')."""
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [c.strip().replace("\\|", "|") for c in cells]


def results_from_section(section: str) -> tuple[list[dict], dict]:
    """Results and meta read back from a rendered 'transformers-sweep' section (``render``): what
    its rows say, enough for ``render`` to write the same section again (reasons as long as their
    cells kept them). For a document whose sweep's --json was not kept."""
    found = _GENERATED_BY.search(section)
    if not found:
        raise SystemExit("sweep_transformers: no 'Generated by' line in the section to update")
    meta = dict(found.groupdict(), seconds=float(found["seconds"]), jobs=int(found["jobs"]),
                columns=list(DEFAULT_COLUMNS))
    target = re.search(r"shrunk by field name \((.*?)\), (float\d+)", section)
    meta["target"] = target.group(1) if target else "?"
    engine = re.search(r"at tp=4 without \((real gloo processes|simulated ranks), 1 SGD step", section)
    if engine and target:  # the engine the section names, so that writing it again keeps it
        meta["engine"] = f"{engine.group(1)}, {target.group(2)}"
    results, table = [], None
    titles = [title for key, title in COLUMNS if key in DEFAULT_COLUMNS]
    for line in section.splitlines():
        if line.startswith("### "):
            table = line[4:]
            continue
        if not line.startswith("| ") or line.startswith(("| ---", "| family ", "| model type ")):
            continue
        cells = _cells(line)
        if table == "Not run":
            results.append({"model_type": cells[0], "class": cells[1], "not_run": cells[2]})
            continue
        if table != "All families":
            continue
        model_type, cls, attn, notes, single, *words, reason = cells
        r = {"model_type": model_type, "class": cls, "notes": notes.split("; ") if notes else [],
             "build": {"status": "ok", "attn": attn}}
        reasons = reason.split(" / ") if reason else []
        if single == "build fails":
            r["build"] = {"status": "fail", "reason": reason}
        elif single == "trains":
            r["single"] = {"status": "ok"}
        elif single == "fails":
            r["single"] = {"status": "fail", "reason": reason}
        else:
            raise SystemExit(f"sweep_transformers: cannot read back the row of {model_type} ({single!r} on one device)")
        for (key, title), cell in zip([(k, t) for k, t in COLUMNS if k in DEFAULT_COLUMNS], words):
            split = _SPLIT_CELL.match(cell)
            if not cell or not split:
                continue
            word = split["word"]
            if word == "wrong":  # the failing rows are not in the table
                raise SystemExit(f"sweep_transformers: cannot read back the wrong row of {model_type}")
            why = next((x.split(": ", 1)[1] for x in reasons if x.startswith(("both: ", f"{title}: "))), "")
            r[key] = {"status": word, "reason": why} if word != "equal" else {"status": "equal"}
            if split["k"]:
                r[key]["linears"] = [int(split["k"]), int(split["n"])]
            if split["held"]:
                r[key]["held_share"] = float(split["held"])
        assert len(words) == len(titles), line
        results.append(r)
    return results, meta


def update_rows(doc: str, path: str) -> None:
    """Replace the rows of the families a --json sweep ran in the section 'transformers-sweep' of
    ``doc`` (read back by ``results_from_section``), keep the others, render the section again
    (totals and reasons recounted) and say in it which rows come from which sweep."""
    text = open(doc).read()
    begin, end = BEGIN.format("transformers-sweep"), END.format("transformers-sweep")
    if begin not in text:
        raise SystemExit(f"sweep_transformers: {doc} has no section 'transformers-sweep' to update")
    section = text.split(begin, 1)[1].split(end, 1)[0]
    # one sentence per update says where its rows come from; earlier ones are kept
    earlier = re.findall(r"Rows of \d+ families \(.*?\) are from a later run \(.*?\); the totals count every row below\.",
                         section)
    old, old_meta = results_from_section(section)
    with open(path) as f:
        saved = json.load(f)
    new = {r["model_type"]: r for r in saved["results"]}
    results = [new.pop(r["model_type"], r) for r in old] + list(new.values())
    fresh, m = sorted(r["model_type"] for r in saved["results"]), saved["meta"]
    engine = f"; on {m['engine']}" if m.get("engine") and "processes" in m["engine"] else ""
    meta = dict(old_meta, updated=" ".join([*earlier, (
        f"Rows of {len(fresh)} families ({', '.join(fresh)}) are from a later run (`--only … --json`, "
        f"`--update-rows`: {m['when']}; transformers {m['transformers']}, torch {m['torch']}; {m['seconds']:.0f} s "
        f"with --jobs {m['jobs']}{engine}; same shrink and columns); the totals count every row below.")]))
    write_section(doc, "transformers-sweep", render(results, meta))


def write_section(path: str, name: str, body: str) -> None:
    """Replace the section ``name`` of the document at ``path`` (created if missing), keeping the rest."""
    begin, end = BEGIN.format(name), END.format(name)
    text = open(path).read() if os.path.exists(path) else DOC_HEADER
    block = f"{begin}\n{body}{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def sweep(entries: list[dict], *, jobs: int, timeout: float, progress=None, script: str = __file__,
          worker_args: tuple = ()) -> list[dict]:
    """Run every entry's worker (``script --worker NAME``) in its own subprocess, ``jobs`` at a time."""
    results: dict[int, dict] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_family, e, timeout, script, worker_args): i for i, e in enumerate(entries)}
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            results[i] = future.result()
            if progress:
                progress(results[i], len(results), len(entries))
    return [results[i] for i in range(len(entries))]


def print_progress(result: dict, done: int, total: int) -> None:
    single = single_outcome(result)[0]
    cols = " ".join(f"{key}={outcome(result, key)[0]}" for key, _ in COLUMNS if outcome(result, key)[0])
    print(f"[{done:3d}/{total}] {result['model_type']:28s} {result.get('seconds', 0):6.1f}s {single:12s} {cols}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="these model types only")
    parser.add_argument("--limit", type=int, help="the first N model types (after --only)")
    parser.add_argument("--jobs", type=int, default=1, help="families run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per family (default 180)")
    parser.add_argument("--out", default=None, help="markdown file whose generated section is replaced "
                        "(default docs/supported_models.md when the whole sweep runs, none otherwise)")
    parser.add_argument("--json", help="write every result (and the totals) here")
    parser.add_argument("--hidden", type=int, default=Target.hidden)
    parser.add_argument("--heads", type=int, default=Target.heads)
    parser.add_argument("--kv-heads", type=int, default=Target.kv_heads)
    parser.add_argument("--render-from", metavar="JSON", help="no run: write --out (default "
                        "docs/supported_models.md) from a --json file of an earlier sweep")
    parser.add_argument("--processes", action="store_true", help="verify on real gloo processes (as users run) "
                        "instead of simulated ranks")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="the models' dtype")
    parser.add_argument("--columns", nargs="+", default=list(DEFAULT_COLUMNS), choices=[k for k, _ in COLUMNS],
                        help=f"which layouts to verify (default {' '.join(DEFAULT_COLUMNS)}); pp2 (tp=1, pp=2), "
                        "recompute (tp=2+SP, recompute='selective') and budget (recompute=0.5), both compiled by "
                        "inductor, always run on real gloo processes")
    parser.add_argument("--render-layouts", nargs="+", metavar="JSON", help="no run: write the section "
                        "'transformers-layouts' of --out (default docs/supported_models.md) from --json files of "
                        "earlier sweeps (one table column per file and verified column)")
    parser.add_argument("--merge-json", nargs="+", metavar=("OUT", "JSON"), help="no run: write OUT, one --json "
                        "file of the results of several (sweeps of the same columns, one family each, e.g.), "
                        "their seconds summed")
    parser.add_argument("--update-rows", metavar="JSON", help="no run: in --out (default docs/supported_models.md), "
                        "replace the rows of the families a --json sweep (--only ...) ran, keep the other rows, "
                        "recount the totals (for a document whose full sweep's --json was not kept)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.merge_json:
        merge_json(args.merge_json[0], args.merge_json[1:])
        return 0
    target = Target(hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads)
    engine = Engine(processes=args.processes, dtype=args.dtype, columns=tuple(args.columns))
    if args.worker:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        worker(args.worker, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[args.worker], target, args.result, engine)
        return 0
    if args.render_layouts:
        runs = []
        for path in args.render_layouts:
            with open(path) as f:
                saved = json.load(f)
            runs += [{"key": key, "results": saved["results"], "meta": saved["meta"]}
                     for key in saved["meta"].get("columns", DEFAULT_COLUMNS)]
        write_section(args.out or DOC, "transformers-layouts", render_layouts(runs))
        print(f"wrote {args.out or DOC}")
        return 0
    if args.update_rows:
        update_rows(args.out or DOC, args.update_rows)
        print(f"wrote {args.out or DOC}")
        return 0
    if args.render_from:
        with open(args.render_from) as f:
            saved = json.load(f)
        write_section(args.out or DOC, "transformers-sweep", render(saved["results"], saved["meta"]))
        print(f"wrote {args.out or DOC}")
        return 0
    entries = families(args.only)
    if args.limit:
        entries = entries[: args.limit]
    start = time.monotonic()
    results = sweep(entries, jobs=args.jobs, timeout=args.timeout, progress=print_progress,
                    worker_args=tuple(target_args(target) + engine.args()))
    seconds = time.monotonic() - start
    import torch
    import transformers

    meta = {"when": time.strftime("%Y-%m-%d"), "transformers": transformers.__version__, "engine": engine.describe(),
            "columns": list(engine.columns),
            "torch": torch.__version__.split("+")[0], "seconds": seconds, "jobs": args.jobs,
            "target": f"{target.layers} layers, hidden {target.hidden}, {target.heads} heads of "
                      f"{target.head_dim}, {target.kv_heads} K/V heads, MLP {target.intermediate}, "
                      f"{target.experts} experts top-{target.experts_per_token} of {target.moe_intermediate}, "
                      f"vocab {target.vocab}, {target.positions} positions, windows {target.window}"}
    t = totals(results)
    print(json.dumps({k: v for k, v in t.items() if not k.endswith("_reasons")}), flush=True)
    print(f"sweep took {seconds:.0f} s", flush=True)
    out = args.out or (DOC if not args.only and not args.limit else None)
    if out:
        write_section(out, "transformers-sweep", render(results, meta))
        print(f"wrote {out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "totals": t, "results": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
