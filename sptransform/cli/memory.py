"""``sptransform memory``: activation memory and FLOPs of one rank, measured on the partitioned graph.

    sptransform memory --model gpt-175b --recompute selective
    sptransform memory --model gpt-530b --tp 8 --sp --recompute selective --json
    sptransform memory --model gpt2 --seq 1024 --batch 4 --dtype fp32 --recompute budget --budget 0.5
    sptransform memory --model path/to/config.json --recompute full
    sptransform memory --model gpt-175b --tp 8 --sp --recompute selective --pp 8 --microbatches 8

Two layers of the model are traced under fake tensors (nothing is allocated; a 1T
model takes seconds on a laptop CPU), partitioned with the chosen recompute policy,
and measured: bytes saved for backward per layer by region beside Korthikanti et
al.'s Table 2, the peak of live bytes during backward, and model vs hardware FLOPs
per layer (the difference of the two- and one-layer graphs).

With ``--pp`` the measured bytes are laid out on a pipeline: the layers split evenly
over the stages (the first stages take one more when they do not divide), what lies
before the first layer (embedding) on the first stage and the rest (final norm, head,
loss) on the last, and the schedule's own order (``--schedule``, ``--microbatches``)
says how many microbatches each stage holds at once; each rank's peak is reported.
``--stored-microbatches K`` adds microbatch-level recomputation (Korthikanti et al.,
Appendix C): the model is traced once more without recomputation, and within each
stage's moving window of K in-flight microbatches a microbatch keeps those bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time

from sptransform.cli.args import (
    PIPELINE_LIMITS, BadValue, check_pipeline_size, int_type, load_model, non_negative_int, schedule_and_stages,
)
from sptransform.planner.presets import MAX_SIZE, PRESETS
from sptransform.planner.tables import TextTable, print_table

# the measuring modules (torch, AOTAutograd, networkx) load when the command runs, not when
# the CLI builds its parsers
DTYPES = ("bf16", "fp16", "fp32")
POLICIES = ("none", "selective", "full", "norm_upproj", "budget")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "memory", help="activation memory and FLOPs of one rank, measured on the partitioned graph",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(run=run)
    limits = PIPELINE_LIMITS
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(sorted(PRESETS))}) or a HF config.json")
    parser.add_argument("--tp", type=int_type(1, MAX_SIZE), default=1,
                        help="tensor-parallel degree, dividing the heads (default 1)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    parser.add_argument("--recompute", default="none", help=f"{', '.join(POLICIES)} (default none)")
    parser.add_argument("--recompute-collectives", action="store_true",
                        help="let recomputation re-run collectives (Megatron's full recompute does)")
    parser.add_argument("--recompute-fusible", action="store_true",
                        help="let every policy recompute memory-bound ops (pointwise, norms, softmax) where that "
                             "keeps fewer bytes, as the partition for training does (RematOptions' default) and "
                             "torch.compile's min cut does; without it the report counts as eager PyTorch and the "
                             "paper's Table 2 do")
    parser.add_argument("--budget", type=parse_budget,
                        help="with --recompute budget: bytes per rank, a whole number with or without a unit "
                             "(12GiB, 3e9, 1500000000), or a fraction in (0, 1] (0.5) of the way from the smallest "
                             "feasible partition to 'none'")
    parser.add_argument("--seq", type=int_type(1, MAX_SIZE), help="sequence length (default: the model's)")
    parser.add_argument("--batch", type=int_type(1, MAX_SIZE),
                        help="micro-batch (default: the paper's for its models, else 1)")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES, help="default bf16")
    parser.add_argument("--pp", type=int_type(1, limits["pp"], why="the schedule is simulated action by action"),
                        default=1, help=f"pipeline ranks: report each rank's peak (default 1, at most {limits['pp']})")
    parser.add_argument("--microbatches", type=int_type(1, limits["microbatches"], why="the schedule is simulated"),
                        help=f"with --pp: microbatches per step (default: pp; at most {limits['microbatches']})")
    parser.add_argument("--schedule", default="1f1b", help="with --pp: gpipe, 1f1b, interleaved1f1b, looped_bfs or zbv")
    parser.add_argument("--stages-per-rank", type=int_type(1, limits["stages_per_rank"], why="the schedule is simulated"),
                        help="with --pp: virtual stages per rank (default: the schedule's)")
    parser.add_argument("--stored-microbatches", type=non_negative_int,
                        help="with --pp and a --recompute policy: microbatches per stage that keep every activation "
                             "(a moving window; the paper's Appendix C)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.epilog = (
        f"Limits: pp x stages-per-rank x microbatches <= {limits['stage_microbatches']:,} for gpipe/1f1b and "
        f"<= {limits['stage_microbatches_torch']:,} for interleaved1f1b/looped_bfs/zbv; the largest activation of "
        f"one microbatch (e.g. the logits, batch x seq x vocab) at most 2^{MAX_TRACED_ELEMENTS.bit_length() - 1} "
        "elements."
    )


_BUDGET_HELP = ("give bytes as a whole number, with or without a unit (1500000000, 3e9, 1.5GB, 12GiB), "
                "or a fraction of what 'none' keeps, in (0, 1] (0.5)")


def parse_budget(text: str | None) -> int | float | None:
    """``--budget``: ``"0.5"`` -> a fraction of 'none' (a plain number in (0, 1]); ``"12GiB"``,
    ``"3e9"`` or ``"1200000"`` -> bytes (a unit, or a plain number above 1, which must then be a
    whole number: ``"1.5"`` is an error, neither a fraction nor a byte count)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise BadValue(f"{text!r} is not a memory budget: {_BUDGET_HELP}")
    try:
        number = float(match.group(1))
    except ValueError:
        raise BadValue(f"{text!r} is not a memory budget: {_BUDGET_HELP}") from None
    if not math.isfinite(number) or number <= 0:
        raise BadValue(f"{text!r} is not a positive finite budget: {_BUDGET_HELP}")
    if not unit and number <= 1:
        return number
    value = number * _UNITS[unit]
    if value != math.floor(value):
        raise BadValue(f"{text!r} is ambiguous: neither a fraction of 'none' (those are in (0, 1]) nor a whole "
                       f"number of bytes; {_BUDGET_HELP}")
    if value > 2**62:
        raise BadValue(f"{text!r} is far more bytes than any GPU holds: {_BUDGET_HELP}")
    return int(value)


