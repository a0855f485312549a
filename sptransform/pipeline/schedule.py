"""Pipeline schedules: which torch schedule runs a name, where its stages sit, in what order
each rank runs forwards and backwards, and the timeline that order gives.

``SCHEDULES`` maps our names to ``torch.distributed.pipelining`` schedule classes
and the stage placement each one drives: *loop* (stage s on rank s mod pp) or
*V* (ranks 0..pp-1 then back pp-1..0, so the first and last stage share rank 0).

``pipeline_order`` gives each rank's action list (``"F"``, ``"B"``, and for
zero-bubble schedules ``"I"``/``"W"``, the backward split into input and weight
gradients). GPipe and 1F1B orders are computed here exactly as
``ScheduleGPipe/Schedule1F1B._step_microbatches`` run them (torch 2.13's
``Schedule1F1B.pipeline_order`` numbers the microbatches of ranks > 0 from 1 and is
not what runs); multi-stage schedules use the order torch builds and executes.
``simulate`` replays an order with dependencies (a stage's forward after the
previous stage's, a backward after the next stage's) to time every action and
to follow how many microbatches' activations each rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from torch.distributed.pipelining import schedules as torch_schedules

from sptransform.options import DEFAULT_STAGES_PER_RANK, PipelineOptions
from sptransform.torch_internals import generate_stage_to_rank_mapping, get_schedule_ops


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    torch_class: type
    multi: bool
    """Several stages per rank (``PipelineScheduleMulti``)."""
    placement: Literal["loop", "v"]
    stages_per_rank: tuple[int, ...] | None
    """Allowed stages per rank (None: any >= 2)."""
    default_stages_per_rank: int
    colocates_ends: bool
    """The first and last stage (embedding and head) share a rank."""
    waits_each_send: bool = False
    """The schedule waits on each forward send before the next one (1F1B): a stage can send
    from a short-lived copy and free its output at once. GPipe waits after all forwards and
    the multi-stage runtimes at the end of the step, so a copy would outlive the output."""


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", torch_schedules.ScheduleGPipe, False, "loop", (1,), DEFAULT_STAGES_PER_RANK["gpipe"], False),
        ScheduleSpec("1f1b", torch_schedules.Schedule1F1B, False, "loop", (1,), DEFAULT_STAGES_PER_RANK["1f1b"], False,
                     waits_each_send=True),
        ScheduleSpec("interleaved1f1b", torch_schedules.ScheduleInterleaved1F1B, True, "loop", None,
                     DEFAULT_STAGES_PER_RANK["interleaved1f1b"], False),
        ScheduleSpec("looped_bfs", torch_schedules.ScheduleLoopedBFS, True, "loop", None,
                     DEFAULT_STAGES_PER_RANK["looped_bfs"], False),
        ScheduleSpec("zbv", torch_schedules.ScheduleZBVZeroBubble, True, "v", (2,), DEFAULT_STAGES_PER_RANK["zbv"], True),
        # DeepSeek-V3's schedule (V placement, 2 stages per rank, at least 2 * pp microbatches):
        # torch's runtime runs each overlapped forward/backward pair one after the other
        ScheduleSpec("dualpipev", torch_schedules.ScheduleDualPipeV, True, "v", (2,),
                     DEFAULT_STAGES_PER_RANK["dualpipev"], True),
    )
}


def schedule_spec(name: str) -> ScheduleSpec:
    spec = SCHEDULES.get(str(name).lower())
    if spec is None:
        raise ValueError(f"schedule={name!r} is not one sptransform runs; use one of {', '.join(SCHEDULES)}")
    return spec


def check_stages_per_rank(spec: ScheduleSpec, stages_per_rank: int) -> None:
    allowed = spec.stages_per_rank
    if allowed is None and stages_per_rank < 2 or allowed is not None and stages_per_rank not in allowed:
        rule = "at least 2" if allowed is None else " or ".join(map(str, allowed))
        raise ValueError(
            f"schedule={spec.name!r} runs {rule} stage(s) per rank, not stages_per_rank={stages_per_rank}: "
            f"use stages_per_rank={spec.default_stages_per_rank}"
            + (", or schedule='interleaved1f1b' for several stages per rank" if not spec.multi else "")
        )


def stage_ranks(spec: ScheduleSpec, pp: int, stages_per_rank: int) -> list[int]:
    """The pipeline rank of every stage."""
    mapping = generate_stage_to_rank_mapping(pp, pp * stages_per_rank, style=spec.placement)
    return [mapping[s] for s in range(pp * stages_per_rank)]


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str
    """``F`` forward, ``B`` full backward, ``I`` input-gradient backward, ``W`` weight-gradient backward."""
    microbatch: int


def pipeline_order(spec: ScheduleSpec, pp: int, stages_per_rank: int, n_microbatches: int) -> list[list[Action]]:
    """Each rank's compute actions, in the order the schedule runs them."""
    if not spec.multi:
        single = _gpipe_order if spec.name == "gpipe" else _one_f_one_b_order
        return [single(rank, pp, n_microbatches) for rank in range(pp)]
    ops = get_schedule_ops(spec.torch_class, pp, n_microbatches, stages_per_rank)
    return [[Action(a.stage_index, a.computation_type.value, a.microbatch_index) for a in _computations(rank)]
            for rank in ops]


