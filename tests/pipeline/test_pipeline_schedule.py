"""Schedule orders, placements, the timeline simulation and the ``sptransform schedule`` command."""

from __future__ import annotations

from collections import Counter

import pytest

from sptransform.cli import main
from sptransform.pipeline.schedule import (
    SCHEDULES, fully_stored_microbatches, inflight, memory_timeline, pipeline_order, schedule_spec, simulate,
    stage_ranks,
)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("pp,n", [(2, 4), (4, 8), (4, 3)])
def test_every_stage_runs_every_microbatch_forward_and_backward_once(name, pp, n):
    spec = schedule_spec(name)
    v = spec.default_stages_per_rank
    if name == "interleaved1f1b" and n % max(1, n // pp):
        pytest.skip("torch's interleaved rounds")
    if name == "dualpipev" and n < pp * v:
        pytest.skip("DualPipeV needs a microbatch per stage (refused by PipelineOptions)")
    order = pipeline_order(spec, pp, v, n)
    ranks = stage_ranks(spec, pp, v)
    counts = Counter((a.stage, a.kind, a.microbatch) for rank, actions in enumerate(order) for a in actions)
    for rank, actions in enumerate(order):
        assert all(ranks[a.stage] == rank for a in actions)
    for stage in range(pp * v):
        for m in range(n):  # one full backward, or its input- and weight-gradient halves (zero bubble)
            backward = ("B",) if counts[(stage, "B", m)] else ("I", "W")
            for kind in ("F", *backward):
                assert counts[(stage, kind, m)] == 1, (stage, kind, m)
    simulate(order, pp * v)  # no deadlock


def test_dualpipev_runs_both_halves_of_its_overlapped_pairs_and_needs_a_microbatch_per_stage():
    """DeepSeek-V3's schedule pairs one microbatch's forward with another's backward
    (``OVERLAP_F_B``); the order lists both, as torch's runtime runs them."""
    from sptransform.options import PipelineOptions

    order = pipeline_order(schedule_spec("dualpipev"), 2, 2, 4)
    assert sum(len(actions) for actions in order) > 2 * 2 * 4 * 2  # every F and B (some split in I and W)
    assert stage_ranks(schedule_spec("dualpipev"), 2, 2) == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="n_microbatches=2 < 4 stages"):
        PipelineOptions(pp=2, schedule="dualpipev", n_microbatches=2)


def test_v_placement_puts_first_and_last_stage_on_rank_0():
    assert stage_ranks(schedule_spec("zbv"), 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stage_ranks(schedule_spec("interleaved1f1b"), 4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_1f1b_holds_at_most_pp_microbatches_on_the_first_stage_and_gpipe_all():
    assert inflight(pipeline_order(schedule_spec("1f1b"), 4, 1, 8), 4) == [4, 3, 2, 1]
    assert inflight(pipeline_order(schedule_spec("1f1b"), 4, 1, 2), 4) == [2, 2, 2, 1]
    assert inflight(pipeline_order(schedule_spec("gpipe"), 4, 1, 8), 4) == [8, 8, 8, 8]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_take_the_papers_bubble(name):
    """(p - 1) / (m + p - 1) of the step idle (forward 1, backward 2)."""
    p, m = 4, 8
    boxes = simulate(pipeline_order(schedule_spec(name), p, 1, m), p)
    assert max(b.end for b in boxes) == (m + p - 1) * 3


def test_interleaving_shrinks_the_bubble_and_memory_follows_forwards_and_backwards():
    p, m = 4, 8
    plain = simulate(pipeline_order(schedule_spec("1f1b"), p, 1, m), p)
    interleaved = simulate(pipeline_order(schedule_spec("interleaved1f1b"), p, 2, m), 2 * p,
                           {"F": 0.5, "B": 1.0})
    assert max(b.end for b in interleaved) < max(b.end for b in plain)
    steps = memory_timeline(plain, p)
    assert [max(level for _, level in s) for s in steps] == [4, 3, 2, 1]
    assert all(s[-1][1] == 0 for s in steps)


def test_schedule_command_prints_the_timeline_and_draws_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "schedule.png"
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0: busy 24 of 33, peak activations 4 microbatch(es): F0 F1 F2 F3 B0 F4" in out
    assert "bubble 27.3%" in out
    assert path.stat().st_size > 10_000


def test_schedule_command_rejects_a_placement_the_schedule_cannot_run(capsys):
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zbv", "--stages-per-rank", "3"]) == 2
    assert "schedule='zbv' runs 2 stage(s) per rank, not stages_per_rank=3" in capsys.readouterr().err


def test_microbatch_level_recompute_keeps_a_moving_window_of_fully_stored_microbatches():
    """The paper's Figure 10 (pp=4, 9 microbatches, room for one fully stored microbatch on the
    first stage): microbatches 0, 4 and 8 keep everything, each after the previous one's backward;
    later stages hold fewer in flight and store more."""
    order = pipeline_order(schedule_spec("1f1b"), 4, 1, 9)
    stored = fully_stored_microbatches(order, 4, 1)
    assert stored[0] == {0, 4, 8}
    assert stored[3] == set(range(9))  # the last stage holds one microbatch at a time
    assert [len(s) for s in stored] == sorted(len(s) for s in stored)
    assert fully_stored_microbatches(order, 4, 0) == [set()] * 4
    assert fully_stored_microbatches(order, 4, 4) == [set(range(9))] * 4  # a window of pp stores everything


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("window", [1, 2])
def test_fully_stored_microbatches_never_exceed_the_window_in_flight(name, window):
    spec = schedule_spec(name)
    v = spec.default_stages_per_rank
    order = pipeline_order(spec, 4, v, 8)
    stored = fully_stored_microbatches(order, 4 * v, window)
    releases = "W" if any(a.kind == "W" for actions in order for a in actions) else "B"
    for actions in order:
        held: dict[int, int] = {}
        for a in actions:
            if a.microbatch in stored[a.stage]:
                if a.kind == "F":
                    held[a.stage] = held.get(a.stage, 0) + 1
                    assert held[a.stage] <= window, (name, a)
                elif a.kind == releases:
                    held[a.stage] -= 1
