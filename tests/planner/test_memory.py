"""Memory budgets against the sources: Korthikanti et al. (eq. 1, Table 2, section 4.3),
the tutorial's bytes per parameter, ZeRO's table, and the DeepSeek-V3 chapter."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sptransform.planner.activations import activation_bytes_per_layer, saved_tensors_per_layer
from sptransform.planner.deepseek_chapter import (
    CHAPTER_FIGURES, chapter_budget, chapter_figures, chapter_walkthrough,
)
from sptransform.planner.layout import Layout
from sptransform.planner.memory import layers_in_flight, model_state_bytes, rank_memory
from sptransform.planner.params import total_params
from sptransform.planner.workload import FP16_ADAM_WITH_FP32_GRADIENTS, StateBytes, Workload
from sptransform.planner.presets import ModelShape, get_preset

FAST = settings(derandomize=True, max_examples=25, deadline=None)


def paper_layer(a=96, h=12288, L=96, v=51200):
    return ModelShape(name="paper", num_layers=L, hidden=h, num_heads=a, vocab_size=v)


@st.composite
def paper_shapes_and_tp(draw):
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    heads = tp * draw(st.integers(1, 16))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    seq = tp * draw(st.integers(1, 512))
    return paper_layer(a=heads, h=heads * head_dim), tp, seq, draw(st.integers(1, 4))


def per_layer(shape, **kw):
    return activation_bytes_per_layer(shape, **kw)


@FAST
@given(paper_shapes_and_tp())
def test_paper_layer_matches_equation_1_and_every_table2_row(case):
    shape, t, s, b = case
    h, a = shape.hidden, shape.num_heads
    sbh = s * b * h
    attention = 5 * a * s / h
    expected = {
        ("none", False, 1): sbh * (34 + attention),
        ("none", False, t): sbh * (10 + 24 / t + attention / t),
        ("none", True, t): sbh * (34 / t + attention / t),
        ("selective", False, t): sbh * (10 + 24 / t),
        ("selective", True, t): sbh * 34 / t,
        ("full", False, t): sbh * 2,
    }
    for (recompute, sp, tp), want in expected.items():
        got = per_layer(shape, tp=tp, sp=sp, recompute=recompute, micro_batch=b, seq_len=s)
        assert math.isclose(got, want, rel_tol=1e-12), (recompute, sp, tp, got / sbh, want / sbh)


def test_gpt3_and_mtnlg_attention_terms_and_selective_savings_match_section_5():
    for name, term, saving in (("gpt-175b", 80, 0.70), ("gpt-530b", 64, 0.65)):
        shape = get_preset(name)
        sbh = 2048 * shape.hidden
        full = per_layer(shape, tp=1, sp=False, recompute="none", micro_batch=1, seq_len=2048) / sbh
        kept = per_layer(shape, tp=1, sp=False, recompute="selective", micro_batch=1, seq_len=2048) / sbh
        assert full - 34 == term
        assert round(1 - kept / full, 2) == saving


def test_measured_gpt2_block_with_layernorm_statistics_matches_the_anchor():
    # ANCHORS.md: an HF GPT-2 block (h=2560, a=32, s=2048, b=1) saves 162.006 sbh bytes.
    shape = ModelShape(name="gpt2-2560", num_layers=1, hidden=2560, num_heads=32)
    got = per_layer(shape, tp=1, sp=False, recompute="none", micro_batch=1, seq_len=2048,
                    include_norm_statistics=True)
    assert round(got / (2048 * 2560), 3) == 162.006


def test_fused_attention_has_no_quadratic_term_and_dropout_free_models_keep_no_masks():
    llama = get_preset("llama-7b")
    short = per_layer(llama, tp=1, sp=False, recompute="none", micro_batch=1, seq_len=2048)
    long = per_layer(llama, tp=1, sp=False, recompute="none", micro_batch=1, seq_len=4096)
    assert long == 2 * short
    names = [t.name for t in saved_tensors_per_layer(llama, tp=1, sp=False, recompute="none",
                                                      micro_batch=1, seq_len=2048)]
    assert not any("mask" in n or "softmax" in n for n in names)
    explicit = llama.with_(attention="explicit")
    assert per_layer(explicit, tp=1, sp=False, recompute="none", micro_batch=1, seq_len=4096) > 2 * per_layer(
        explicit, tp=1, sp=False, recompute="none", micro_batch=1, seq_len=2048)


def test_swiglu_keeps_four_ffn_wide_tensors_and_gqa_narrower_k_v():
    base = get_preset("llama-7b")
    s, f, head_dim = 1024, base.ffn, base.head_dim
    swiglu = per_layer(base, tp=1, sp=False, recompute="none", micro_batch=1, seq_len=s)
    gelu = per_layer(base.with_(activation="gelu"), tp=1, sp=False, recompute="none", micro_batch=1, seq_len=s)
    assert swiglu - gelu == 2 * s * f * 2
    gqa = per_layer(base.with_(num_kv_heads=8), tp=1, sp=False, recompute="none", micro_batch=1, seq_len=s)
    assert swiglu - gqa == 2 * (32 - 8) * head_dim * s * 2  # K and V, 2 bytes each


def test_rmsnorm_keeps_one_statistic_per_token_where_layernorm_keeps_two():
    shape = get_preset("gpt2")
    kw = dict(tp=1, sp=False, recompute="none", micro_batch=2, seq_len=128)
    ln = per_layer(shape, include_norm_statistics=True, **kw) - per_layer(shape, **kw)
    rms = per_layer(shape.with_(norm="rmsnorm"), include_norm_statistics=True, **kw) - per_layer(
        shape.with_(norm="rmsnorm"), **kw)
    assert (ln, rms) == (2 * 2 * 256 * 4, 2 * 256 * 4)


def test_activation_formula_rejects_a_tp_that_cannot_split_heads():
    with pytest.raises(ValueError, match=r"tp=8 does not divide num_heads=12 .*use tp in \[1, 2, 4\]"):
        per_layer(get_preset("gpt2"), tp=8, sp=False, recompute="none", micro_batch=1, seq_len=1024)


def test_first_stage_holds_L_layers_for_any_pp_and_interleaving_adds_the_papers_factor():
    for pp in (1, 2, 4, 8, 16):
        assert layers_in_flight(num_layers=96, pp=pp, interleave=1, stage=0, num_microbatches=64) == 96
        assert layers_in_flight(num_layers=96, pp=pp, interleave=1, stage=pp - 1, num_microbatches=64) == 96 / pp
    for pp, m in ((8, 3), (4, 2), (2, 4)):
        got = layers_in_flight(num_layers=96, pp=pp, interleave=m, stage=0, num_microbatches=64)
        assert math.isclose(got, 96 * (1 + (pp - 1) / (pp * m)))


def test_total_activations_without_pipelining_match_section_4_3():
    shape = paper_layer(a=64, h=6144, L=48)  # the 22B model
    s, b, t = 2048, 1, 8
    layout = Layout(tp=t, pp=1, dp=1, sequence_parallel=True, zero_stage=0, recompute="none", micro_batch=b)
    (only,) = rank_memory(shape, layout, workload=Workload(global_batch=4, seq_len=s))
    sbh, L, a, h, v, p = s * b * shape.hidden, 48, 64, 6144, 51200, 1
    paper = sbh * L / t * (34 + 5 * a * s / h) + sbh * L / t * (p / L + 4 / L * (1 + v / h))
    assert math.isclose(only.activations, paper, rel_tol=1e-12)


def test_tutorial_20_bytes_per_parameter_puts_gpt_1_3b_at_about_26_gb():
    b = FP16_ADAM_WITH_FP32_GRADIENTS
    assert b.weights + b.gradients + b.optimizer == 20
    nominal = model_state_bytes(1.3e9, zero_stage=0, dp=1, state_bytes=b).total
    assert nominal == pytest.approx(26e9)
    preset = model_state_bytes(total_params(get_preset("gpt-1.3b")), zero_stage=0, dp=1, state_bytes=b).total
    assert round(preset / 1e9) == 26


def test_zero_table_for_7_5b_parameters_k12_64_ranks():
    gb = [round(model_state_bytes(7.5e9, zero_stage=z, dp=64, state_bytes=StateBytes()).total / 1e9, 1)
          for z in (0, 1, 2, 3)]
    assert gb == [120.0, 31.4, 16.6, 1.9]


@FAST
@given(st.integers(1, 10**11), st.sampled_from([1, 2, 8, 64, 512]))
def test_each_zero_stage_needs_no_more_memory_than_the_one_before(params, dp):
    totals = [model_state_bytes(params, zero_stage=z, dp=dp, with_ema=True).total for z in (0, 1, 2, 3)]
    assert totals == sorted(totals, reverse=True)


def test_deepseek_chapter_walkthrough_reproduces_33_6_and_26_1_gb():
    budgets = chapter_walkthrough()
    assert chapter_figures(budgets["before"]) == CHAPTER_FIGURES["before"]
    assert chapter_figures(budgets["after"]) == CHAPTER_FIGURES["after"]
    # Each trick on its own only lowers its own bucket.
    ema_only = chapter_figures(chapter_budget(recompute=False, ema_on_host=True, share_embedding=False))
    assert ema_only["total"] == pytest.approx(33.6 - 2.6)
    assert budgets["after"].ema_host == pytest.approx(4 * 671e9 / (16 * 64))


def test_gpt175b_has_about_175b_parameters():
    assert round(total_params(get_preset("gpt-175b")) / 1e9) == 175


def _stages(shape, **layout_changes):
    layout = Layout(tp=1, pp=1, dp=1, sequence_parallel=False, zero_stage=0, recompute="full", micro_batch=1)
    return rank_memory(shape, replace(layout, **layout_changes), workload=Workload(global_batch=8, seq_len=1024))


def test_embedding_and_head_tied_or_not_and_colocated_or_not():
    tied = get_preset("gpt2")
    h, per_param = tied.hidden, 2 + 2 + 12
    matrix, positions, final_norm = tied.vocab_size * h, tied.seq_len * h, 2 * h
    (one,) = _stages(tied)
    (two,) = _stages(tied.with_(tied_embeddings=False))
    assert one.embedding_head == (matrix + positions + final_norm) * per_param
    assert two.embedding_head == (2 * matrix + positions + final_norm) * per_param
    first, last = _stages(tied, pp=2)  # a tied head on another stage keeps its own copy
    assert (first.embedding_head, last.embedding_head) == ((matrix + positions) * per_param,
                                                           (matrix + final_norm) * per_param)
    first, last = _stages(tied, pp=2, colocate_embedding_head=True)
    assert (first.embedding_head, last.embedding_head) == ((matrix + positions + final_norm) * per_param, 0)


def test_ema_on_host_leaves_gpu_total_and_ema_on_gpu_is_sharded_like_the_optimizer():
    shape = get_preset("gpt2")
    layout = Layout(tp=1, pp=1, dp=4, sequence_parallel=False, zero_stage=1, recompute="none", micro_batch=1)
    budgets = {ema: rank_memory(shape, layout, workload=Workload(global_batch=8, seq_len=1024, ema=ema))[0]
               for ema in ("none", "gpu", "host")}
    assert budgets["host"].total == budgets["none"].total
    assert budgets["gpu"].total - budgets["none"].total == pytest.approx(total_params(shape) * 4 / 4)
    assert budgets["host"].ema_host == pytest.approx(total_params(shape) * 4 / 4)
