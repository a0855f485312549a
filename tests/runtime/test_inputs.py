"""Bad inputs fail as on one device, with a message, on every rank; unusual ones work or say why.

Table-driven: each row is a call that the single-device model rejects (or that sptransform
cannot run) and the error the parallel module must raise instead of returning a number."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn

import sptransform
from simulate import assert_all_ranks_close, per_rank, simulated_ranks
from sptransform.torch_internals import maybe_disable_local_tensor_mode
from tiny_models import TinyConfig, TinyLM

transformers = pytest.importorskip("transformers")
VOCAB = 61


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     attn_implementation="eager", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _tiny():
    torch.manual_seed(0)
    return TinyLM(TinyConfig(vocab=VOCAB))


def _ids(fill=None, at=(0, 3)):
    g = torch.Generator().manual_seed(2)
    with maybe_disable_local_tensor_mode():  # drawn under LocalTensorMode, each simulated rank would differ
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    if fill is not None:
        ids[at] = fill
    return ids


def _hf(**overrides):
    return lambda: {"input_ids": _ids(), "labels": _ids(), **{k: v() if callable(v) else v for k, v in overrides.items()}}


BAD_CALLS = [
    # (id, model, inputs (kwargs or positional tuple), error, message pattern); the meta, use_cache and
    # past_key_values rows are limits of sptransform (see ORIGINAL_ACCEPTS), the others fail on one device too
    ("gpt2 id = vocab", _gpt2, _hf(input_ids=lambda: _ids(VOCAB)), IndexError,
     r"token id 61 in input 'input_ids' is outside the vocabulary of 61 \(ids must be in \[0, 60\]"),
    ("gpt2 negative id", _gpt2, _hf(input_ids=lambda: _ids(-1)), IndexError, r"token id -1 in input 'input_ids'"),
    ("gpt2 label = vocab", _gpt2, _hf(labels=lambda: _ids(VOCAB)), IndexError,
     r"label 61 in input 'labels' is out of bounds for the vocabulary of 61.*or the ignore index -100"),
    ("gpt2 negative label", _gpt2, _hf(labels=lambda: _ids(-5)), IndexError, r"label -5 in input 'labels'"),
    # inputs the model's own code rejects: said so (not "could not capture ... data-dependent"), naming the input
    ("gpt2 float ids", _gpt2, _hf(input_ids=lambda: _ids().float()), ValueError,
     r"the model raises on these inputs, as it would on one device \(RuntimeError: .*Long.*input 'input_ids' is "
     r"float32 where the example had int64"),
    ("gpt2 float labels", _gpt2, _hf(labels=lambda: _ids().float()), ValueError,
     r"the model raises on these inputs.*input 'labels' is float32 where the example had int64"),
    ("gpt2 1-D ids", _gpt2, lambda: {"input_ids": _ids()[0], "labels": _ids()[0]}, ValueError,
     r"the model raises on these inputs.*input 'input_ids' has 1 dims \[16\] where the example had 2 \[2, 16\]"),
    ("gpt2 labels shaped unlike ids", _gpt2, _hf(labels=lambda: _ids()[:, :8]), ValueError,
     r"the model raises on these inputs.*input 'labels' has shape \[2, 8\] \(example: \[2, 16\]\)"),
    ("gpt2 misspelt keyword", _gpt2, lambda: {"input_idz": _ids(), "labels": _ids()}, ValueError,
     r"the model raises on these inputs.*input 'input_idz' is not among the example inputs.*input 'input_ids' is "
     r"missing"),
    ("gpt2 meta ids", _gpt2, _hf(input_ids=lambda: _ids().to("meta")), ValueError,
     r"input 'input_ids' is a meta tensor .*pass a tensor on the model's device"),
    ("gpt2 meta labels", _gpt2, _hf(labels=lambda: _ids().to("meta")), ValueError, r"input 'labels' is a meta tensor"),
    ("gpt2 use_cache", _gpt2, _hf(use_cache=True), ValueError, r"use_cache=True.*pass use_cache=False"),
    ("gpt2 past_key_values", _gpt2, _hf(past_key_values=lambda: transformers.DynamicCache()), ValueError,
     r"past_key_values"),
    ("llama id = vocab", _llama, _hf(input_ids=lambda: _ids(VOCAB)), IndexError, r"token id 61 in input 'input_ids'"),
    ("llama label = vocab + 7", _llama, _hf(labels=lambda: _ids(VOCAB + 7)), IndexError, r"label 68 in input 'labels'"),
    ("llama use_cache", _llama, _hf(use_cache=True), ValueError, r"use_cache=True"),
    ("tiny id = vocab", _tiny, lambda: (_ids(VOCAB), _ids()), IndexError, r"token id 61 in positional input 0"),
    ("tiny target = vocab", _tiny, lambda: (_ids(), _ids(VOCAB)), IndexError, r"label 61 in positional input 1"),
    ("tiny target -100 is not ignored by default? it is", _tiny, lambda: (_ids(), _ids(-101)), IndexError,
     r"label -101 in positional input 1 .*ignore index -100"),
    ("tiny meta ids", _tiny, lambda: (_ids().to("meta"), _ids()), ValueError, r"positional input 0 is a meta tensor"),
]


ORIGINAL_ACCEPTS = ("use_cache", "past_key_values")
"""Rows the single-device model runs (a meta forward, a KV cache) and a parallel module refuses."""


def _call(pm, inputs):
    return pm(**inputs) if isinstance(inputs, dict) else pm(*inputs)


def _single_device_raises(make, inputs) -> bool:
    """Whether the unmodified model rejects these inputs too (the point of the table)."""
    model = make()
    try:
        with torch.no_grad():
            _call(model, inputs)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_inputs_raise_clearly(case):
    _, make, inputs, error, pattern = case
    good = _hf()() if make is not _tiny else (_ids(), _ids())
    if "misspelt" in case[0]:  # the call's kwargs are not the forward's own check
        assert "input_idz" not in inspect.signature(make().forward).parameters
    with simulated_ranks(2):
        pm = sptransform.parallelize(make(), tp=2, example_inputs=good)
        with pytest.raises(error, match=pattern):
            _call(pm, inputs())
        _call(pm, good)  # the module still works afterwards
    if "meta" not in case[0]:  # a meta input on one device: fails or runs on meta, depending on the op order
        assert _single_device_raises(make, inputs()) != any(word in case[0] for word in ORIGINAL_ACCEPTS)


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_ignore_index_labels_stay_allowed(make):
    model = make()
    ref = copy.deepcopy(model)
    labels = _ids()
    labels[:, :5] = -100
    batch = dict(input_ids=_ids(), labels=labels)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, example_inputs=batch)
        with maybe_disable_local_tensor_mode():
            expected = ref(**batch).loss.detach()
        assert_all_ranks_close(pm(**batch).loss, expected, what="loss with ignored labels")


def _per_rank_tensor(mode, values):
    return mode.rank_map(lambda r: values[r].clone())


@pytest.mark.parametrize("which", ["input_ids", "labels"])
def test_ranks_given_different_batches_fail_on_every_rank_naming_the_input(which):
    batch = _hf()()
    with simulated_ranks(2) as mode:
        pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=batch)
        other = batch[which].roll(1, dims=1)
        bad = {**batch, which: _per_rank_tensor(mode, [batch[which], other])}
        with pytest.raises(ValueError, match=rf"ranks \[simulated rank 0\] vs \[simulated rank 1\] were given "
                                             rf"different values of input '{which}'.*check_inputs=False"):
            pm(**bad)
        pm_unchecked = sptransform.parallelize(_gpt2(), tp=2, example_inputs=batch, check_inputs=False)
        pm_unchecked(**bad)  # opted out: runs (and computes something that matches neither rank)


def test_a_bad_id_on_one_rank_only_is_raised():
    batch = _hf()()
    with simulated_ranks(2) as mode:
        pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=batch)
        with pytest.raises(IndexError, match="token id 61"):
            pm(**{**batch, "input_ids": _per_rank_tensor(mode, [batch["input_ids"], _ids(VOCAB)])})


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("sp", [True, False])
def test_inputs_embeds_is_supported(make, sp):
    """A parameter the new signature does not read (the token embedding) may keep its split."""
    model = make()
    ref = copy.deepcopy(model)
    batch = _hf()()
    embeds = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, sp=sp, example_inputs=batch)
        out = pm(inputs_embeds=embeds, labels=batch["labels"])
        with maybe_disable_local_tensor_mode():
            expected = ref(inputs_embeds=embeds, labels=batch["labels"]).loss.detach()
        assert_all_ranks_close(out.loss, expected, what="loss from inputs_embeds")
        assert_all_ranks_close(pm(**batch).loss, ref(**batch).loss.detach(), what="ids still work")


def test_inputs_embeds_that_require_grad():
    """A float input that requires grad gets its full gradient with sp=True and sp=False. With
    sp=True the residual stream that starts from it is not cut to each rank's part of the sequence
    here (the norms run replicated, f / f-bar collectives), so no rank's gradient is partial; were it
    cut, ``_check_split_inputs`` refuses the call (tested with ``WithBias`` below)."""
    model = _gpt2()
    ref = copy.deepcopy(model)
    labels = _ids()
    embeds = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    theirs = embeds.clone().requires_grad_()
    ref(inputs_embeds=theirs, labels=labels).loss.backward()
    for sp in (True, False):
        mine = embeds.clone().requires_grad_()
        with simulated_ranks(2):
            pm = sptransform.parallelize(copy.deepcopy(model), tp=2, sp=sp, example_inputs=_hf()())
            pm(inputs_embeds=mine, labels=labels).loss.backward()
            assert_all_ranks_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6, what=f"grad of inputs_embeds, sp={sp}")


class WithBias(nn.Module):
    """A float input that joins the sequence-split residual stream (a learned-prompt bias)."""

    def __init__(self):
        super().__init__()
        self.lm = TinyLM(TinyConfig(vocab=VOCAB))

    def forward(self, ids, targets, bias):
        lm = self.lm
        s = ids.shape[1]
        x = lm.tok(ids) + lm.pos(torch.arange(s, device=ids.device)) + bias
        for block in lm.blocks:
            x = block(x)
        logits = lm.head(lm.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_a_float_input_joining_the_sequence_split_stream():
    torch.manual_seed(0)
    model = WithBias()
    ref = copy.deepcopy(model)
    bias = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4))
    inputs = (_ids(), _ids(), bias)
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, sp=True, example_inputs=inputs)
        assert_all_ranks_close(pm(*inputs), ref(*inputs).detach(), what="loss with a float input")


def test_meta_example_inputs_are_fine():
    """Only shapes of example_inputs are read: meta tensors may stand in for them."""
    batch = {k: v.to("meta") for k, v in _hf()().items()}
    with simulated_ranks(2):
        pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=batch)
        assert all(v.device.type == "cpu" for v in per_rank(pm(**_hf()()).loss))


def test_a_float_input_that_requires_grad_and_is_cut_to_the_sequence_split_is_refused():
    """Each rank would get only its part of the bias's gradient: refused, naming the input and the fix."""
    torch.manual_seed(0)
    model = WithBias()
    bias = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4))
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, sp=True, example_inputs=(_ids(), _ids(), bias))
        with pytest.raises(ValueError, match=r"requires grad and is split along the sequence.*detach it, or pass sp=False"):
            pm(_ids(), _ids(), bias.clone().requires_grad_())


