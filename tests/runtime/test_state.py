"""What a parallel module holds: its generators (checkpointable, freed with it), a bounded graph
cache, and parameters whose dtype may change after parallelize."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import sptransform
from simulate import assert_all_ranks_close, per_rank, simulated_ranks
from sptransform.torch_internals import maybe_disable_local_tensor_mode
from tiny_models import TinyConfig, TinyLM

transformers = pytest.importorskip("transformers")


def _gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=61, n_positions=64,
                                     attn_implementation="eager", resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
    return transformers.GPT2LMHeadModel(config).train()


def _batches(n, seq=16):
    g = torch.Generator().manual_seed(7)
    with maybe_disable_local_tensor_mode():
        return [dict(input_ids=torch.randint(0, 61, (2, seq), generator=g),
                     labels=torch.randint(0, 61, (2, seq), generator=g)) for _ in range(n)]


def _train(pm, batches, lr=0.1):
    """SGD steps (no optimizer state); each step's loss as exact bits per simulated rank."""
    losses = []
    for batch in batches:
        loss = pm(**batch).loss
        loss.backward()
        with torch.no_grad():
            for p in pm.parameters():
                p -= lr * p.grad
                p.grad = None
        losses.append([int(t.view(torch.int32)) for t in per_rank(loss.detach())])
    return losses


def _snapshot(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def _bits(pm) -> dict:
    return {n: [t.clone() for t in per_rank(p.full_tensor())] for n, p in pm.named_parameters()}


def test_rng_state_resumes_bit_for_bit_in_a_module_built_with_another_seed():
    """Train a step, save model + rng, train 2; a fresh module (other weights, other seed) that loads
    both trains the same 2 steps to the same bits. Simulated ranks: each keeps its generator. (The
    3 + 2 steps across processes, with DCP, are in tests/integration/test_faults_gloo.py.)"""
    batches = _batches(3)
    with simulated_ranks(2):
        pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=batches[0], seed=5)
        _train(pm, batches[:1])
        saved_model, saved_rng = _snapshot(pm.state_dict()), _snapshot(pm.rng.state_dict())
        assert set(saved_rng) == {"dropout", "default"} and saved_rng["dropout"].shape[0] == 2
        rows = per_rank(saved_rng["dropout"].full_tensor())[0]
        assert not torch.equal(rows[0], rows[1])  # each simulated rank has its own generator
        expected_losses, expected_params = _train(pm, batches[1:]), _bits(pm)

        other = sptransform.parallelize(_gpt2(seed=1), tp=2, example_inputs=batches[0], seed=99)
        other.load_state_dict(saved_model)
        other.rng.load_state_dict(saved_rng)
        assert _train(other, batches[1:]) == expected_losses
        got = _bits(other)
        for name, values in expected_params.items():
            assert all(torch.equal(a, b) for a, b in zip(values, got[name])), name

        unloaded = sptransform.parallelize(_gpt2(seed=1), tp=2, example_inputs=batches[0], seed=99)
        unloaded.load_state_dict(saved_model)
        assert _train(unloaded, batches[1:]) != expected_losses  # the generators are what made it exact


def test_rng_state_dict_rejects_a_foreign_state():
    with simulated_ranks(2):
        pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=_batches(1)[0])
        with pytest.raises(ValueError, match=r"lacks \['default'\]"):
            pm.rng.load_state_dict({"dropout": pm.rng.state_dict()["dropout"]})


def test_generators_are_freed_with_their_module():
    with simulated_ranks(2):
        for _ in range(2):
            pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=_batches(1)[0])
            pm(**_batches(1)[0])  # dropout drew from the generators
            generators = weakref.ref(pm.rng._generators)
            del pm
            gc.collect()
            assert generators() is None


def test_graph_cache_keeps_the_most_recently_used_signatures():
    torch.manual_seed(0)
    model = TinyLM(TinyConfig())
    built = []
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=_tiny(8), graph_cache_size=2)
        build = pm._factory.build

        def counting(args, kwargs, **kw):
            built.append(tuple(args[0].shape))
            return build(args, kwargs, **kw)

        pm._factory.build = counting
        for seq in (8, 16, 8, 24, 8, 16):
            pm(*_tiny(seq))
            assert pm.cached_graphs <= 2
    # 8 is cached; 16 built; 8 hit; 24 built (evicts 16, the least recently used); 8 hit; 16 built again
    assert built == [(2, 16), (2, 24), (2, 16)]


def _tiny(seq):
    with maybe_disable_local_tensor_mode():
        g = torch.Generator().manual_seed(seq)
        return torch.randint(0, 61, (2, seq), generator=g), torch.randint(0, 61, (2, seq), generator=g)


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.float64), lambda m: m.double()], ids=["to", "double"])
def test_to_float64_then_training_equals_the_original_converted_alike(convert):
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(layers=2))
    ref = convert(copy.deepcopy(model))
    # eps 1e-4: a key bias gets a ~1e-9 gradient that eps=1e-8 would turn into a +-lr step of random sign
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    data = [_tiny(16) for _ in range(2)]
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=data[0])
        pm(*data[0])  # a graph captured in float32 exists and must not be reused
        convert(pm)
        assert {p.dtype for p in pm.parameters()} == {torch.float64}
        assert pm.head.weight is pm.tok.weight  # still tied
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-4, foreach=False)
        for step, inputs in enumerate(data):
            loss = pm(*inputs)
            loss.backward()
            with maybe_disable_local_tensor_mode():
                ref_loss = ref(*inputs)
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
            assert all(v.dtype == torch.float64 for v in per_rank(loss))
            assert_all_ranks_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12, what=f"step {step}")
            opt.step()
            opt.zero_grad()
        ref_params = dict(ref.named_parameters())
        for name, p in pm.named_parameters():
            assert_all_ranks_close(p.full_tensor(), ref_params[name].detach(), rtol=1e-10, atol=1e-12, what=name)


def test_to_bfloat16_runs_like_the_original_in_bfloat16():
    torch.manual_seed(0)
    model = TinyLM(TinyConfig())
    ref = copy.deepcopy(model).to(torch.bfloat16)
    inputs = _tiny(16)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=inputs).to(torch.bfloat16)
        loss = pm(*inputs)
        with maybe_disable_local_tensor_mode():
            expected = ref(*inputs).detach()
        assert all(v.dtype == torch.bfloat16 for v in per_rank(loss))
        assert_all_ranks_close(loss.float(), expected.float(), rtol=2e-2, atol=1e-2, what="bf16 loss")


def test_moving_to_another_device_says_what_to_do():
    torch.manual_seed(0)
    with simulated_ranks(2):
        pm = sptransform.parallelize(TinyLM(TinyConfig()), tp=2, example_inputs=_tiny(8))
        pm.to("meta")
        with pytest.raises(ValueError, match=r"is on meta, but this parallel module was built for cpu.*move the "
                                             r"original model first \(model.to\(device\)\) and parallelize it there"):
            pm(*_tiny(8))
