"""``sptransform plan``: per-rank memory and FLOPs budgets and the layouts that fit.

    sptransform plan --model gpt-175b --gpu A100-80G --gpus 64 --global-batch 64
    sptransform plan --model gpt-175b --gpus 64 --global-batch 64 --tp 8 --pp 8 \\
        --recompute selective --iteration-time 13.75      # MFU/HFU of a measured iteration
    sptransform plan --scenario deepseek-v3-chapter --plot budget.png
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from sptransform.planner.activations import PLANNED_POLICIES
from sptransform.planner.cluster import GIB, GPU_PRESETS, Cluster, custom_gpu, get_gpu
from sptransform.planner.deepseek_chapter import (
    CHAPTER_FIGURES, CHAPTER_UNITS, ChapterAssumptions, chapter_figures, chapter_walkthrough,
)
from sptransform.planner.flops import EQ8_NOTE, utilization
from sptransform.planner.memory import GPU_BUCKETS
from sptransform.planner.report import plan_json, plan_table, plot_plan
from sptransform.planner.search import DEFAULT_ACHIEVED_FRACTION, SEARCH_LIMITS, SearchSpace, plan
from sptransform.planner.tables import TextTable, plot_stacked_bars, print_table
from sptransform.planner.workload import StateBytes, Workload
from sptransform.planner.presets import MAX_SIZE, PRESETS
from sptransform.cli.args import (
    float_type, fraction, int_type, load_model, non_negative_float, positive_float, positive_int,
)

SCENARIOS = ("deepseek-v3-chapter",)


def register(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="memory/FLOPs budgets per rank and the layouts that fit",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(run=run)
    gpus = int_type(1, SEARCH_LIMITS["num_gpus"], why="the planner's search limit")
    what = parser.add_argument_group("model and cluster")
    what.add_argument("--model", help=f"a preset ({', '.join(sorted(PRESETS))}) or a HF config.json")
    what.add_argument("--scenario", choices=SCENARIOS, help="a worked example under its source's own assumptions")
    what.add_argument("--gpu", default="A100-80G", help=f"GPU preset: {', '.join(GPU_PRESETS)} (default A100-80G)")
    what.add_argument("--gpus", type=gpus, default=8,
                      help=f"GPUs in the cluster (default 8; at most {SEARCH_LIMITS['num_gpus']:,})")
    what.add_argument("--gpus-per-node", type=int_type(1, SEARCH_LIMITS["gpus_per_node"], why="the planner's search limit"),
                      default=8, help="GPUs sharing a node's NVLink; tensor parallelism stays inside one (default 8)")
    what.add_argument("--gpu-memory-gib", type=float_type(minimum=1e-3, maximum=2**20, example="80"),
                      help="override the GPU's memory (GiB, 0.001 to 1,048,576)")
    what.add_argument("--peak-tflops", type=float_type(minimum=1e-3, maximum=1e6, example="989"),
                      help="override the GPU's dense 16-bit peak (TFLOP/s, 0.001 to 1,000,000)")
    batch = parser.add_argument_group("workload")
    batch.add_argument("--global-batch", type=int_type(1, SEARCH_LIMITS["global_batch"], why="the planner's search limit"),
                       help=f"sequences per iteration over all replicas (required; at most {SEARCH_LIMITS['global_batch']:,})")
    batch.add_argument("--seq-len", type=int_type(1, MAX_SIZE, why="the largest sequence a model shape may have"),
                       help="tokens per sequence (default: the model's)")
    batch.add_argument("--ema", choices=("none", "gpu", "host"), default="none", help="fp32 EMA of the weights")
    batch.add_argument("--grad-bytes", type=float_type(minimum=0, maximum=64, example="2"), default=2,
                       help="bytes per gradient (2; 6 keeps an fp32 copy)")
    batch.add_argument("--optimizer-bytes", type=float_type(minimum=0, maximum=64, example="12"), default=12,
                       help="ZeRO's K (12 for mixed-precision Adam)")
    fixed = parser.add_argument_group("layout (each pins an axis of the search; several values allowed; "
                                      f"at most {SEARCH_LIMITS['layouts']:,} layouts are evaluated)")
    fixed.add_argument("--tp", type=gpus, nargs="+", help="tensor-parallel sizes (default: the divisors of --gpus-per-node)")
    fixed.add_argument("--pp", type=gpus, nargs="+", help="pipeline sizes (default: every one that divides)")
    fixed.add_argument("--zero", type=int, nargs="+", choices=(0, 1, 2, 3), default=(0, 1, 2, 3),
                       help="ZeRO stages (default: all four, each of which parallelize runs)")
    fixed.add_argument("--recompute", nargs="+", choices=PLANNED_POLICIES, default=PLANNED_POLICIES)
    fixed.add_argument("--micro-batch", type=positive_int, nargs="+", default=(1, 2, 4, 8))
    fixed.add_argument("--sp", choices=("on", "off", "both"), default="both", help="sequence parallelism")
    fixed.add_argument("--interleave", type=positive_int, nargs="+", default=(1,), help="model chunks per pipeline rank (m)")
    fixed.add_argument("--colocate-embedding-head", action="store_true",
                       help="embedding and head on the same pipeline rank")
    how = parser.add_argument_group("estimate and output")
    how.add_argument("--achieved", type=fraction, default=DEFAULT_ACHIEVED_FRACTION,
                     help=f"share of peak sustained on hardware FLOPs, in (0, 1] (default {DEFAULT_ACHIEVED_FRACTION})")
    how.add_argument("--reserve-gib", type=non_negative_float, default=0.0,
                     help="GPU memory kept free for the runtime (GiB, >= 0, below the GPU's memory; default 0)")
    how.add_argument("--iteration-time", type=positive_float,
                     help="a measured iteration time in seconds: report its MFU/HFU instead of searching")
    how.add_argument("--top", type=positive_int, default=10, help="layouts shown (default 10)")
    how.add_argument("--json", action="store_true", help="print JSON instead of a table")
    how.add_argument("--plot", metavar="FILE.png", help="stacked memory bars per layout with the GPU memory line")


def run(args) -> int:
    if args.scenario:
        return _run_chapter(args)
    if not args.model:
        raise ValueError("plan needs --model (a preset or a HF config.json) or --scenario")
    shape = load_model(args.model)
    gpu = custom_gpu(base=get_gpu(args.gpu), memory_gib=args.gpu_memory_gib, peak_tflops=args.peak_tflops)
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise ValueError(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node {args.gpus_per_node}: "
                         f"use a multiple of {args.gpus_per_node}")
    cluster = Cluster(gpu=gpu, num_gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    if args.global_batch is None:
        raise ValueError("plan needs --global-batch (sequences per iteration over all replicas)")
    if args.reserve_gib * GIB >= gpu.memory_bytes:
        raise ValueError(f"--reserve-gib {args.reserve_gib:g} leaves nothing of the {gpu.name}'s "
                         f"{gpu.memory_bytes / GIB:g} GiB: reserve less than that")
    workload = Workload(global_batch=args.global_batch, seq_len=shape.seq_len if args.seq_len is None else args.seq_len, ema=args.ema,
                        state_bytes=StateBytes(gradients=args.grad_bytes, optimizer=args.optimizer_bytes))
    if args.iteration_time is not None:
        return _run_measured(args, shape, cluster, workload)
    space = SearchSpace(
        tp=tuple(args.tp) if args.tp else None, pp=tuple(args.pp) if args.pp else None,
        zero_stages=tuple(args.zero), recompute=tuple(args.recompute), micro_batches=tuple(args.micro_batch),
        sequence_parallel={"on": (True,), "off": (False,), "both": (True, False)}[args.sp],
        interleave=tuple(args.interleave), colocate_embedding_head=args.colocate_embedding_head,
    )
    result = plan(shape, cluster=cluster, workload=workload, space=space, achieved_fraction=args.achieved,
                  reserve_bytes=args.reserve_gib * GIB)
    if args.json:
        print(json.dumps(plan_json(result, top=args.top), indent=2))
    else:
        print_table(plan_table(result, top=args.top))
    if args.plot:
        plot_plan(result, top=args.top, path=args.plot)
    return 0


def _run_measured(args, shape, cluster, workload) -> int:
    if len(args.recompute) != 1:
        raise ValueError("--iteration-time needs one --recompute policy (the one the measured run used), "
                         "e.g. --recompute selective")
    measured = utilization(shape, iteration_time_s=args.iteration_time, num_gpus=cluster.num_gpus,
                           peak_flops=cluster.gpu.peak_flops, global_batch=workload.global_batch,
                           seq_len=workload.seq_len, recompute=args.recompute[0])
    if measured.hfu > 1:
        raise ValueError(
            f"--iteration-time {args.iteration_time:g} s would run {100 * measured.hfu:.0f}% of the peak of "
            f"{cluster.num_gpus} x {cluster.gpu.name} ({cluster.gpu.peak_flops / 1e12:g} TFLOP/s each): "
            "no run is faster than its hardware; check --iteration-time, --gpus and --peak-tflops"
        )
    if args.json:
        print(json.dumps({"model": shape.name, "recompute": args.recompute[0], **asdict(measured),
                          "hfu_eq8_note": EQ8_NOTE}, indent=2))
        return 0
    rows = (
        ("model FLOPs / iteration", f"{measured.model_flops:.4e}"),
        ("hardware FLOPs, actual", f"{measured.hardware_flops:.4e}"),
        ("hardware FLOPs, paper eq. 8", f"{measured.hardware_flops_eq8:.4e}"),
        ("MFU", f"{100 * measured.mfu:.2f}%"),
        ("HFU eq.8", f"{100 * measured.hfu_eq8:.2f}%"),
        ("HFU actual", f"{100 * measured.hfu:.2f}%"),
        ("tokens/s", f"{measured.tokens_per_s:,.0f}"),
    )
    title = (f"{shape.name}, {workload.global_batch} x {workload.seq_len} tokens in {args.iteration_time} s on "
             f"{cluster.num_gpus} x {cluster.gpu.name} ({cluster.gpu.peak_flops / 1e12:.0f} TFLOP/s peak), "
             f"recompute={args.recompute[0]}")
    notes = (EQ8_NOTE,) if args.recompute[0] == "selective" else ()
    print_table(TextTable(title=title, columns=("quantity", "value"), rows=rows, notes=notes))
    return 0


def _run_chapter(args) -> int:
    budgets = chapter_walkthrough()
    figures = {name: chapter_figures(budget) for name, budget in budgets.items()}
    if args.json:
        print(json.dumps({"assumptions": asdict(ChapterAssumptions()),
                          "ours": figures, "chapter": CHAPTER_FIGURES,
                          "bytes": {name: b.as_dict() for name, b in budgets.items()}}, indent=2))
    else:
        unit_names = {1e9: "GB (1e9)", 2**30: "GB (2^30)"}
        rows = tuple(
            (name, unit_names[CHAPTER_UNITS[name]], f"{figures['before'][name]:.1f}",
             f"{CHAPTER_FIGURES['before'][name]:.1f}", f"{figures['after'][name]:.1f}",
             f"{CHAPTER_FIGURES['after'][name]:.1f}")
            for name in GPU_BUCKETS
        ) + (("total", "", f"{figures['before']['total']:.1f}", f"{CHAPTER_FIGURES['before']['total']:.1f}",
              f"{figures['after']['total']:.1f}", f"{CHAPTER_FIGURES['after']['total']:.1f}"),)
        print_table(TextTable(
            title="DeepSeek-V3 chapter walkthrough: 671B (37B active), pp=16, dp=64 ZeRO-1, no TP, s=4096, b=1",
            columns=("bucket", "chapter's unit", "ours before", "chapter before", "ours after", "chapter after"),
            rows=rows, right_aligned_from=2,
            notes=("After = selective recompute + EMA in host memory + shared, co-located embedding/head. "
                   "Buckets are rounded to 0.1 in the chapter's (mixed) units and then summed, as it does; "
                   f"host EMA per rank: {budgets['after'].ema_host / 1e9:.1f} GB.",),
        ))
    if args.plot:
        bars = [(name, {k: v for k, v in figures[name].items() if k != "total"}) for name in budgets]
        limit = ChapterAssumptions().gpu_memory_gb
        plot_stacked_bars(bars, limit=limit, limit_label=f"H800 {limit:.0f} GB", unit="GB (chapter's units)",
                          title="DeepSeek-V3 heaviest rank: before and after the three tricks", path=args.plot)
    return 0
