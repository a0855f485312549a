"""``sptransform schedule``: a pipeline schedule's timeline per rank and its activation memory over time.

    sptransform schedule --pp 4 --microbatches 8 --schedule 1f1b -o schedule.png
    sptransform schedule --pp 4 --microbatches 8 --schedule interleaved1f1b --stages-per-rank 2
    sptransform schedule --pp 4 --microbatches 8 --schedule zbv --backward-ratio 2

Each rank runs the action list of the schedule sptransform drives (torch's
``pipeline_order`` for multi-stage schedules; GPipe/1F1B as their
``_step_microbatches`` run): a forward takes 1 unit of time per full model slice
(1/v for v stages per rank), a backward ``--backward-ratio`` units (split evenly
into input and weight gradients for zero-bubble schedules). A forward waits for
the previous stage's forward of its microbatch, a backward for the next stage's.
The figure draws the F/B boxes per rank, numbered by microbatch, like Figure 10 of
Korthikanti et al., and each rank's activations held over time, in units of one
microbatch's activations of one full slice (each forward holds 1/v until its backward).
"""

from __future__ import annotations

import argparse
import math

from sptransform.cli.args import (
    PIPELINE_LIMITS, PLOT_LIMIT, PLOT_MAX_RANKS, check_pipeline_size, int_type, positive_float, schedule_and_stages,
)

# torch loads when the command runs, not when the CLI builds its parsers


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "schedule", help="a pipeline schedule's per-rank timeline and activation memory over time",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(run=run)
    limits = PIPELINE_LIMITS
    simulated = "the schedule is simulated action by action"
    parser.add_argument("--pp", type=int_type(1, limits["pp"], why=simulated), required=True,
                        help=f"pipeline ranks (at most {limits['pp']})")
    parser.add_argument("--microbatches", type=int_type(1, limits["microbatches"], why=simulated), required=True,
                        help=f"microbatches per step (at most {limits['microbatches']})")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved1f1b, looped_bfs or zbv (default 1f1b)")
    parser.add_argument("--stages-per-rank", type=int_type(1, limits["stages_per_rank"], why=simulated),
                        help="virtual stages per rank (default 1, or 2 for multi-stage schedules)")
    parser.add_argument("--backward-ratio", type=positive_float, default=2.0,
                        help="backward time over forward time, a finite number > 0 (default 2)")
    parser.add_argument("-o", "--output", help="write the figure here (.png, .pdf, .svg; needs matplotlib; "
                                               f"at most {PLOT_MAX_RANKS} ranks and {PLOT_LIMIT:,} stage-microbatches)")
    parser.epilog = (
        f"Limits: pp x stages-per-rank x microbatches <= {limits['stage_microbatches']:,} for gpipe/1f1b, "
        f"<= {limits['stage_microbatches_torch']:,} for interleaved1f1b/looped_bfs/zbv (torch builds their order); "
        "at these limits a call takes seconds."
    )


def timeline(pp: int, microbatches: int, schedule: str, stages_per_rank: int | None, backward_ratio: float):
    """(spec, v, boxes, memory steps per rank) of one schedule."""
    from sptransform.pipeline.schedule import memory_timeline, pipeline_order, simulate

    for name, value in (("--pp", pp), ("--microbatches", microbatches)):
        if value < 1:
            raise ValueError(f"{name} {value} must be at least 1")
    if not 0 < backward_ratio < math.inf:
        raise ValueError(f"--backward-ratio {backward_ratio} must be a finite number > 0")
    spec, v = schedule_and_stages(schedule, stages_per_rank)
    check_pipeline_size(pp, microbatches, v, spec.name)
    order = pipeline_order(spec, pp, v, microbatches)
    durations = {"F": 1.0 / v, "B": backward_ratio / v, "I": backward_ratio / (2 * v), "W": backward_ratio / (2 * v)}
    boxes = simulate(order, pp * v, durations)
    memory = memory_timeline(boxes, pp, [1.0 / v] * (pp * v))
    return spec, v, boxes, memory