def run(args) -> int:
    import torch

    from sptransform.measure.layer import layer_flops, measure_shape
    from sptransform.passes.remat import RematOptions

    if args.recompute not in POLICIES:
        raise ValueError(f"--recompute {args.recompute!r} is not a policy sptransform memory runs: "
                         f"use one of {list(POLICIES)}")
    if args.recompute == "budget" and args.budget is None:
        raise ValueError(f"--recompute budget needs --budget: {_BUDGET_HELP}")
    if args.budget is not None and args.recompute != "budget":
        raise ValueError(f"--budget {args.budget:g} only applies with --recompute budget, not --recompute "
                         f"{args.recompute}: add --recompute budget or drop --budget")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype={args.dtype!r}: use one of {list(DTYPES)}")
    shape = load_model(args.model)
    batch = args.batch if args.batch is not None else shape.paper_layout.get("micro_batch", 1)
    seq = args.seq if args.seq is not None else shape.seq_len
    check_measurable(shape, tp=args.tp, sp=args.sp, seq=seq, batch=batch)
    pipelined = args.pp > 1 or args.microbatches is not None or args.stages_per_rank is not None
    stored = args.stored_microbatches
    if stored is not None and (args.pp < 2 or args.recompute == "none"):
        raise ValueError(f"--stored-microbatches {stored} chooses which pipeline microbatches skip recomputation: "
                         "give --pp > 1 and a --recompute policy")
    microbatches = args.microbatches if args.microbatches is not None else args.pp
    if pipelined:
        check_pipeline(shape, pp=args.pp, microbatches=microbatches, schedule=args.schedule,
                       stages_per_rank=args.stages_per_rank)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    options = RematOptions(policy=args.recompute, budget=args.budget, recompute_collectives=args.recompute_collectives,
                           recompute_fusible=args.recompute_fusible)
    start = time.perf_counter()
    measured = measure_shape(shape, options=options, seq=seq, batch=batch, dtype=dtype,
                             tp=args.tp, sp=args.sp, num_layers=2)
    flops = layer_flops(measured)
    elapsed = time.perf_counter() - start
    report = summarize(measured, flops, elapsed)
    if pipelined:
        everything = None
        if stored is not None:  # what a microbatch that keeps every activation holds
            everything = measure_shape(shape, options=RematOptions(policy="none", recompute_fusible=args.recompute_fusible),
                                       seq=seq, batch=batch,
                                       dtype=dtype, tp=args.tp, sp=args.sp, num_layers=2)
        report["pipeline"] = pipeline_memory(measured, pp=args.pp, microbatches=microbatches,
                                             schedule=args.schedule, stages_per_rank=args.stages_per_rank,
                                             stored_microbatches=stored, fully_stored=everything)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


