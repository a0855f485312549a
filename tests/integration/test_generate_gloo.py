"""Real 2-rank gloo: ``pm.generate`` gives HF ``generate``'s tokens (single device, float64, with its KV
cache) for GPT-2 and Llama (GQA: 4 K/V heads for 8 heads): greedy, sampling from the same seed, and a
batch of 2 with a left-padded attention mask; for Qwen2 (GQA, q/k/v biases): greedy. With the KV cache
split by heads (prefill under sequence parallelism: the prompt is a multiple of tp), and for GPT-2
also without a cache."""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from simulate import spawn_with_deadline

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

PROMPT, NEW = 6, 6  # padded length 12: a multiple of tp=2, so no rounding past it


def hf_model(kind: str):
    torch.manual_seed(0)
    T = transformers
    if kind == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=64, n_head=8, vocab_size=101, n_positions=64))
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(
            num_hidden_layers=1, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=96,
            vocab_size=101, max_position_embeddings=64))
    return T.Qwen2ForCausalLM(T.Qwen2Config(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
        vocab_size=101, max_position_embeddings=64))


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for kind in ("gpt2", "llama", "qwen2"):
            _generate_like_single_device(kind, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _generate_like_single_device(kind: str, world: int) -> None:
    import sptransform

    model = hf_model(kind).double().eval()
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    ids = torch.randint(1, 101, (2, PROMPT))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 is a 3-token prompt, left-padded
    padded = ids.masked_fill(mask == 0, 0)
    positions = torch.arange(PROMPT + NEW).expand(2, -1)
    pm = sptransform.parallelize(model, tp=world, example_inputs=((padded.repeat(1, 2),), dict(position_ids=positions)))
    cases = [("greedy", ids, dict()), ("sampling", ids, dict(do_sample=True, temperature=0.8, top_k=20)),
             ("left padding", padded, dict(attention_mask=mask))]
    if kind == "qwen2":  # the third family: greedy only (each mask signature is one more capture, ~8 s of CPU)
        cases = cases[:1]
    if kind == "gpt2":  # the loop without a cache, once: every step the whole padded sequence
        cases.append(("no cache", ids, dict(use_cache=False)))
    for name, prompt, kwargs in cases:
        torch.manual_seed(5)
        expected = ref.generate(prompt, max_new_tokens=NEW, pad_token_id=0, **kwargs)
        torch.manual_seed(5)
        tokens = pm.generate(prompt, max_new_tokens=NEW, pad_token_id=0, **kwargs)
        assert torch.equal(tokens, expected), f"{kind} {name}: {tokens.tolist()} != {expected.tolist()}"
    # With the cache: one prefill and one decode graph for every case (the mask is always given to
    # them), each rank given and returning only its K/V heads; without it, the padded forward, whose
    # signature is the example's.
    assert pm.cached_graphs == 1
    steps = {key[0]: cached.graph for key, cached in pm._entry_graphs.items()}
    assert sorted(steps) == ["kv-decode", "kv-prefill"]
    heads = 8 if kind == "gpt2" else 4 if kind == "llama" else 2
    decode = steps["kv-decode"].plan
    assert [spec.dim for spec in decode.input_specs.values()] == [1, 1] and len(decode.input_specs) == 2
    assert all(decode.output_specs[i][0].dim == 1 and decode.output_specs[i][1] == heads for i in (1, 2))
    assert "gather" not in steps["kv-decode"].gm.code  # no collective moves the cache (or the logits, split)


def test_generate_equals_single_device_hf_generate_on_two_gloo_ranks():
    spawn_with_deadline(_worker, 2, 600.0)
