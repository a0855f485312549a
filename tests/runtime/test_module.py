"""The parallel module is a drop-in: same names, inputs and outputs; new shapes are
captured again without moving parameters; meta models materialize only shards."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

import sptransform
from simulate import assert_all_ranks_close, per_rank, simulated_ranks
from tiny_models import TinyConfig, TinyLM

CONFIG = TinyConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=50)


def _data(batch=2, seq=8):
    return torch.randint(0, 50, (batch, seq)), torch.randint(0, 50, (batch, seq))


def test_parameter_names_state_dict_keys_and_global_shapes_are_the_originals():
    torch.manual_seed(0)
    model = TinyLM(CONFIG)
    with simulated_ranks(2):
        pm = sptransform.parallelize(copy.deepcopy(model), tp=2, example_inputs=_data())
        assert [n for n, _ in pm.named_parameters()] == [n for n, _ in model.named_parameters()]
        assert list(pm.state_dict()) == list(model.state_dict())
        for (name, p), (_, q) in zip(pm.named_parameters(), model.named_parameters()):
            assert isinstance(p, DTensor) and p.shape == q.shape, name
            assert_all_ranks_close(p.full_tensor(), q.detach(), what=name)


def test_new_batch_and_sequence_lengths_are_recaptured_with_the_same_placement():
    torch.manual_seed(0)
    model = TinyLM(CONFIG)
    ref = copy.deepcopy(model)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=_data(2, 8))
        placements = {n: p.placements for n, p in pm.named_parameters()}
        for batch, seq in [(3, 4), (1, 16), (2, 8)]:
            ids, targets = _data(batch, seq)
            assert_all_ranks_close(pm(ids, targets), ref(ids, targets).detach(), what=f"{batch}x{seq}")
        assert len(pm._graphs) == 3
        assert {n: p.placements for n, p in pm.named_parameters()} == placements


def test_code_shows_the_collectives_and_explain_lists_regions_placements_and_bytes():
    with simulated_ranks(2):
        pm = sptransform.parallelize(TinyLM(CONFIG), tp=2, example_inputs=_data())
        code, report = pm.code, pm.explain()
    for name in ("gather_seq", "scatter_seq", "sync_grads", "vocab_parallel_cross_entropy"):
        assert name in code
    assert "layer   1 attention" in report and "blocks.1.attn.o.weight" in report
    assert "_StridedShard" not in report and "blocks.0.attn.kv.weight                            S(0, 2 segments)" in report  # fused [k|v]
    assert "per step: 11 all-gather, 3 all-reduce, 10 reduce-scatter" in report  # the loss: one all-gather


def test_example_inputs_default_to_token_ids_from_the_input_embedding():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=60, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()  # no dropout: compare to the plain forward
    ids = torch.randint(0, 60, (2, 16))
    expected = model(ids).logits.detach()
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2)
        assert pm._last.captured.user_placeholders[0].meta["val"].shape == (2, 16)  # [2, 8 * tp]
        out = pm(ids)
        assert_all_ranks_close(out.logits, expected, what="logits")


def test_meta_model_materializes_only_local_shards():
    with torch.device("meta"):
        model = TinyLM(CONFIG)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=_data())
        for name, p in pm.named_parameters():
            local = p.to_local()
            shapes = {tuple(t.shape) for t in per_rank(local)}
            assert all(t.device.type == "cpu" for t in per_rank(local)), name
            if p.placements[0].is_shard():
                assert all(s[p.placements[0].dim] <= -(-p.shape[p.placements[0].dim] // 2) for s in shapes), name
        with torch.no_grad():
            for p in pm.parameters():
                p.to_local().normal_(std=0.02) if p.dim() > 1 else p.to_local().fill_(1.0)
        loss = pm(*_data())
        assert all(torch.isfinite(v) for v in per_rank(loss))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_meta_model_refuses_to_run_until_loaded_then_equals_the_original(tp):
    """Parameters built on meta hold NaN placeholders (the same on every rank, never
    ``torch.empty``'s garbage): the first call names every one not loaded; a partial load names
    only the rest; ``load_state_dict`` of the original's whole tensors (fused K/V included, a
    ``_StridedShard``) gives its loss and gradients."""
    torch.manual_seed(0)
    real = TinyLM(CONFIG)
    with torch.device("meta"):
        model = TinyLM(CONFIG)
    ids, targets = _data()
    with simulated_ranks(tp) if tp > 1 else contextlib.nullcontext():
        pm = sptransform.parallelize(model, tp=tp, example_inputs=_data())
        with pytest.raises(ValueError, match=r"(?s)32 parameter\(s\) were built on the meta device and never given "
                           r"values: 'blocks.0.attn.kv.bias'.* and 24 more.*load_hf_weights"):
            pm(ids, targets)
        partial = {k: v for k, v in real.state_dict().items() if k != "norm.weight"}
        pm.load_state_dict(partial, strict=False)
        with pytest.raises(ValueError, match=r"1 parameter\(s\) .* never given values: 'norm.weight'\. "):
            pm(ids, targets)
        pm.load_state_dict(real.state_dict())
        loss = pm(ids, targets)
        loss.backward()
        expected = real(ids, targets)
        expected.backward()
        if tp > 1:
            assert_all_ranks_close(loss, expected.detach(), what="loss")
        else:
            torch.testing.assert_close(loss, expected)
        for name, p in pm.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            ref = real.get_parameter(name).grad
            if tp > 1:
                assert_all_ranks_close(grad, ref, what=name)
            else:
                torch.testing.assert_close(grad, ref, msg=lambda m, n=name: f"{n}: {m}")


def test_tp_one_without_a_process_group_runs_the_captured_graph():
    torch.manual_seed(0)
    model = TinyLM(CONFIG)
    ref = copy.deepcopy(model)
    pm = sptransform.parallelize(model, tp=1, example_inputs=_data())
    ids, targets = _data()
    torch.testing.assert_close(pm(ids, targets), ref(ids, targets))
