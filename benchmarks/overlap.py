"""How much communication the overlap hides: ``parallelize(..., overlap=True)`` against ``False``.

One invocation spawns ``dp * tp`` gloo ranks (default 2 x 2 = 4) and trains HF GPT-2 with
``parallelize(model, tp, dp, zero, overlap=...)`` for each runner and both settings, side by
side in the same processes:

* ``eager``: ``recompute="none"``, the graph run by autograd; with overlap the gradient buckets'
  all-reduces (data-parallel, and the tensor-parallel one of replicated parameters) are waited
  on in the optimizer step instead of inside the backward;
* ``aot``: ``recompute="selective", compile="eager"``: sptransform's partitioned forward and
  backward graphs, run op by op, with and without the overlap pass (``passes.overlap``);
* ``inductor``: the same graphs compiled by inductor.

``--runners`` picks them (default ``eager,aot``).

The two settings are built side by side and their steps alternated. Per rank 0 it reports
the median step time (forward + backward + AdamW step) and the
*exposed* communication time: the time the rank spends blocked in ``wait_tensor`` per step,
read from ``torch.profiler`` (the median over the profiled steps). Without overlap every
collective is waited on right after it is issued, so that time is the communication the
step pays for; ``hidden = 1 - exposed(on) / exposed(off)`` is the share the overlap removes.
For the graphs it also counts the collectives with work between issue and wait
(``passes.overlap.overlap_report``).

    python benchmarks/overlap.py [--dp 2 --tp 2 --zero 0 --layers 4 --hidden 256 --heads 8
        --vocab 4096 --seq 128 --batch 4 --steps 12 --warmup 2 --profiled 6 --runners eager,aot,inductor] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RUNNERS = {"eager": dict(recompute="none"), "aot": dict(recompute="selective", compile="eager"),
           "inductor": dict(recompute="selective", compile="inductor")}
WAIT = "_c10d_functional::wait_tensor"


def _model(args):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                     vocab_size=args.vocab, n_positions=args.seq, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _exposed_wait_s(prof) -> float:
    """Seconds spent in outermost ``wait_tensor`` calls (a wait on an ``AsyncCollectiveTensor``
    dispatches a second, nested one: counted once)."""
    total = 0.0
    for event in prof.events():
        if event.name != WAIT:
            continue
        parent = event.cpu_parent
        if parent is not None and parent.name == WAIT:
            continue
        total += event.cpu_time_total / 1e6  # microseconds, children included
    return total


def _step(pm, opt, ids) -> float:
    loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _run_runner(runner: str, args, reports: "_Reports") -> dict:
    """Both settings of one runner in this process, their steps alternated (off, on, off, on, ...)
    so that a machine growing busier or quieter during the run weighs on both alike."""
    import sptransform

    rank, tp = dist.get_rank(), args.tp
    torch.manual_seed(1 + rank // tp)  # each data-parallel replica trains on its own batch
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    sides = {}
    for overlap in (False, True):
        reports.reports.clear()
        pm = sptransform.parallelize(_model(args), tp=tp, dp=args.dp, zero=args.zero, overlap=overlap,
                                     example_inputs=dict(input_ids=ids, labels=ids), **RUNNERS[runner])
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        dist.barrier()
        start = time.perf_counter()
        first_loss = _step(pm, opt, ids)  # captures (and compiles) the graphs
        sides[overlap] = dict(pm=pm, opt=opt, first_s=time.perf_counter() - start, first_loss=first_loss,
                              times=[], waits=[], graphs=[(b.collectives, b.overlapped, a.overlapped, b.ops_between,
                                                          a.ops_between) for b, a in reports.reports])
    for step in range(args.steps + args.profiled):
        for overlap, side in sides.items():
            dist.barrier()
            if step < args.steps:
                start = time.perf_counter()
                side["last_loss"] = _step(side["pm"], side["opt"], ids)
                side["times"].append(time.perf_counter() - start)
            else:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    _step(side["pm"], side["opt"], ids)
                side["waits"].append(_exposed_wait_s(prof))
    return {overlap: dict(step_s=statistics.median(side["times"][args.warmup:]), exposed_s=statistics.median(side["waits"]),
                          first_s=side["first_s"], first_loss=side["first_loss"], last_loss=side["last_loss"],
                          graphs=side["graphs"])
            for overlap, side in sides.items()}


class _Reports(logging.Handler):
    """The overlap pass's DEBUG records: (before, after) ``OverlapReport`` of each graph it scheduled."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.reports = []

    def emit(self, record):
        if hasattr(record, "overlap"):
            self.reports.append(record.overlap)


def _worker(rank: int, world: int, port: int, args, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    reports = _Reports()
    logger = logging.getLogger("sptransform.passes.overlap")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(reports)
    try:
        for runner in args.runners:
            for overlap, result in _run_runner(runner, args, reports).items():
                if rank == 0:
                    out[f"{runner} overlap={overlap}"] = result
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _table(results: dict, args) -> str:
    lines = [f"GPT-2, dp={args.dp} x tp={args.tp} ({args.dp * args.tp} gloo ranks), zero={args.zero}, "
             f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x seq {args.seq} "
             f"per replica; rank 0, medians of {args.steps - args.warmup} timed and {args.profiled} profiled steps",
             "| runner | overlap | step s | exposed wait s / step | hidden | step off/on | first step s | "
             "loss first -> last |",
             "|---|---|---|---|---|---|---|---|"]
    for runner in args.runners:
        off = results[f"{runner} overlap=False"]
        for overlap in (False, True):
            r = results[f"{runner} overlap={overlap}"]
            hidden = 1 - r["exposed_s"] / off["exposed_s"] if off["exposed_s"] > 0 else float("nan")
            lines.append(f"| {runner} | {overlap} | {r['step_s']:.4f} | {r['exposed_s']:.4f} | "
                         f"{hidden:.1%} | {off['step_s'] / r['step_s']:.3f} | {r['first_s']:.2f} | "
                         f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} |")
    lines += ["", "Partitioned graphs scheduled by the overlap pass (forward, then backward): collectives, those with "
                  "compute between issue and wait before -> after, compute ops between them before -> after"]
    for runner in args.runners:
        for graph, (count, ov_before, ov_after, ops_before, ops_after) in zip(
                ("forward", "backward"), results[f"{runner} overlap=True"]["graphs"]):
            lines.append(f"  {runner} {graph}: {count} collectives; overlapped {ov_before} -> {ov_after}; "
                         f"ops between {ops_before} -> {ops_after}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dp", 2), ("tp", 2), ("zero", 0), ("layers", 4), ("hidden", 256), ("heads", 8),
                          ("vocab", 4096), ("seq", 128), ("batch", 4), ("steps", 12), ("warmup", 2),
                          ("profiled", 6)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--runners", default="eager,aot", help=f"comma-separated, from {','.join(RUNNERS)}")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: the median is over the steps after it")
    if args.profiled < 1:
        parser.error("--profiled must be at least 1")
    args.runners = args.runners.split(",")
    if not args.runners or set(args.runners) - set(RUNNERS):
        parser.error(f"--runners {','.join(args.runners)}: choose from {','.join(RUNNERS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    world = args.dp * args.tp
    mp.spawn(_worker, args=(world, port, args, out), nprocs=world, join=True)
    results = {key: out[key] for key in (f"{r} overlap={o}" for r in args.runners for o in (False, True))}
    print(_table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
