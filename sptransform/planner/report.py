"""A plan as a table, as JSON, and as stacked memory bars."""

from __future__ import annotations

from dataclasses import asdict

from sptransform.planner.cluster import GIB
from sptransform.planner.flops import EQ8_NOTE, hardware_flops, model_flops
from sptransform.planner.memory import GPU_BUCKETS, MemoryBudget
from sptransform.planner.params import total_params
from sptransform.planner.search import Candidate, Plan
from sptransform.planner.tables import TextTable, plot_stacked_bars
from sptransform.planner.throughput import __doc__ as THROUGHPUT_ASSUMPTIONS

SHORT_BUCKET_NAMES = {"weights": "weights", "gradients": "grads", "optimizer": "optim", "ema": "EMA",
                      "activations": "activ.", "embedding_head": "emb+head"}


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def plan_table(plan: Plan, *, top: int) -> TextTable:
    shown = plan.fitting[:top] or plan.candidates[:top]
    columns = ("layout", "rank", *SHORT_BUCKET_NAMES.values(), "total GiB", "MFU", "HFU actual", "HFU eq.8", "iter s",
               "tokens/s")
    rows = tuple(_row(c) for c in shown)
    return TextTable(title=_headline(plan, shown_fitting=bool(plan.fitting)), columns=columns, rows=rows,
                     notes=_notes(plan, shown), right_aligned_from=2)


def _row(c: Candidate) -> tuple[str, ...]:
    speed = c.utilization
    return (c.layout.label(), c.peak.label, *(_gib(getattr(c.peak, name)) for name in GPU_BUCKETS),
            _gib(c.peak.total), f"{100 * speed.mfu:.1f}%", f"{100 * speed.hfu:.1f}%", f"{100 * speed.hfu_eq8:.1f}%",
            f"{speed.iteration_time_s:.2f}", f"{speed.tokens_per_s:,.0f}")


def _headline(plan: Plan, *, shown_fitting: bool) -> str:
    workload, cluster = plan.workload, plan.cluster
    verdict = (f"{len(plan.fitting)} of {len(plan.candidates)} valid layouts fit in "
               f"{_gib(plan.memory_limit)} GiB" if shown_fitting else
               f"none of {len(plan.candidates)} valid layouts fits in {_gib(plan.memory_limit)} GiB; "
               "the smallest are shown")
    return (f"{plan.shape.name} ({total_params(plan.shape) / 1e9:.1f}B parameters) on {cluster.num_gpus} x "
            f"{cluster.gpu.name}, global batch {workload.global_batch} x seq {workload.seq_len}: {verdict} "
            f"({plan.skipped} combinations broke a divisibility rule)")


def _notes(plan: Plan, shown: tuple[Candidate, ...]) -> tuple[str, ...]:
    notes = [
        "Memory is the heaviest rank (first or last pipeline stage) at its peak, in GiB; "
        f"EMA: {plan.workload.ema}"
        + (f" (host share {_gib(max(c.peak.ema_host for c in shown))} GiB per rank)"
           if plan.workload.ema == "host" and shown else "") + ".",
        f"Throughput assumes {plan.achieved_fraction:.0%} of peak {plan.cluster.gpu.peak_flops / 1e12:.0f} TFLOP/s "
        "on the hardware FLOPs, plus the pipeline bubble and unhidden communication (see --json for the split). "
        "HFU actual counts recomputed FLOPs as really run.",
    ]
    notes.append(_flops_note(plan))
    if any(c.layout.recompute == "selective" for c in shown):
        notes.append(EQ8_NOTE)
    return tuple(notes)


def _flops_note(plan: Plan) -> str:
    counts = dict(batch=plan.workload.global_batch, seq_len=plan.workload.seq_len)
    model = model_flops(plan.shape, **counts)
    extra = {policy: hardware_flops(plan.shape, recompute=policy, **counts) / model - 1
             for policy in ("selective", "full")}
    eq8 = hardware_flops(plan.shape, recompute="selective", convention="paper-eq8", **counts) / model - 1
    if plan.shape.attention == "sdpa":
        return (f"Model FLOPs per iteration: {model:.3e}. Hardware FLOPs add {extra['full']:.1%} with full recompute. "
                "Attention is one fused kernel (no s x s tensor): selective recompute keeps and runs what no "
                "recompute does, so it is not listed beside it.")
    return (f"Model FLOPs per iteration: {model:.3e}. Hardware FLOPs add {extra['selective']:.1%} with selective "
            f"recompute (eq. 8 says {eq8:.1%}) and {extra['full']:.1%} with full recompute.")


def plan_json(plan: Plan, *, top: int | None = None) -> dict:
    shown = plan.candidates if top is None else (plan.fitting[:top] or plan.candidates[:top])
    return {
        "model": {**asdict(plan.shape), "parameters": total_params(plan.shape)},
        "cluster": asdict(plan.cluster),
        "workload": asdict(plan.workload),
        "assumptions": {"achieved_fraction": plan.achieved_fraction, "reserve_bytes": plan.reserve_bytes,
                        "memory_limit_bytes": plan.memory_limit, "throughput_model": THROUGHPUT_ASSUMPTIONS.strip(),
                        "hfu_eq8_note": EQ8_NOTE},
        "valid_layouts": len(plan.candidates),
        "fitting_layouts": len(plan.fitting),
        "skipped_combinations": plan.skipped,
        "layouts": [_candidate_json(c) for c in shown],
    }


def _candidate_json(candidate: Candidate) -> dict:
    return {
        "layout": asdict(candidate.layout),
        "label": candidate.layout.label(),
        "fits": candidate.fits,
        "peak_rank": candidate.peak.label,
        "memory_bytes": {budget.label: budget.as_dict() for budget in candidate.stages},
        "utilization": asdict(candidate.utilization),
        "communication_s": {**asdict(candidate.communication), "total": candidate.communication.total},
    }


def plan_bars(plan: Plan, *, top: int) -> list[tuple[str, dict[str, float]]]:
    shown = plan.fitting[:top] or plan.candidates[:top]
    return [(c.layout.label(), budget_in(c.peak, GIB)) for c in shown]


def budget_in(budget: MemoryBudget, unit: float) -> dict[str, float]:
    return {name: getattr(budget, name) / unit for name in GPU_BUCKETS}


def plot_plan(plan: Plan, *, top: int, path: str) -> None:
    plot_stacked_bars(
        plan_bars(plan, top=top), limit=plan.memory_limit / GIB,
        limit_label=f"{plan.cluster.gpu.name} memory ({plan.memory_limit / GIB:.1f} GiB)", unit="GiB per GPU",
        title=f"{plan.shape.name} on {plan.cluster.num_gpus} x {plan.cluster.gpu.name}: heaviest rank", path=path,
    )