MAX_TRACED_ELEMENTS = 2**50
"""The most elements one traced activation may have (fake tensors index with int64; this leaves
room for the bytes of fp32 copies)."""


def check_measurable(shape, *, tp: int, sp: bool, seq: int, batch: int) -> None:
    """The rules of ``measure_shape`` worded with the command's flags, checked before tracing."""
    if shape.num_heads % tp or shape.kv_heads % tp:
        fitting = [t for t in range(1, shape.kv_heads + 1) if shape.num_heads % t == 0 and shape.kv_heads % t == 0]
        raise ValueError(f"--tp {tp} does not divide the {shape.num_heads} attention heads / {shape.kv_heads} K/V "
                         f"heads of {shape.name!r} (tensor parallelism splits whole heads): use --tp in {fitting}")
    if sp and tp == 1:
        raise ValueError("--sp needs --tp > 1 (sequence parallelism splits the sequence over the tensor-parallel "
                         "ranks): add --tp, or drop --sp")
    if sp and seq % tp:
        raise ValueError(f"--seq {seq} is not divisible by --tp {tp}; sequence parallelism splits the sequence "
                         f"evenly: use a multiple of {tp}, or drop --sp")
    if shape.position == "learned" and seq > shape.seq_len:
        raise ValueError(f"--seq {seq} is longer than the {shape.seq_len} learned positions of {shape.name!r}: "
                         f"use --seq <= {shape.seq_len}")
    tensors = {"logits [batch, seq, vocab]": batch * seq * shape.vocab_size,
               "MLP activations [batch, seq, ffn]": batch * seq * shape.ffn * 2,
               "QKV projections [batch, seq, 3 x hidden]": batch * seq * 3 * shape.hidden}
    if shape.attention == "explicit":
        tensors["attention scores [batch, heads, seq, seq]"] = batch * shape.num_heads * seq * seq
    name, elements = max(tensors.items(), key=lambda item: item[1])
    if elements > MAX_TRACED_ELEMENTS:
        raise ValueError(f"--batch {batch} x --seq {seq}: the {name} of {shape.name!r} would hold {elements:.3g} "
                         f"elements, more than the 2^{MAX_TRACED_ELEMENTS.bit_length() - 1} a traced tensor may "
                         "have here: use a smaller --seq or --batch")


def check_pipeline(shape, *, pp: int, microbatches: int, schedule: str, stages_per_rank: int | None) -> None:
    """``--pp``, ``--microbatches``, ``--schedule`` and ``--stages-per-rank`` checked before tracing."""
    spec, v = schedule_and_stages(schedule, stages_per_rank)
    check_pipeline_size(pp, microbatches, v, spec.name)
    if pp * v > shape.num_layers:
        raise ValueError(f"{shape.name} has {shape.num_layers} layers, fewer than --pp x stages per rank = "
                         f"{pp} x {v} = {pp * v} stages: use pp x stages_per_rank <= {shape.num_layers}")


