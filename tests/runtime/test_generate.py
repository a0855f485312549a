"""Generation (``runtime.generate``): the tokens of ``pm.generate`` / ``sptransform.generate`` are
the single-device model's, HF's semantics (greedy, sampling, left padding) are HF ``generate``'s,
and what the no-cache loop cannot do raises. Real ranks: tests/integration/test_generate_gloo.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import sptransform
from simulate import per_rank, simulated_ranks
from sptransform.runtime.generate import resolve_options
from tiny_models import TinyConfig, TinyLM

transformers = pytest.importorskip("transformers")

CONFIG = TinyConfig(vocab=61, hidden=32, heads=4, kv_heads=2, layers=1, ffn=64, max_len=32, tied=False)


class LogitsLM(TinyLM):
    """TinyLM without a loss: forward(ids) -> logits [batch, length, vocab], as a plain LM returns them."""

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class BidirectionalLM(LogitsLM):
    """Every position reads the mean of all positions: not a causal LM."""

    def forward(self, ids):
        logits = super().forward(ids)
        return logits + logits.mean(dim=1, keepdim=True)


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=61, n_positions=32)
    return transformers.GPT2LMHeadModel(config).double().eval()


def _prompt(batch=2, length=5):
    torch.manual_seed(1)
    return torch.randint(1, 61, (batch, length))


@settings(max_examples=4, deadline=None, derandomize=True)
@given(do_sample=st.booleans(), temperature=st.sampled_from([None, 0.7]), top_k=st.sampled_from([None, 0, 5]),
       top_p=st.sampled_from([None, 0.8]), left_pad=st.booleans())
def test_single_device_generate_equals_hf_generate_for_any_decoding(do_sample, temperature, top_k, top_p, left_pad):
    model, ids = _gpt2(), _prompt()
    kwargs = dict(max_new_tokens=4, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                  pad_token_id=0)
    if left_pad:
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        ids, kwargs["attention_mask"] = ids.masked_fill(mask == 0, 0), mask
    torch.manual_seed(7)
    expected = model.generate(ids, **kwargs)
    torch.manual_seed(7)
    assert torch.equal(sptransform.generate(model, ids, **kwargs), expected)


def test_tp2_greedy_tokens_equal_single_device_on_simulated_ranks():
    torch.manual_seed(0)
    model = LogitsLM(CONFIG).double().eval()
    ids = _prompt(length=3)
    expected = sptransform.generate(model, ids, max_new_tokens=3)
    assert expected.shape == (2, 6)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=(torch.zeros(2, 6, dtype=torch.long),))
        tokens = pm.generate(ids, max_new_tokens=3)
        assert pm.cached_graphs == 1  # every step pads to one length: one signature, no recapture
    for rank, value in enumerate(per_rank(tokens)):
        assert torch.equal(value, expected), f"rank {rank}: {value.tolist()} != {expected.tolist()}"


def test_generate_refuses_a_model_that_reads_later_positions():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="causal"):
        sptransform.generate(BidirectionalLM(CONFIG).eval(), _prompt(), max_new_tokens=2)


def test_generate_refuses_what_it_does_not_implement():
    model, ids = LogitsLM(CONFIG).eval(), _prompt()
    with pytest.raises(TypeError, match=r"unsupported keyword\(s\) \['num_beams'\]"):
        sptransform.generate(model, ids, max_new_tokens=2, num_beams=2)
    with pytest.raises(TypeError, match="needs max_new_tokens="):
        sptransform.generate(model, ids)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be at least 1"):
        sptransform.generate(model, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        sptransform.generate(model, ids, max_new_tokens=2, attention_mask=torch.ones_like(ids))
    with pytest.raises(ValueError, match=r"integer tensor \[batch, length\]"):
        sptransform.generate(model, ids[0], max_new_tokens=2)
    gpt2 = _gpt2()
    with pytest.raises(ValueError, match=r"generation_config.num_beams=3 is not supported"):
        sptransform.generate(gpt2, ids, generation_config=transformers.GenerationConfig(num_beams=3))


def test_options_follow_hf_generation_config_then_hf_defaults():
    gpt2 = _gpt2()  # its generation_config sets eos (50256) and leaves sampling unset
    options = resolve_options(gpt2, dict(do_sample=True), prompt_length=5)
    assert (options.max_new_tokens, options.top_k, options.top_p, options.temperature) == (15, 50, 1.0, 1.0)
    assert options.eos_token_id == (50256,) and options.pad_token_id == 50256
    plain = resolve_options(LogitsLM(CONFIG), dict(max_new_tokens=3, eos_token_id=[4, 5]), prompt_length=5)
    assert plain.top_k is None and plain.eos_token_id == (4, 5) and plain.pad_token_id == 4


def test_hf_generate_through_the_original_class_names_pm_generate():
    model, ids = _gpt2(), _prompt(length=4)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=(ids,))
        for call in (lambda: type(model).generate(pm, ids, max_new_tokens=2),
                     lambda: transformers.GenerationMixin.generate(pm, ids, max_new_tokens=2)):
            with pytest.raises(TypeError, match=r"GPT2LMHeadModel.generate\(pm, \.\.\.\).*use|pm\.generate\(ids"):
                call()
        assert not hasattr(pm, "generation_config")  # still an AttributeError for hasattr
        with pytest.raises(AttributeError, match="no attribute 'not_a_thing'$"):
            pm.not_a_thing


class CachePositionsGPT2(transformers.GPT2LMHeadModel):
    """GPT-2 that drops ``position_ids`` and takes its positions from the cache's length (as models
    whose rotary embeddings read ``cache_position`` do): the fixed-slot cache gives it wrong
    positions, which the check before the first token must catch."""

    def forward(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, encoder_hidden_states=None, encoder_attention_mask=None, labels=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        return super().forward(input_ids, cache=cache, attention_mask=attention_mask, use_cache=use_cache, **kwargs)


def _llama(kv_heads: int):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=kv_heads, intermediate_size=64, vocab_size=61,
                                      max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config).double().eval()


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_kv_cache_is_split_by_heads_and_greedy_tokens_equal_hf(kv_heads, caplog):
    """tp=2 on simulated ranks (real ranks: tests/integration/test_generate_gloo.py): each rank holds
    its K/V heads, or, with one K/V head that tp cannot split, the whole cache."""
    model, ids = _llama(kv_heads), _prompt(length=6)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with simulated_ranks(2), caplog.at_level("INFO", logger="sptransform.generate"):
        pm = sptransform.parallelize(model, tp=2, example_inputs=(ids,))
        tokens = pm.generate(ids, max_new_tokens=4, pad_token_id=0)
        steps = {key[0]: cached.graph for key, cached in pm._entry_graphs.items()}
    for value in per_rank(tokens):
        assert torch.equal(value, expected), f"{value.tolist()} != {expected.tolist()}"
    assert sorted(steps) == ["kv-decode", "kv-prefill"] and pm.cached_graphs == 1  # no padded forward ran
    split = steps["kv-decode"].plan.input_specs
    assert len(split) == (4 if kv_heads == 2 else 0)  # 2 layers x (keys, values)
    share = 0.5 if kv_heads == 2 else 1.0
    assert f"this rank holds {share:.3f} of its" in caplog.text


def test_a_model_whose_positions_follow_the_cache_length_falls_back_to_no_cache(caplog):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=61, n_positions=32)
    model, ids = CachePositionsGPT2(config).double().eval(), _prompt(length=6)
    expected = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with simulated_ranks(2), caplog.at_level("WARNING", logger="sptransform.generate"):
        pm = sptransform.parallelize(model, tp=2, example_inputs=(ids,))
        tokens = pm.generate(ids, max_new_tokens=3, pad_token_id=0)
    assert "falls back to no KV cache" in caplog.text and "relative error" in caplog.text
    for value in per_rank(tokens):
        assert torch.equal(value, expected)
