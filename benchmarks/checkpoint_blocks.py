"""Which blocks to checkpoint, measured on the graph (the checkpointing notebook's question).

For the GPT-2 family, each layer is traced under fake tensors (nothing allocated) and its
joint graph partitioned with ``policy="blocks"``: a checkpointed block keeps only its
input and recomputes its body, as ``torch.utils.checkpoint`` of that block would. The
table gives the bytes saved for backward per layer and for the whole stack, measured on
the partitioned graph, instead of the notebook's parameter-count proxy.

    python benchmarks/checkpoint_blocks.py [--seq 1024] [--batch 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sptransform.measure.layer import measure_shape  # noqa: E402
from sptransform.passes.remat import RematOptions  # noqa: E402
from sptransform.planner.presets import PRESETS  # noqa: E402

CHOICES = {
    "nothing": RematOptions(policy="none"),
    "attention": RematOptions(policy="blocks", blocks=("attention",)),
    "mlp": RematOptions(policy="blocks", blocks=("mlp",)),
    "attention+mlp": RematOptions(policy="blocks", blocks=("attention", "mlp")),
    "whole layer": RematOptions(policy="full"),
}


def family(seq: int | None):
    # the notebook's gpt2-tiny is 2 layers of width 256 at n_ctx 128
    yield "gpt2-tiny", PRESETS["gpt2-tiny"].with_(hidden=256, seq_len=128)
    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        yield name, PRESETS[name]


def measure(seq: int | None, batch: int) -> list[dict]:
    rows = []
    for name, shape in family(seq):
        s = seq or shape.seq_len
        layer = {c: measure_shape(shape, options=o, seq=s, batch=batch, dtype=torch.bfloat16).layer_bytes()
                 for c, o in CHOICES.items()}
        for choice, per_layer in layer.items():
            rows.append(dict(model=name, seq=s, layers=shape.num_layers, checkpoint=choice, bytes_per_layer=per_layer,
                             stack_bytes=per_layer * shape.num_layers,
                             saving=1 - per_layer / layer["nothing"]))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: each model's n_ctx)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    rows = measure(args.seq, args.batch)
    print(f"bytes saved for backward, bf16, batch {args.batch}, measured on the partitioned graph")
    print(f"{'model':<12} {'seq':>5} {'checkpoint':<14} {'MiB / layer':>12} {'MiB / stack':>12} {'saving':>8}")
    for r in rows:
        print(f"{r['model']:<12} {r['seq']:>5} {r['checkpoint']:<14} {r['bytes_per_layer'] / 2**20:>12.2f} "
              f"{r['stack_bytes'] / 2**20:>12.1f} {r['saving']:>7.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
