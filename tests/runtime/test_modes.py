"""train()/eval() act on the parallel module as on the original: dropout acts exactly when the
module (or the submodule holding the dropout) is training, whatever mode it was built in.

Masks are compared bit for bit with ``dropout_rng="reference"`` (the parallel masks equal the
single-device ones for the same seed), so "train mode" is checked against the original's own
train-mode loss, not only "differs from eval"."""

from __future__ import annotations

import copy

import pytest
import torch

import sptransform
from simulate import assert_all_ranks_close, per_rank, simulated_ranks
from sptransform.torch_internals import maybe_disable_local_tensor_mode

transformers = pytest.importorskip("transformers")


def _gpt2(training: bool):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=61, n_positions=64,
                                     attn_implementation="eager", resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    return transformers.GPT2LMHeadModel(config).train(training)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 61, (2, 16), generator=g)
    return dict(input_ids=ids, labels=torch.randint(0, 61, (2, 16), generator=g))


def _loss(model, batch, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return model(**batch).loss


def _ref_loss(ref, batch, seed=None):
    with maybe_disable_local_tensor_mode():
        return _loss(ref, batch, seed).detach()


def _bits(loss) -> list[int]:
    """Each simulated rank's loss, as its exact float32 bits."""
    return [int(t.detach().view(torch.int32)) for t in per_rank(loss)]


@pytest.mark.parametrize("sp", [True, False])
def test_eval_after_building_in_train_mode_is_the_originals_deterministic_eval(sp):
    model, batch = _gpt2(training=True), _batch()
    ref = copy.deepcopy(model).eval()
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, sp=sp, example_inputs=batch)
        assert pm.training
        pm.eval()
        assert not any(m.training for m in pm.modules())
        first, second = _loss(pm, batch, seed=1), _loss(pm, batch, seed=2)
        assert _bits(first) == _bits(second)  # no mask drawn: the seed does not matter
        assert_all_ranks_close(first, _ref_loss(ref, batch), rtol=1e-6, atol=0, what="eval loss")


@pytest.mark.parametrize("sp", [True, False])
def test_train_after_building_in_eval_mode_draws_the_originals_masks(sp):
    model, batch = _gpt2(training=False), _batch()
    ref = copy.deepcopy(model)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, sp=sp, example_inputs=batch, dropout_rng="reference")
        eval_loss = _loss(pm, batch)
        pm.train()
        ref.train()
        for seed in (3, 4):
            assert_all_ranks_close(_loss(pm, batch, seed), _ref_loss(ref, batch, seed), rtol=1e-5, atol=1e-6,
                                   what=f"train loss, seed {seed}")
        assert _bits(_loss(pm, batch, 3)) != _bits(_loss(pm, batch, 4))  # masks change with the seed
        assert _bits(_loss(pm, batch, 3)) != _bits(eval_loss)


def test_switching_back_and_forth_keeps_one_graph_per_mode():
    model, batch = _gpt2(training=True), _batch()
    ref = copy.deepcopy(model)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=batch, dropout_rng="reference")
        for training in (True, False, True, False):
            pm.train(training)
            ref.train(training)
            assert_all_ranks_close(_loss(pm, batch, 7), _ref_loss(ref, batch, 7), rtol=1e-5, atol=1e-6,
                                   what=f"training={training}")
        assert pm.cached_graphs == 2


def test_independent_masks_also_follow_the_mode():
    model, batch = _gpt2(training=False), _batch()
    ref = copy.deepcopy(model)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=batch)  # dropout_rng="independent"
        eval_bits = _bits(_loss(pm, batch))
        assert_all_ranks_close(_loss(pm, batch), _ref_loss(ref, batch), rtol=1e-6, atol=0, what="eval")
        pm.train()
        train = [_bits(_loss(pm, batch, seed)) for seed in (5, 5)]
        assert train[0] != eval_bits and train[1] != train[0]  # drops out; the rank generators advance
        pm.eval()
        assert _bits(_loss(pm, batch)) == eval_bits


def test_a_submodule_switched_to_eval_is_captured_in_eval_mode():
    """Only layer 0 in eval mode: its dropouts are off, the others' on, as in the original."""
    model, batch = _gpt2(training=True), _batch()
    ref = copy.deepcopy(model)
    ref.transformer.h[0].eval()
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=batch, dropout_rng="reference")
        assert [n for n, _ in pm.named_modules()] == [n for n, _ in model.named_modules()]  # the tree is mirrored
        pm.transformer.h[0].eval()
        assert pm.transformer.h[0].attn.attn_dropout.training is False
        assert_all_ranks_close(_loss(pm, batch, 9), _ref_loss(ref, batch, 9), rtol=1e-5, atol=1e-6, what="mixed modes")


def test_a_model_built_with_mixed_modes_keeps_them():
    model, batch = _gpt2(training=True), _batch()
    model.transformer.h[1].eval()
    ref = copy.deepcopy(model)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=batch, dropout_rng="reference")
        assert pm.training and not pm.transformer.h[1].training and pm.transformer.h[0].training
        assert_all_ranks_close(_loss(pm, batch, 11), _ref_loss(ref, batch, 11), rtol=1e-5, atol=1e-6, what="mixed")


def test_stepped_module_follows_the_mode_and_accumulates_microbatches():
    """pp=1 with n_microbatches: step() in eval mode gives the original's eval loss and gradients
    (the gpipe order is checked at tp=1 in tests/test_api_errors.py)."""
    model, batch = _gpt2(training=True), _batch()
    ref = copy.deepcopy(model).eval()
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=batch, n_microbatches=2)
        pm.eval()
        loss = pm.step(**batch)
        assert_all_ranks_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6, what="step loss")
        for name, p in pm.named_parameters():
            assert_all_ranks_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-5, what=f"grad of {name}")
        pm.zero_grad()
        pm.train()
        train_loss = pm.step(**batch)
        assert _bits(train_loss) != _bits(loss)
