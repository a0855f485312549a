"""``sptransform flops``: per-op FLOPs, bytes moved and arithmetic intensity of one
layer, for training and for one-token decode, with compute time against memory
time on a GPU.

    sptransform flops --model gpt-13b --seq-len 4096 --gpu A100-80G
    sptransform flops --model gpt-1.3b --seq-len 4096 --heads-as-one   # the tutorial's tables
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from sptransform.planner.cluster import GPU_PRESETS, get_gpu
from sptransform.planner.opflops import RooflineRow, layer_ops, roofline
from sptransform.planner.tables import TextTable, print_table
from sptransform.planner.presets import MAX_SIZE, PRESETS
from sptransform.cli.args import int_type, load_model


def register(subparsers) -> None:
    parser = subparsers.add_parser("flops", help="per-op roofline of one layer (training and decode)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(run=run)
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(sorted(PRESETS))}) or a HF config.json")
    parser.add_argument("--gpu", default="A100-80G", help=f"{', '.join(GPU_PRESETS)} (default A100-80G)")
    parser.add_argument("--seq-len", type=int_type(1, MAX_SIZE, why="the largest sequence a model shape may have"),
                        help="sequence (training) or KV-cache (decode) length; default: the model's")
    parser.add_argument("--batch", type=int_type(1, MAX_SIZE, why="the largest batch counted"), default=1,
                        help="sequences (default 1)")
    parser.add_argument("--mode", choices=("train", "decode", "both"), default="both")
    parser.add_argument("--heads-as-one", action="store_true",
                        help="attention as one [s,h]x[h,s] product, as the tutorial's tables count it")
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    shape = load_model(args.model)
    gpu = get_gpu(args.gpu)
    seq_len = args.seq_len if args.seq_len is not None else shape.seq_len
    modes = ("train", "decode") if args.mode == "both" else (args.mode,)
    tables = {mode: roofline(layer_ops(shape, mode=mode, batch=args.batch, seq_len=seq_len,
                                       heads_as_one=args.heads_as_one), gpu) for mode in modes}
    if args.json:
        print(json.dumps({mode: [_row_json(row) for row in rows] for mode, rows in tables.items()}, indent=2))
        return 0
    ridge = gpu.peak_flops / gpu.memory_bandwidth
    for mode, rows in tables.items():
        what = (f"forward over {args.batch} x {seq_len} tokens" if mode == "train"
                else f"one new token per sequence, batch {args.batch}, KV cache {seq_len}")
        gemm_flops = sum(row.op.flops for row in rows if row.op.is_matmul)
        print_table(TextTable(
            title=f"{shape.name} layer, {mode}: {what}, on {gpu.name} "
                  f"({gpu.peak_flops / 1e12:.0f} TFLOP/s, {gpu.memory_bandwidth / 1e12:.3g} TB/s)",
            columns=("op", "dims", "FLOPs", "elements moved", "FLOP/byte", "compute us", "memory us", "bound"),
            rows=tuple(_row_text(row) for row in rows), right_aligned_from=2,
            notes=(f"Ridge point {ridge:.0f} FLOP/byte: ops below it are memory-bound. "
                   + (f"Training this layer (fwd + bwd) runs {3 * gemm_flops:.4e} GEMM FLOPs."
                      if mode == "train" else ""),),
        ))
    return 0


def _row_text(row: RooflineRow) -> tuple[str, ...]:
    op = row.op
    return (op.name, op.dims, f"{op.flops:.0f}", f"{op.elements_moved:.0f}", f"{op.intensity:.1f}",
            f"{row.compute_s * 1e6:.4f}", f"{row.memory_s * 1e6:.4f}", row.bound)


def _row_json(row: RooflineRow) -> dict:
    return {**asdict(row.op), "bytes_moved": row.op.bytes_moved, "intensity": row.op.intensity,
            "compute_s": row.compute_s, "memory_s": row.memory_s, "bound": row.bound}