def _computations(actions) -> list:
    """A rank's forward and backward actions in order; DualPipeV's overlapped pair (``OVERLAP_F_B``)
    is its two actions, which torch's runtime runs one after the other."""
    found = []
    for a in actions:
        if a is None:
            continue
        if getattr(a, "sub_actions", None):
            found.extend(_computations(a.sub_actions))
        elif a.computation_type.value in ("F", "B", "I", "W") and a.microbatch_index is not None:
            found.append(a)
    return found


def _gpipe_order(stage: int, num_stages: int, n: int) -> list[Action]:
    return [Action(stage, "F", m) for m in range(n)] + [Action(stage, "B", m) for m in range(n)]


def _one_f_one_b_order(stage: int, num_stages: int, n: int) -> list[Action]:
    warmup = min(n, num_stages - stage)
    actions = [Action(stage, "F", m) for m in range(warmup)]
    forward, backward = warmup, 0
    while backward < n:
        actions.append(Action(stage, "B", backward))
        backward += 1
        if forward < n:
            actions.append(Action(stage, "F", forward))
            forward += 1
    return actions


def inflight(order: Sequence[Sequence[Action]], num_stages: int) -> list[int]:
    """Most microbatches whose activations each stage holds at once (forward done, backward not)."""
    most = [0] * num_stages
    for actions in order:
        held = [0] * num_stages
        for a in actions:
            if a.kind == "F":
                held[a.stage] += 1
                most[a.stage] = max(most[a.stage], held[a.stage])
            elif a.kind in ("B", "W"):
                held[a.stage] -= 1
    return most


def fully_stored_microbatches(order: Sequence[Sequence[Action]], num_stages: int, window: int) -> list[set[int]]:
    """Korthikanti et al.'s microbatch-level recomputation (their Appendix C): per stage, the
    microbatches whose forward keeps every activation, the rest running the recompute policy.

    Walking each rank's actions in schedule order, a forward keeps everything while fewer than
    ``window`` of the stage's fully stored microbatches await their backward; that backward
    (the weight-gradient step when the schedule splits one off) frees the slot for a later
    microbatch: a moving window. Stages with fewer than ``window`` microbatches in flight store
    every microbatch.

        1F1B, pp=4, stage 0, window 1:  F0 F1 F2 F3 B0 F4 B1 F5 ...  ->  {0, 4, 8, ...}
    """
    if window < 0:
        raise ValueError(f"window={window} must be at least 0")
    releases_at = "W" if any(a.kind == "W" for actions in order for a in actions) else "B"
    stored: list[set[int]] = [set() for _ in range(num_stages)]
    for actions in order:
        open_slots = {}
        for a in actions:
            slots = open_slots.setdefault(a.stage, window)
            if a.kind == "F" and slots > 0:
                stored[a.stage].add(a.microbatch)
                open_slots[a.stage] = slots - 1
            elif a.kind == releases_at and a.microbatch in stored[a.stage]:
                open_slots[a.stage] = slots + 1
    return stored


@dataclass(frozen=True)
class Box:
    rank: int
    action: Action
    start: float
    end: float


