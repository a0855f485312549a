"""``sptransform memory --pp``: graph-measured bytes laid out on a pipeline, each rank's peak from
the schedule's own order; it agrees with the planner's in-flight formula (1F1B and interleaved)."""

from __future__ import annotations

import pytest

from sptransform.measure.layer import measure_shape
from sptransform.cli.memory import pipeline_memory
from sptransform.passes.remat import RematOptions
from sptransform.planner.memory import layers_in_flight
from sptransform.planner.presets import PRESETS


@pytest.fixture(scope="module")
def gpt22b():
    """One rank of GPT 22B (48 layers) at t=8 with SP and selective recompute."""
    return measure_shape(PRESETS["gpt-22b"], options=RematOptions(policy="selective", recompute_fusible=False), tp=8, sp=True, num_layers=2)


def test_embedding_is_counted_on_the_first_stage_and_the_head_on_the_last(gpt22b):
    embedding, head = gpt22b.memory.embedding_and_head_bytes()
    assert embedding > 0 and head > embedding  # the head keeps the logits' softmax, the embedding a dropout mask
    assert embedding + head == sum(gpt22b.memory.outside_layers().values())
    report = pipeline_memory(gpt22b, pp=4, microbatches=8, schedule="1f1b", stages_per_rank=None)
    per_mb = [r["bytes_per_microbatch"] for r in report["ranks"]]
    layer = gpt22b.layer_bytes()
    assert per_mb == pytest.approx([12 * layer + embedding, 12 * layer, 12 * layer, 12 * layer + head])


@pytest.mark.parametrize("pp,microbatches", [(4, 8), (8, 8), (4, 2)])
def test_1f1b_first_rank_holds_pp_microbatches_and_the_last_one(gpt22b, pp, microbatches):
    report = pipeline_memory(gpt22b, pp=pp, microbatches=microbatches, schedule="1f1b", stages_per_rank=None)
    held = [r["peak_bytes"] / r["bytes_per_microbatch"] for r in report["ranks"]]
    assert held == pytest.approx([min(pp - i, microbatches) for i in range(pp)])


@pytest.mark.parametrize("pp,microbatches", [(4, 8), (4, 16), (8, 16), (8, 8)])
def test_interleaved_first_rank_matches_the_planners_formula(gpt22b, pp, microbatches):
    """The schedule simulated in torch's own order holds, on rank 0, the layer-microbatches
    ``layers_in_flight`` counts (the paper's ``L(1 + (pp-1)/(pp v))`` when microbatches suffice)."""
    report = pipeline_memory(gpt22b, pp=pp, microbatches=microbatches, schedule="interleaved1f1b",
                             stages_per_rank=2)
    layers = layers_in_flight(num_layers=48, pp=pp, interleave=2, stage=0, num_microbatches=microbatches)
    embedding, _ = gpt22b.memory.embedding_and_head_bytes()
    chunks_with_embedding = min(2 * (pp - 1) + pp + 1, microbatches * 2)  # chunk 0 is one of them
    first = report["ranks"][0]["peak_bytes"]
    assert first >= layers * gpt22b.layer_bytes()
    assert first <= layers * gpt22b.layer_bytes() + chunks_with_embedding * embedding


def test_zero_bubble_v_puts_embedding_and_head_on_the_first_rank(gpt22b):
    zbv = pipeline_memory(gpt22b, pp=4, microbatches=8, schedule="zbv", stages_per_rank=2)
    embedding, head = gpt22b.memory.embedding_and_head_bytes()
    first = zbv["ranks"][0]
    assert first["stages"] == [0, 7] and first["layers"] == 12  # V-shaped placement
    assert first["bytes_per_microbatch"] == pytest.approx(12 * gpt22b.layer_bytes() + embedding + head)
    assert first["bytes_per_microbatch"] <= first["peak_bytes"] <= 8 * first["bytes_per_microbatch"]


def test_more_stages_than_layers_is_an_error(gpt22b):
    with pytest.raises(ValueError, match="48 layers, fewer than pp x stages_per_rank = 64"):
        pipeline_memory(gpt22b, pp=32, microbatches=32, schedule="interleaved1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match="stages_per_rank=2"):
        pipeline_memory(gpt22b, pp=4, microbatches=8, schedule="1f1b", stages_per_rank=2)


def test_cli_reports_each_pipeline_rank(capsys):
    import argparse
    import json

    from sptransform.cli import memory as memory_cli

    parser = argparse.ArgumentParser()
    memory_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["memory", "--model", "gpt2-tiny", "--seq", "128", "--pp", "2", "--microbatches", "4",
                              "--json"])
    assert args.run(args) == 0
    report = json.loads(capsys.readouterr().out)["pipeline"]
    assert [r["stages"] for r in report["ranks"]] == [[0], [1]]
    assert report["layers_per_stage"] == [1, 1]
    args = parser.parse_args(["memory", "--model", "gpt2-tiny", "--seq", "128", "--pp", "2"])
    assert args.run(args) == 0
    assert "pipeline: pp=2, 1f1b" in capsys.readouterr().out


@pytest.fixture(scope="module")
def gpt22b_everything():
    """The same rank without recomputation: what a fully stored microbatch keeps."""
    return measure_shape(PRESETS["gpt-22b"], options=RematOptions(policy="none", recompute_fusible=False), tp=8, sp=True, num_layers=2)


def test_microbatch_level_window_between_recompute_and_none(gpt22b, gpt22b_everything):
    """1F1B, pp=4: the first rank holds 4 microbatches; with a window of 1 one of them keeps
    everything and three the policy's bytes; a window of pp is no recompute, 0 is all recompute."""
    def peaks(window):
        report = pipeline_memory(gpt22b, pp=4, microbatches=8, schedule="1f1b", stages_per_rank=None,
                                 stored_microbatches=window, fully_stored=gpt22b_everything)
        return [r["peak_bytes"] for r in report["ranks"]], report

    everything = pipeline_memory(gpt22b_everything, pp=4, microbatches=8, schedule="1f1b", stages_per_rank=None)
    policy = pipeline_memory(gpt22b, pp=4, microbatches=8, schedule="1f1b", stages_per_rank=None)
    full_mb = everything["ranks"][0]["bytes_per_microbatch"]
    policy_mb = policy["ranks"][0]["bytes_per_microbatch"]
    one, report = peaks(1)
    assert one[0] == pytest.approx(full_mb + 3 * policy_mb)
    assert report["ranks"][0]["recomputed_microbatches"] == 6  # microbatches 0 and 4 keep everything
    assert report["ranks"][3]["recomputed_microbatches"] == 0  # the last rank holds one at a time
    assert peaks(4)[0] == pytest.approx([r["peak_bytes"] for r in everything["ranks"]])
    assert peaks(0)[0] == pytest.approx([r["peak_bytes"] for r in policy["ranks"]])
    with pytest.raises(ValueError, match="fully_stored= the measurement without recomputation"):
        pipeline_memory(gpt22b, pp=4, microbatches=8, schedule="1f1b", stages_per_rank=None, stored_microbatches=1)


def test_cli_stored_microbatches_needs_a_pipeline_and_a_policy():
    import argparse

    from sptransform.cli import memory as memory_cli

    parser = argparse.ArgumentParser()
    memory_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["memory", "--model", "gpt2-tiny", "--seq", "128", "--stored-microbatches", "1"])
    with pytest.raises(ValueError, match=r"--stored-microbatches 1 chooses which pipeline microbatches skip "
                                         r"recomputation: give --pp > 1 and a --recompute policy"):
        args.run(args)