def pipeline_memory(m, *, pp: int, microbatches: int, schedule: str, stages_per_rank: int | None,
                    stored_microbatches: int | None = None, fully_stored=None) -> dict:
    """Each pipeline rank's activation bytes over one step of ``schedule``, from the measured
    per-layer and embedding/head bytes (``m``: a ``Measurement`` of one microbatch). With
    ``stored_microbatches`` the microbatches in each stage's window keep the bytes of
    ``fully_stored`` (the same model measured without recomputation)."""
    from sptransform.pipeline.schedule import (
        check_stages_per_rank, fully_stored_microbatches, memory_timeline, pipeline_order, schedule_spec, simulate,
        stage_ranks,
    )

    if pp < 1 or microbatches < 1:
        raise ValueError(f"--pp {pp} and --microbatches {microbatches} must be at least 1")
    spec = schedule_spec(schedule)
    v = stages_per_rank if stages_per_rank is not None else spec.default_stages_per_rank
    check_stages_per_rank(spec, v)
    stages, layers = pp * v, m.shape.num_layers
    if layers < stages:
        raise ValueError(f"{m.shape.name} has {layers} layers, fewer than pp x stages_per_rank = {stages} stages: "
                         f"use pp x stages_per_rank <= {layers}")
    per_stage = [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]

    def bytes_per_stage(measured) -> list[float]:
        embedding, head = measured.memory.embedding_and_head_bytes()
        out = [n * measured.layer_bytes() for n in per_stage]
        out[0] += embedding
        out[-1] += head
        return out

    stage_bytes = bytes_per_stage(m)
    order = pipeline_order(spec, pp, v, microbatches)
    size = stage_bytes
    stored = [set() for _ in range(stages)]
    if stored_microbatches is not None:
        if fully_stored is None:
            raise ValueError("stored_microbatches needs fully_stored= the measurement without recomputation")
        stored = fully_stored_microbatches(order, stages, stored_microbatches)
        kept_all = bytes_per_stage(fully_stored)

        def size(stage: int, microbatch: int) -> float:
            return kept_all[stage] if microbatch in stored[stage] else stage_bytes[stage]

    timeline = memory_timeline(simulate(order, stages), pp, size)
    owner = stage_ranks(spec, pp, v)
    embedding, head = m.memory.embedding_and_head_bytes()
    ranks = []
    for rank in range(pp):
        mine = [s for s in range(stages) if owner[s] == rank]
        ranks.append({
            "rank": rank, "stages": mine, "layers": sum(per_stage[s] for s in mine),
            "bytes_per_microbatch": sum(stage_bytes[s] for s in mine),
            "peak_bytes": max(level for _, level in timeline[rank]),
            "recomputed_microbatches": sum(microbatches - len(stored[s]) for s in mine)
            if stored_microbatches is not None else None,
        })
    return {"pp": pp, "schedule": spec.name, "stages_per_rank": v, "microbatches": microbatches,
            "stored_microbatches": stored_microbatches, "layers_per_stage": per_stage,
            "embedding_bytes": embedding, "head_bytes": head, "ranks": ranks}


def summarize(m, flops, elapsed: float) -> dict:
    """Everything the command prints, as plain values (``m``: a ``Measurement``)."""
    from sptransform.measure.memory import paper_row_name
    from sptransform.graph.regions import REGIONS

    per_layer = m.memory.per_layer()
    paper = m.paper()
    s, h = m.seq, m.shape.hidden
    model_layer, hardware_layer = flops.model_flops, flops.hardware_flops
    return {
        "model": m.shape.name, "tp": m.tp, "sp": m.sp, "recompute": m.options.policy, "budget": m.options.budget,
        "seq": s, "batch": m.batch, "dtype": str(m.dtype).replace("torch.", ""), "sbh": m.sbh,
        "traced_layers": m.memory.num_layers, "seconds": round(elapsed, 2),
        "per_layer_bytes": {r: per_layer[r] for r in REGIONS},
        "per_layer_total": sum(per_layer.values()),
        "paper_row": paper_row_name(m.tp, m.sp, m.options.policy) if paper else None,
        "paper_per_layer_bytes": paper,
        "paper_per_layer_total": sum(paper.values()) if paper else None,
        "outside_layers_bytes": m.memory.outside_layers(),
        "model_total_bytes": m.model_bytes(),
        "num_layers": m.shape.num_layers,
        "peak_backward_bytes": m.memory.peak_backward,
        "flops_per_layer": {
            "model": model_layer, "hardware": hardware_layer, "recompute": hardware_layer - model_layer,
            "overhead": hardware_layer / model_layer - 1 if model_layer else None,
            "paper_eq9_overhead": s / (6 * h) if m.options.policy == "selective" else None,
            "paper_appendix_a_overhead": (s / (18 * h)) / (1 + s / (6 * h)) if m.options.policy == "selective" else None,
        },
        "notes": m.memory.notes,
    }


