"""The planner's activation bytes per layer agree with the bytes measured on the
partitioned graph (fake tensors, one rank) within 2%: for the GPT-family and
Llama-family presets, for shape variants that move what keeps Q, K and V alive,
and for HF's own Llama traced through sptransform's tensor/sequence-parallel pipeline."""

from __future__ import annotations

import pytest
import torch

from sptransform.measure.layer import measure_shape
from sptransform.measure.parallel import fake_process_group, rank_graph
from sptransform.measure.partitioned import partition_module
from sptransform.passes.remat import RematOptions
from sptransform.planner.activations import activation_bytes_per_layer
from sptransform.planner.presets import PRESETS, shape_from_hf_dict

POLICIES = ["none", "selective", "full"]
CASES = [
    ("gpt2", 1, False, 512),
    ("gpt2-medium", 1, False, 512),
    ("gpt-22b", 8, True, 2048),
    ("gpt-175b", 8, False, 2048),
    ("llama-7b", 1, False, 512),
    ("llama3-8b", 8, True, 1024),
]

_LLAMA3 = PRESETS["llama3-8b"]
VARIANTS = {
    # RoPE rotates copies of Q and K, but V stays a view of the fused output: all of it stays alive
    "fused-qkv-rope-gqa": _LLAMA3.with_(qkv_projection="fused"),
    # explicit attention repeats grouped K and V to all heads (new tensors), with dropout
    "explicit-gqa-rope": _LLAMA3.with_(attention="explicit", dropout=0.1),
    # repeated K and V, and Q a view of the fused projection output
    "explicit-gqa-fused-learned": _LLAMA3.with_(attention="explicit", position="learned",
                                                qkv_projection="fused", seq_len=512),
}


def _options(policy):
    # "full" re-runs the layer's collectives in backward, as the planner (and Megatron) assume
    return RematOptions(policy=policy, recompute_collectives=policy == "full", recompute_fusible=False)


def _planned(shape, *, tp, sp, policy, seq):
    return activation_bytes_per_layer(shape, tp=tp, sp=sp, recompute=policy, micro_batch=1, seq_len=seq,
                                      include_norm_statistics=True)


@pytest.mark.parametrize("name,tp,sp,seq", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("policy", POLICIES)
def test_planner_activation_bytes_match_the_graph(name, tp, sp, seq, policy):
    shape = PRESETS[name]
    measured = measure_shape(shape, options=_options(policy), seq=seq, tp=tp, sp=sp).layer_bytes()
    assert _planned(shape, tp=tp, sp=sp, policy=policy, seq=seq) == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("policy", POLICIES)
def test_planner_follows_how_q_k_v_are_kept(variant, policy):
    shape = VARIANTS[variant]
    measured = measure_shape(shape, options=_options(policy), seq=256).layer_bytes()
    assert _planned(shape, tp=1, sp=False, policy=policy, seq=256) == pytest.approx(measured, rel=0.02)


class _LossOnly(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


@pytest.mark.slow
@pytest.mark.in_process  # no spawned ranks: runs beside the process tests
def test_planner_matches_hf_llama_traced_tensor_and_sequence_parallel():
    """HF's LlamaForCausalLM (its RMSNorm, rotary embedding, SDPA attention), bf16, tp=2 with
    SP, one rank's graph from sptransform's own pipeline: the planner's bytes for the shape
    read from its config equal the graph's per layer, exactly."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=1376, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=2, vocab_size=1000, max_position_embeddings=512, use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = _LossOnly(transformers.LlamaForCausalLM(config)).to(torch.bfloat16)
    seq = 256
    tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
    shape = shape_from_hf_dict({**config.to_dict(), "_attn_implementation": "sdpa"})
    with fake_process_group(2):
        graph = rank_graph(model, (tokens, tokens), tp=2, sp=True)
        memories = {policy: partition_module(graph.gm, graph.inputs, options=_options(policy),
                                             state_inputs=graph.state_inputs).memory() for policy in POLICIES}
    for policy, memory in memories.items():
        assert memory.num_layers == 2
        measured = sum(memory.per_layer().values())
        assert _planned(shape, tp=2, sp=True, policy=policy, seq=seq) == pytest.approx(measured, rel=1e-6), policy