DURATIONS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Relative times: a backward is about twice a forward (input and weight gradients, one each)."""


def simulate(order: Sequence[Sequence[Action]], num_stages: int,
             durations: dict[str, float] | None = None) -> list[Box]:
    """Time every action: each rank runs its list in order; a forward waits for the previous
    stage's forward of its microbatch, a backward for the next stage's (or for its own
    forward on the last stage), a weight gradient for its input gradient."""
    durations = {**DURATIONS, **(durations or {})}
    done: dict[tuple[int, str, int], float] = {}
    cursor = [0] * len(order)
    free = [0.0] * len(order)
    boxes: list[Box] = []
    remaining = sum(len(a) for a in order)
    while remaining:
        progressed = False
        for rank, actions in enumerate(order):
            while cursor[rank] < len(actions):
                a = actions[cursor[rank]]
                deps = _dependencies(a, num_stages)
                if any(d not in done for d in deps):
                    break
                start = max([free[rank]] + [done[d] for d in deps])
                end = start + durations[a.kind]
                done[(a.stage, "B" if a.kind == "I" else a.kind, a.microbatch)] = end
                boxes.append(Box(rank, a, start, end))
                free[rank] = end
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: actions[cursor[r]] for r, actions in enumerate(order) if cursor[r] < len(actions)}
            raise AssertionError(f"schedule deadlocks at {stuck}")
    return boxes


def _dependencies(a: Action, num_stages: int) -> list[tuple[int, str, int]]:
    if a.kind == "F":
        return [(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    if a.kind == "W":
        return [(a.stage, "B", a.microbatch)]
    after = [(a.stage, "F", a.microbatch)]
    return after + ([(a.stage + 1, "B", a.microbatch)] if a.stage < num_stages - 1 else [])


def memory_timeline(boxes: Sequence[Box], pp: int,
                    stage_bytes: Sequence[float] | Callable[[int, int], float] | None = None,
                    *, releases: Sequence[str] = ("B", "W")) -> list[list[tuple[float, float]]]:
    """Per rank, (time, activation bytes held) steps: a forward adds its stage's bytes at its
    start, a backward (or weight gradient) frees them at its end. ``stage_bytes``: per stage,
    or a function of (stage, microbatch); without it, one unit per stage and microbatch."""
    events: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    has_weight_step = any(b.action.kind == "W" for b in boxes)
    for b in boxes:
        if stage_bytes is None:
            size = 1.0
        elif callable(stage_bytes):
            size = float(stage_bytes(b.action.stage, b.action.microbatch))
        else:
            size = float(stage_bytes[b.action.stage])
        if b.action.kind == "F":
            events[b.rank].append((b.start, size))
        elif b.action.kind in releases and not (b.action.kind == "B" and has_weight_step):
            events[b.rank].append((b.end, -size))
    out = []
    for rank_events in events:
        level, steps = 0.0, [(0.0, 0.0)]
        for t, delta in sorted(rank_events):
            level += delta
            if steps[-1][0] == t:  # events at one instant: one step to where they end
                steps[-1] = (t, level)
            else:
                steps.append((t, level))
        out.append(steps)
    return out


def check_pipeline_options(options: PipelineOptions) -> None:
    """The schedule's own rules on ``options`` (stages per rank, microbatch rounds)."""
    spec = schedule_spec(options.schedule)
    if options.stages_per_rank is not None:
        check_stages_per_rank(spec, options.stages_per_rank)
    if spec.name == "interleaved1f1b":
        rounds = max(1, options.n_microbatches // options.pp)
        if options.n_microbatches % rounds:
            raise ValueError(
                f"schedule='interleaved1f1b' with pp={options.pp} runs n_microbatches in rounds of pp; "
                f"n_microbatches={options.n_microbatches} is not a multiple of its {rounds} rounds: "
                f"use a multiple of pp={options.pp} (or fewer than {options.pp})"
            )


def fully_stored(options: PipelineOptions) -> list[set[int] | None]:
    """Per stage, the microbatches that keep every activation under ``stored_microbatches``
    (``None`` for every stage when it is not set)."""
    if options.stored_microbatches is None:
        return [None] * options.num_stages
    order = pipeline_order(schedule_spec(options.schedule), options.pp, options.virtual, options.n_microbatches)
    return fully_stored_microbatches(order, options.num_stages, options.stored_microbatches)
