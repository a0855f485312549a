"""Activation memory measured on partitioned graphs: Korthikanti et al.'s Table 2 at t=1 and t=8,
the same layer written two ways, Figure 7's reduction, real saved tensors, the CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from examples.nanogpt import GPT, Block, GPTConfig
from sptransform.cli import memory as memory_cli
from sptransform.graph.regions import REGIONS
from sptransform.measure import measure_shape, partition_module
from sptransform.measure.memory import paper_layer_bytes
from sptransform.measure.models import fake_copy
from sptransform.passes.remat import RematOptions
from sptransform.planner.presets import PRESETS

PAPER_MODELS = ("gpt-22b", "gpt-175b", "gpt-530b", "gpt-1t")
# Table 2's rows: (tp, sp, policy); "full" re-runs the layer's collectives as Megatron does.
TABLE2_ROWS = {
    "no parallelism": (1, False, "none"),
    "tensor parallel (baseline)": (8, False, "none"),
    "tensor + sequence parallel": (8, True, "none"),
    "tensor parallel + selective": (8, False, "selective"),
    "tensor + sequence parallel + selective": (8, True, "selective"),
    "full activation recomputation": (8, False, "full"),
}


def _measure(model: str, tp: int, sp: bool, policy: str):
    shape = PRESETS[model]
    options = RematOptions(policy=policy, recompute_collectives=policy == "full", recompute_fusible=False)
    return measure_shape(shape, options=options, batch=shape.paper_layout["micro_batch"], tp=tp, sp=sp)


def _table2_case(model: str, row: str):
    tp, sp, policy = TABLE2_ROWS[row]
    m = _measure(model, tp, sp, policy)
    measured, paper = m.layer_bytes(), sum(m.paper().values())
    stats = m.memory.per_layer()["norms"] - m.paper()["norms"]  # LayerNorm mean/rstd: the allowed extra
    return measured, paper, stats, m


@pytest.mark.parametrize("row", list(TABLE2_ROWS))
def test_table2_rows_reproduced_within_1_percent_for_gpt3_175b(row):
    measured, paper, stats, m = _table2_case("gpt-175b", row)
    assert abs(measured - paper) / paper < 0.01, (row, measured / m.sbh, paper / m.sbh)
    # beyond norm statistics and a few RNG states, nothing else is extra
    assert abs(measured - stats - paper) / paper < 1e-3


@pytest.mark.slow
@pytest.mark.in_process  # no spawned ranks: runs beside the process tests
@pytest.mark.parametrize("model", ["gpt-22b", "gpt-530b", "gpt-1t"])
@pytest.mark.parametrize("row", list(TABLE2_ROWS))
def test_table2_rows_reproduced_within_1_percent_for_other_table3_models(model, row):
    measured, paper, stats, m = _table2_case(model, row)
    assert abs(measured - paper) / paper < 0.01, (model, row, measured / m.sbh, paper / m.sbh)


def test_measured_regions_match_the_papers_breakdown():
    m = _measure("gpt-175b", 8, True, "none")
    paper, measured = m.paper(), m.memory.per_layer()
    for region in REGIONS:
        assert measured[region] == pytest.approx(paper[region], rel=1e-3, abs=1e-3 * m.sbh), region


@pytest.mark.parametrize("model", ["gpt-530b", "gpt-1t"])
def test_sp_plus_selective_is_about_5x_below_tp_alone(model):
    tp_alone = _measure(model, 8, False, "none").layer_bytes()
    both = _measure(model, 8, True, "selective").layer_bytes()
    # Table 2: (10 + 24/8 + 5as/8h) / (34/8) = 21 / 4.25 = 4.94 for both models;
    # the paper rounds this to "5x" (Figure 7: "under 20%").
    assert tp_alone / both == pytest.approx(21 / 4.25, rel=1e-3)
    assert tp_alone / both > 4.9


def _nanogpt_layer(shape, dtype=torch.bfloat16):
    cfg = GPTConfig(block_size=shape.seq_len, vocab_size=shape.vocab_size, n_layer=1, n_head=shape.num_heads,
                    n_embd=shape.hidden, dropout=0.1)
    with torch.device("meta"):
        block = Block(cfg)
    block, fake_mode = fake_copy(block, dtype=dtype)
    with fake_mode:
        x = torch.empty(1, shape.seq_len, shape.hidden, dtype=dtype, requires_grad=True)
    return block, x


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_examples_nanogpt_layer_measures_like_the_preset_layer(policy):
    shape = PRESETS["gpt-175b"]
    block, x = _nanogpt_layer(shape)
    measured = partition_module(block, [x], options=RematOptions(policy=policy, recompute_fusible=False)).memory()
    preset = measure_shape(shape, options=RematOptions(policy=policy, recompute_fusible=False)).memory.per_layer()
    for region in REGIONS:
        assert measured.by_region(0)[region] == pytest.approx(preset[region], rel=1e-4, abs=64), region


def test_paper_formula_is_table2():
    shape = PRESETS["gpt-175b"]
    s, b, h, a = 2048, 1, shape.hidden, shape.num_heads
    sbh = s * b * h
    rows = {
        (1, False, "none"): 34 + 5 * a * s / h,
        (8, False, "none"): 10 + 24 / 8 + 5 * a * s / (h * 8),
        (8, True, "none"): (34 + 5 * a * s / h) / 8,
        (8, False, "selective"): 10 + 24 / 8,
        (8, True, "selective"): 34 / 8,
        (8, False, "full"): 2,
    }
    for (tp, sp, policy), per_sbh in rows.items():
        got = sum(paper_layer_bytes(shape, seq=s, batch=b, tp=tp, sp=sp, policy=policy).values())
        assert got == pytest.approx(per_sbh * sbh)
    assert paper_layer_bytes(PRESETS["llama-7b"], seq=s, batch=b) is None


def _saved_bytes_by_hooks(run, params) -> int:
    """Bytes autograd actually holds for backward: unique storages, parameters left out."""
    held: dict[int, int] = {}
    owned = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    return sum(held.values())


def _real_memory_agreement(cfg: GPTConfig, batch: int, seq: int, policies) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))
    state = list(model.parameters()) + list(model.buffers())
    ratios = {}
    for policy in policies:
        options = RematOptions(policy=policy, budget=0.4 if policy == "budget" else None)
        p = partition_module(model, [idx, idx], options=options, select_output=lambda out: out[1])
        held = _saved_bytes_by_hooks(lambda: p.compiled(idx, idx)[0], state)
        ratios[policy] = held / p.memory().total
    return ratios


POLICIES = ("none", "selective", "full", "norm_upproj", "budget")


def test_graph_report_matches_bytes_autograd_holds_for_each_policy():
    # GPT-2-small widths (h=768, 12 heads) at a CI-sized depth, vocabulary and sequence:
    # 2 layers, vocab 2048, seq 64, batch 2 (12 layers at full vocabulary is the slow test).
    cfg = GPTConfig(block_size=64, vocab_size=2048, n_layer=2, n_head=12, n_embd=768, dropout=0.1)
    ratios = _real_memory_agreement(cfg, batch=2, seq=64, policies=POLICIES)
    for policy, ratio in ratios.items():
        assert abs(ratio - 1) < 0.05, (policy, ratio)


@pytest.mark.slow
@pytest.mark.in_process  # no spawned ranks: runs beside the process tests
def test_graph_report_matches_bytes_autograd_holds_on_gpt2_small():
    # GPT-2 small (12 layers, 768 wide, vocab 50257) at sequence 64, batch 2: the issue's
    # config (seq 1024, batch 4) takes minutes per policy on 2 CPU cores; docs/remat.md has
    # that run's figures.
    cfg = GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768, dropout=0.1)
    ratios = _real_memory_agreement(cfg, batch=2, seq=64, policies=("none", "selective"))
    for policy, ratio in ratios.items():
        assert abs(ratio - 1) < 0.05, (policy, ratio)


def test_peak_backward_bytes_hold_at_least_what_is_saved():
    reports = {p: measure_shape(PRESETS["gpt2-tiny"], options=RematOptions(policy=p, recompute_fusible=False), seq=256).memory
               for p in ("none", "full")}
    for report in reports.values():
        assert report.peak_backward >= report.total
    assert reports["full"].total < reports["none"].total


def _cli(*argv) -> dict:
    parser = argparse.ArgumentParser()
    memory_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["memory", *argv, "--json"])
    return args


def test_cli_prints_measured_bytes_beside_the_paper(capsys):
    args = _cli("--model", "gpt-175b", "--tp", "8", "--sp", "--recompute", "selective")
    assert args.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["paper_row"] == "tensor + sequence parallel + selective activation recomputation"
    assert report["per_layer_total"] == pytest.approx(report["paper_per_layer_total"], rel=0.01)
    assert report["flops_per_layer"]["recompute"] > 0
    assert report["seconds"] < 60


def test_cli_rejects_an_unknown_policy_listing_the_valid_ones():
    args = _cli("--model", "gpt2-tiny", "--recompute", "everything")
    with pytest.raises(ValueError, match="selective"):
        args.run(args)