def _gib(x: float) -> str:
    return f"{x / 2**30:,.3f} GiB"


def print_report(r: dict) -> None:
    from sptransform.graph.regions import REGIONS

    sbh = r["sbh"]
    paper = r["paper_per_layer_bytes"] or {}
    rows = []
    for region in REGIONS:
        measured, expected = r["per_layer_bytes"][region], paper.get(region)
        if not measured and not expected:
            continue
        rows.append((region, f"{measured:,.0f}", f"{measured / sbh:.4f}",
                     "" if expected is None else f"{expected:,.0f}", "" if expected is None else f"{expected / sbh:.4f}"))
    total, expected_total = r["per_layer_total"], r["paper_per_layer_total"]
    rows.append(("total per layer", f"{total:,.0f}", f"{total / sbh:.4f}",
                 "" if expected_total is None else f"{expected_total:,.0f}",
                 "" if expected_total is None else f"{expected_total / sbh:.4f}"))
    f = r["flops_per_layer"]
    notes = [
        f"paper row: {r['paper_row'] or 'none for this policy or model'}"
        + ("" if expected_total is None else f"; measured/paper = {total / expected_total:.5f}"),
        f"outside the layers (embedding, final norm, head, loss): {_gib(sum(r['outside_layers_bytes'].values()))}",
        f"whole model ({r['num_layers']} layers, one micro-batch): {_gib(r['model_total_bytes'])}",
        f"peak live bytes during backward (traced {r['traced_layers']} layers): {_gib(r['peak_backward_bytes'])}",
        f"FLOPs per layer: model {f['model']:.4e}, hardware {f['hardware']:.4e}, recompute {f['recompute']:.4e}"
        + (f" ({100 * f['overhead']:.3f}%)" if f["overhead"] is not None else ""),
    ]
    if f["paper_eq9_overhead"] is not None:
        notes.append(f"paper's selective overhead: eq. 8-9 s/6h = {100 * f['paper_eq9_overhead']:.3f}%, "
                     f"its Appendix A text (one more QK^T and AV) = {100 * f['paper_appendix_a_overhead']:.3f}%")
    notes += [f"note: {n}" for n in r["notes"]]
    title = (f"{r['model']}: bytes saved for backward per layer, one rank (tp={r['tp']}{', sp' if r['sp'] else ''}, "
             f"recompute={r['recompute']}, s={r['seq']}, b={r['batch']}, {r['dtype']}; traced in {r['seconds']} s)")
    print_table(TextTable(title=title, columns=("region", "measured B", "x sbh", "paper B", "x sbh"),
                          rows=tuple(rows), notes=tuple(notes)))
    if "pipeline" in r:
        print_pipeline(r["pipeline"], sbh)


def print_pipeline(p: dict, sbh: int) -> None:
    rows = tuple(
        (str(x["rank"]), ",".join(map(str, x["stages"])), str(x["layers"]), _gib(x["bytes_per_microbatch"]),
         _gib(x["peak_bytes"]), f"{x['peak_bytes'] / x['bytes_per_microbatch']:.2f}", f"{x['peak_bytes'] / sbh:,.1f}")
        for x in p["ranks"]
    )
    notes = (
        f"layers per stage {p['layers_per_stage']}; embedding {_gib(p['embedding_bytes'])} on stage 0, "
        f"final norm + head + loss {_gib(p['head_bytes'])} on stage {len(p['layers_per_stage']) - 1}",
        "peak: most bytes held at once over one step in the schedule's own order (a forward adds its stage's "
        "bytes, its backward frees them)",
    )
    if p["stored_microbatches"] is not None:
        notes += (f"microbatch-level recompute, window {p['stored_microbatches']}: microbatch-stages recomputed per "
                  f"rank {[x['recomputed_microbatches'] for x in p['ranks']]} of "
                  f"{p['microbatches'] * p['stages_per_rank']}; the others keep every activation",)
    title = (f"pipeline: pp={p['pp']}, {p['schedule']}, {p['stages_per_rank']} stage(s) per rank, "
             f"{p['microbatches']} microbatches: activation bytes per rank")
    print_table(TextTable(title=title, columns=("rank", "stages", "layers", "per microbatch", "peak", "peak / mb",
                                                "peak x sbh"), rows=rows, notes=notes))