def run(args: argparse.Namespace) -> int:
    spec, v, boxes, memory = timeline(args.pp, args.microbatches, args.schedule, args.stages_per_rank,
                                      args.backward_ratio)
    if args.output and args.pp > PLOT_MAX_RANKS:
        raise ValueError(f"-o draws at most {PLOT_MAX_RANKS} pipeline ranks, not --pp {args.pp}: drop -o for the "
                         "text timeline, or draw a smaller schedule")
    if args.output and args.pp * v * args.microbatches > PLOT_LIMIT:
        raise ValueError(f"-o draws at most {PLOT_LIMIT:,} stage-microbatches (pp x stages-per-rank x microbatches), "
                         f"not {args.pp} x {v} x {args.microbatches} = {args.pp * v * args.microbatches:,}: "
                         "drop -o for the text timeline, or draw a smaller schedule")
    makespan = max(b.end for b in boxes)
    print(f"schedule {spec.name} ({spec.torch_class.__name__}): pp={args.pp}, {v} stage(s) per rank "
          f"({spec.placement} placement), {args.microbatches} microbatches, backward = {args.backward_ratio:g} x forward")
    for rank in range(args.pp):
        mine = sorted((b for b in boxes if b.rank == rank), key=lambda b: b.start)
        busy = sum(b.end - b.start for b in mine)
        peak = max(level for _, level in memory[rank])
        actions = " ".join(f"{b.action.kind}{b.action.microbatch}" + (f"@{b.action.stage}" if v > 1 else "") for b in mine)
        print(f"  rank {rank}: busy {busy:g} of {makespan:g}, peak activations {peak:g} microbatch(es): {actions}")
    ideal = sum(b.end - b.start for b in boxes) / args.pp
    print(f"step time {makespan:g} (ideal {ideal:g}); bubble {1 - ideal / makespan:.1%}")
    if args.output:
        plot_timeline(spec.name, args.pp, v, boxes, memory, args.output)
        print(f"wrote {args.output}")
    return 0


_NUMBERED_BOXES = 600
"""Boxes get their microbatch number up to this many (each number costs a millisecond or two)."""
_COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fbc8f", "W": "#c44e52"}


def plot_timeline(name: str, pp: int, v: int, boxes, memory, path: str) -> None:
    try:
        import matplotlib
    except ImportError as error:
        raise ValueError("-o needs matplotlib; install it with `pip install matplotlib`") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    makespan = max(b.end for b in boxes)
    # inches, capped so that a long or deep schedule stays a drawable image (boxes get narrower)
    width, height = min(max(8.0, makespan * 0.45), 160.0), min(1.2 + 0.9 * pp + 3, 120.0)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(width, height),
                                         sharex=True, gridspec_kw={"height_ratios": [pp, 3]})
    groups: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for b in boxes:  # one bar collection per rank, kind and chunk: fast for thousands of boxes
        chunk = b.action.stage // pp if v > 1 else 0
        groups.setdefault((b.rank, b.action.kind, chunk), []).append((b.start, b.end - b.start))
    for (rank, kind, chunk), spans in groups.items():
        top.broken_barh(spans, (pp - 1 - rank + 0.1, 0.8), facecolors=_COLORS[kind], edgecolors="black",
                        linewidth=0.5, alpha=1.0 - 0.6 * chunk / max(v - 1, 1))
    for b in boxes if len(boxes) <= _NUMBERED_BOXES else ():
        top.text((b.start + b.end) / 2, pp - 1 - b.rank + 0.5, str(b.action.microbatch), ha="center",
                 va="center", fontsize=7, color="white")
    top.set_yticks([pp - 1 - r + 0.5 for r in range(pp)], [f"rank {r}" for r in range(pp)])
    top.set_title(f"{name}: pp={pp}, {v} stage(s) per rank (F blue, B green; I/W light green/red"
                  + ("; number = microbatch)" if len(boxes) <= _NUMBERED_BOXES else ")"))
    for rank, steps in enumerate(memory):
        times = [t for t, _ in steps] + [makespan]
        levels = [level for _, level in steps] + [steps[-1][1]]
        bottom.step(times, levels, where="post", label=f"rank {rank}")
    bottom.set_ylabel("activations held\n(microbatch slices)")
    bottom.set_xlabel("time (one full-slice forward = 1)")
    if pp <= 16:
        bottom.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as error:
        raise ValueError(f"cannot write -o {path!r} ({error.strerror}); give a path in an existing, "
                         "writable folder") from error
    finally:
        plt.close(figure)
