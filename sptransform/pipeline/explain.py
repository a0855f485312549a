"""``PipelinedModule.explain()``: stages, their layers and costs, cuts, tied weights, memory notes."""

from __future__ import annotations

from sptransform.options import ParallelOptions
from sptransform.pipeline.schedule import fully_stored, schedule_spec


def explain_pipeline(plan, options: ParallelOptions, pp_rank: int) -> str:
    pipeline = plan.options
    spec = schedule_spec(pipeline.schedule)
    lines = [
        f"sptransform pipeline: pp={pipeline.pp} x tp={options.tp} (sp={options.sp}), schedule={spec.name} "
        f"({spec.torch_class.__name__}), {pipeline.num_stages} stages ({pipeline.virtual} per rank, "
        f"{spec.placement} placement), n_microbatches={pipeline.n_microbatches}",
        f"{plan.num_layers} layers ({plan.found}); balanced on measured cost per microbatch (time = 3 x forward FLOPs + "
        "elementwise; saved activation bytes x microbatches in flight):",
        f"  {'stage':>5} {'rank':>4} {'layers':>9} {'time':>14} {'saved/mb':>12} {'in flight':>9} {'peak saved':>12} "
        f"{'sends':>10}",
    ]
    ends = plan.starts[1:] + [plan.num_layers]
    for stage, start, end in zip(plan.stages, plan.starts, ends):
        costs = plan.costs[start:end]
        time = sum(c.time for c in costs)
        saved = sum(c.activation_bytes for c in costs)
        held = plan.inflight[stage.index]
        mark = " *" if plan.stage_rank[stage.index] == pp_rank else ""
        lines.append(
            f"  {stage.index:>5} {plan.stage_rank[stage.index]:>4} {f'{start}-{end - 1}':>9} {time:>14,} "
            f"{saved:>12,} {held:>9} {saved * held:>12,} {stage.sent_bytes:>10,}{mark}"
        )
    lines.append("  (* this rank's stages; sends: bytes of activations sent per microbatch)")
    lines.append("cuts (tensors crossing, per microbatch):")
    for start in plan.starts[1:]:
        b = plan.boundaries[start - 1]
        names = ", ".join(n.name for n in b.crossing)
        lines.append(f"  before layer {b.layer:>3}: {names} ({b.nbytes:,} B)")
    if not plan.tied:
        lines.append("tied parameters: none")
    for tied in plan.tied:
        if tied.colocated:
            lines.append(
                f"tied parameter {tied.name}: stages {tied.stages} share pipeline rank {tied.ranks[0]} "
                "(co-located): one copy, its gradient accumulates from both"
            )
        else:
            lines.append(
                f"tied parameter {tied.name}: stages {tied.stages} on pipeline ranks {tied.ranks} "
                f"(schedule {spec.name!r} cannot co-locate them; 'zbv' can): one copy per rank, gradients "
                "summed over those ranks every step"
            )
    if spec.waits_each_send:
        lines.append(
            "memory: each stage's forward outputs are freed once sent (sent from a copy that 1F1B drops at its "
            "next send); torch alone keeps them until that microbatch's backward"
        )
    else:
        lines.append(
            f"memory: forward outputs are kept until their backward: {spec.torch_class.__name__} waits on sends "
            "only after all forwards (GPipe) or at the end of the step, so sending from a copy would not free sooner"
        )
    if options.recompute != "none":
        lines.append(f"recompute: each stage's graph is partitioned with recompute={options.recompute!r} "
                     "(compiled on its first forward)")
    if pipeline.stored_microbatches is not None:
        stored = fully_stored(pipeline)
        lines.append(f"microbatch-level recompute (window of {pipeline.stored_microbatches}): microbatches that keep "
                     "every activation, per stage; the others run the recompute policy:")
        lines.extend(f"  stage {i}: {sorted(s) if s else 'none'}" for i, s in enumerate(stored))
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)