def test_the_per_call_fingerprint_reduces_nothing_and_tells_inputs_apart():
    """The fingerprint every call all-gathers (``check_inputs``) is built from Python ints in one
    ``torch.tensor``: CPU inputs are hashed from their bytes, so no reduction, no filled buffer
    (it was 6 ``aten::fill_`` per call with two inputs, then one ``sum`` and its fill per input,
    in every profiled step, compiled or not), and the part that depends on the signature alone is
    taken as given when the caller has it; still one slot per input that differs when the
    input's values, shape or dtype do, and a last slot for the inputs after the first six."""
    from torch.profiler import profile

    from sptransform.runtime.checks import FINGERPRINT, LEAF_SLOTS, fingerprint, signature_fingerprint

    ids, labels = _ids(), _ids()
    many = {f"x{i}": torch.arange(4) + i for i in range(LEAF_SLOTS + 2)}  # two inputs past the slots

    def row(**kwargs):
        (out,) = fingerprint((), kwargs, (True,), False, torch.device("cpu"))
        assert out.dtype == torch.int64 and out.shape == (FINGERPRINT,)
        assert out.tolist() == fingerprint((), kwargs, (True,), False, torch.device("cpu"),
                                           signature_fingerprint((), kwargs))[0].tolist()
        return out.tolist()

    inputs = dict(input_ids=ids, labels=labels, use_cache=False)
    signature = signature_fingerprint((), inputs)
    with profile() as prof:
        fingerprint((), inputs, (True,), False, torch.device("cpu"), signature)
    names = [e.name for e in prof.events()]
    # no compute: the row is made once (lift_fresh), the rest are numpy()'s views of the inputs
    computing = {n for n in names if n.startswith("aten::")} - {
        "aten::detach", "aten::to", "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::lift_fresh",
        "aten::detach_"}
    assert computing == set() and names.count("aten::lift_fresh") == 1, names

    base = row(input_ids=ids, labels=labels, use_cache=False)
    assert row(input_ids=ids.clone(), labels=labels.clone(), use_cache=False) == base
    changed = labels.clone()
    changed[0, 0] = (changed[0, 0] + 1) % VOCAB
    differs = [c for c, (a, b) in enumerate(zip(base, row(input_ids=ids, labels=changed, use_cache=False))) if a != b]
    assert differs == [3 + LEAF_SLOTS + 1], differs  # the values slot of input 1 ('labels')
    differs = [c for c, (a, b) in enumerate(zip(base, row(input_ids=ids, labels=labels[:, :8], use_cache=False)))
               if a != b]
    assert 3 + 1 in differs, differs  # the shape slot of 'labels'
    last = row(**many)
    for key in (f"x{LEAF_SLOTS}", f"x{LEAF_SLOTS + 1}"):
        other = row(**{**many, key: many[key] + 1})
        assert [c for c, (a, b) in enumerate(zip(last, other)) if a != b] == [FINGERPRINT - 2], key  # "the rest"
    assert row(**{**many, f"x{LEAF_SLOTS}": many[f"x{LEAF_SLOTS}"][:3]})[-2] != last[-2]
    # the last column: the captured graph's digest, given by the module (0 when it has none to compare)
    graphs = [fingerprint((), inputs, (True,), False, torch.device("cpu"), signature, g)[0].tolist() for g in (0, 7)]
    assert [c for c, (a, b) in enumerate(zip(*graphs)) if a != b] == [FINGERPRINT - 1] and graphs[1][-1] == 7
    failed = fingerprint((), {"input_ids": ids}, (True,), True, torch.device("cpu"))[0].tolist()
    assert failed == [1] + [0] * (FINGERPRINT - 1)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(6).reshape(2, 3),
    lambda: torch.randn(6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),  # no numpy dtype
    lambda: torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0)).conj(),  # lazy conj
    lambda: torch.randn(4, generator=torch.Generator().manual_seed(0)).requires_grad_(),
], ids=["int64", "bfloat16", "conj", "requires_grad"])
def test_content_hashes_tell_values_apart_on_every_path(make):
    """A CPU input is hashed from its bytes (through its integer bits where numpy has no dtype,
    resolved first where it is a lazy conjugate); an input on another device by a reduction where
    it lives (run here on the CPU). Either way: equal values, equal hash (a materialized copy
    too); one changed value or a permutation, another hash."""
    from sptransform.runtime.checks import _content, _device_content

    x = make()
    same = x.detach().resolve_conj().clone()
    changed = same.clone()
    changed[0] = changed[1] + 1
    for content in (_content, _device_content):
        digest = int(content(x))
        assert int(content(same)) == digest
        assert int(content(changed)) != digest
        assert int(content(same.flip(0))) != digest
