"""HF GPT-2 (eager and SDPA attention) and HF Llama (RMSNorm, RoPE, SwiGLU, GQA,
untied head) train like the originals on simulated ranks, dropout included."""

from __future__ import annotations

import pytest
import torch

from simulate import simulated_ranks, train_side_by_side

transformers = pytest.importorskip("transformers")


def gpt2(attn: str, dropout: float):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=8, vocab_size=101, n_positions=64, attn_implementation=attn,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout if attn == "eager" else 0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def llama(attn: str):
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=96, vocab_size=101, max_position_embeddings=64, attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(config)


def _inputs():
    ids = torch.randint(0, 101, (2, 16))
    return dict(input_ids=ids, labels=torch.randint(0, 101, (2, 16)), use_cache=False)


def _call(kwargs):
    return lambda m: m(**kwargs)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("tp,sp", [(2, True), (4, True), (2, False)])
def test_gpt2_trains_like_single_device(attn, tp, sp):
    kwargs = _inputs()
    train_side_by_side(lambda: gpt2(attn, 0.1).train(), kwargs, tp=tp, sp=sp, call=_call(kwargs))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("tp,sp", [(2, True), (4, True), (4, False)])
def test_llama_trains_like_single_device(attn, tp, sp):
    kwargs = _inputs()
    train_side_by_side(lambda: llama(attn).train(), kwargs, tp=tp, sp=sp, call=_call(kwargs))


def test_logits_are_a_vocab_sharded_dtensor_equal_to_the_original():
    from torch.distributed.tensor import DTensor, Shard

    import sptransform
    from simulate import assert_all_ranks_close

    kwargs = _inputs()
    torch.manual_seed(0)
    model = gpt2("eager", 0.0)
    expected = model(**kwargs).logits.detach()
    with simulated_ranks(4):
        out = sptransform.parallelize(model, tp=4, example_inputs=kwargs)(**kwargs)
        assert isinstance(out.logits, DTensor) and out.logits.placements == (Shard(2),)
        assert out.logits.shape == expected.shape
        assert_all_ranks_close(out.logits, expected)
        assert not isinstance(out.loss, DTensor)
