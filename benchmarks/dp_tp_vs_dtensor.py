"""sptransform dp x tp against DTensor on a 2-D mesh (tensor-parallel plan + ``replicate`` or
``fully_shard`` on the data-parallel axis), on HF GPT-2.

One invocation spawns ``dp * tp`` ranks (gloo, CPU; default 2 x 2 = 4, consecutive ranks form a
tensor-parallel group) and trains, each data-parallel replica on its own batch:

* sptransform ``parallelize(model, tp=tp, dp=dp, zero=z, sp=...)`` on the unmodified model, for
  each ``--zero`` stage;
* the anchor of each stage: the Linear-edited GPT-2 of ``tp_vs_dtensor.py`` with its
  torchtitan-style plan on the ``"tp"`` axis of a ``(dp, tp)`` mesh, then on the ``"dp"`` axis
  torch's ``replicate`` (the FSDP2-based one, ``torch.distributed._composable.replicate_with_fsdp``:
  gradients averaged, for ``zero=0``) or ``fully_shard`` (for ``zero=3``; with
  ``reshard_after_forward=False`` for ``zero=2``), per block and at the root, under
  ``loss_parallel``;
* ``--compiled``: the same pairs again under ``torch.compile`` (``torch.compile(pm)``, and
  ``torch.compile`` of the anchor model; default inductor backend).

Every side's loss is the mean over the replicas (the whole global batch's), beside the
single-device model trained on the concatenated batch with the same AdamW. The table is the one of
``tp_vs_dtensor.py`` (``run_sides``: sides interleaved step by step, each step's time the slowest
rank's; collectives, waits, ``fill_`` and peak memory from one profiled step of rank 0). With the
default 4 ranks on a 2-core machine, two ranks share each core: the times are the machine's, not
the method's.

    python benchmarks/dp_tp_vs_dtensor.py [--dp 2 --tp 2 --layers 2 --hidden 64 --heads 4
        --vocab 1024 --seq 64 --batch 2 --steps 5 --warmup 1 --zero 0 3] [--sp] [--compiled]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_vs_dtensor import (  # noqa: E402  (the harness lives beside this file)
    Side, common_args, dtensor_gpt2, finish, gpt2, launch, linearize_gpt2, log, run_sides, summary_table,
)

ANCHORS = {0: "replicate", 2: "fully_shard(reshard_after_forward=False)", 3: "fully_shard"}


def replica_batch(args: argparse.Namespace, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed + 1 + replica)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return ids, ids.clone()


def single_device_losses(model: nn.Module, args: argparse.Namespace, steps: int) -> list[float]:
    """The unmodified model on the replicas' batches concatenated, same AdamW: what every side should match."""
    model = copy.deepcopy(model)
    ids = torch.cat([replica_batch(args, r)[0] for r in range(args.dp)])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def anchor_model(edited: nn.Module, args: argparse.Namespace, zero: int) -> nn.Module:
    """The tp plan on the mesh's "tp" axis, then ``replicate``/``fully_shard`` on its "dp" axis."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    model = dtensor_gpt2(copy.deepcopy(edited), args.tp, args.sp, mesh=mesh["tp"])
    if zero == 0:
        wrap = lambda m: replicate(m, mesh=mesh["dp"])  # noqa: E731
    else:
        wrap = lambda m: fully_shard(m, mesh=mesh["dp"], reshard_after_forward=zero == 3)  # noqa: E731
    for block in model.transformer.h:
        wrap(block)
    wrap(model)
    return model


def side_name(zero: int, compiled: bool, args: argparse.Namespace, ours: bool) -> str:
    sp = f"sp={args.sp}"
    if ours:
        return f"sptransform dp={args.dp} tp={args.tp} {sp} zero={zero}" + (" torch.compile(pm)" if compiled else "")
    return f"DTensor tp {sp} + {ANCHORS[zero]}" + (" + torch.compile" if compiled else "")


def worker(args: argparse.Namespace) -> dict:
    import sptransform
    from torch.distributed.tensor.parallel import loss_parallel

    replica = dist.get_rank() // args.tp
    ids, labels = replica_batch(args, replica)
    base = gpt2(args)
    edited = linearize_gpt2(base)
    reference = single_device_losses(base, args, args.warmup + 1 + args.steps)
    log(f"single device: first loss {reference[0]:.6f}, last {reference[-1]:.6f}")

    def hf_loss(m):
        return m(input_ids=ids, labels=labels, use_cache=False).loss

    def ours(zero: int, compiled: bool):
        def make() -> Side:
            pm = sptransform.parallelize(copy.deepcopy(base), tp=args.tp, dp=args.dp, zero=zero, sp=args.sp,
                                         example_inputs={"input_ids": ids, "labels": labels, "use_cache": False})
            run = torch.compile(pm) if compiled else pm
            return Side(make.side_name, pm, lambda m: hf_loss(run), note="unmodified HF GPT-2",
                        count_collectives=not compiled, loss_mean_over_ranks=True)
        make.side_name = side_name(zero, compiled, args, ours=True)
        return make

    def theirs(zero: int, compiled: bool):
        def make() -> Side:
            model = anchor_model(edited, args, zero)
            run = torch.compile(model) if compiled else model
            return Side(make.side_name, model, lambda m: hf_loss(run), context=loss_parallel,
                        note="Conv1D->nn.Linear, c_attn->q/k/v", count_collectives=not compiled,
                        loss_mean_over_ranks=True)
        make.side_name = side_name(zero, compiled, args, ours=False)
        return make

    modes = (False, True) if args.compiled else (False,)
    makers = [make(zero, compiled) for compiled in modes for zero in args.zero for make in (ours, theirs)]
    if args.sides:
        makers = [m for m in makers if any(word in m.side_name for word in args.sides)]
    results = run_sides(makers, steps=args.steps, warmup=args.warmup, lr=args.lr, profile=True)
    return {"config": vars(args), "single_device_loss": reference[0], "single_device_last_loss": reference[-1],
            "results": results}


def anchor_for(args: argparse.Namespace):
    def anchor(side: str) -> str | None:
        if not side.startswith("sptransform "):
            return None
        zero = int(side.split("zero=")[1].split()[0])
        return side_name(zero, "torch.compile" in side, args, ours=False)
    return anchor


def main(argv: list[str] | None = None) -> int:
    parser = common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), layers=2, hidden=64, heads=4,
                         vocab=1024, seq=64, batch=2, steps=5, warmup=1)
    parser.set_defaults(threads=1)  # dp * tp ranks share the cores
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas (ranks: dp * tp)")
    parser.add_argument("--zero", type=int, nargs="+", choices=sorted(ANCHORS), default=[0, 3],
                        help="sptransform's ZeRO stages, each beside its anchor (0: replicate, 2: fully_shard without "
                             "resharding after forward, 3: fully_shard)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism on both sides")
    parser.add_argument("--compiled", action="store_true", help="also every pair under torch.compile")
    parser.add_argument("--sides", nargs="+", metavar="WORD",
                        help="only the sides whose name contains one of these words (e.g. torch.compile: DTensor's "
                             "compiled embedding leaves its mask in placements that the eager DTensor sides then share, "
                             "pytorch/pytorch#185356)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = launch(worker, args, world=args.dp * args.tp)
    a = args
    title = (f"HF GPT-2, {a.layers} layers, hidden {a.hidden}, {a.heads} heads, vocab {a.vocab}, batch {a.batch} x seq "
             f"{a.seq} per replica, dp={a.dp} x tp={a.tp} on CPU/gloo, {a.threads} thread(s)/rank, AdamW, median of "
             f"{a.steps} steps")
    table = summary_table(result["results"], result["single_device_loss"], anchor=anchor_for(args),
                          reference_last=result["single_device_last_loss"])
    finish(args, title, result, [
        "", f"one table ({a.dp * a.tp} ranks on {os.cpu_count()} cores; each step's time is the slowest rank's; "
        "collectives, waits, fill_, peak MiB: one profiled step of rank 0; losses: mean over the replicas):",
        table, f"total {time.perf_counter() - start:.0f}s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
