"""What a call of a parallel module costs beyond its graph: HF GPT-2 at tiny sizes, where that
overhead is most of a step.

One invocation spawns ``--tp`` gloo ranks (CPU) and times, per ``sp`` in ``--sp``:

* ``pm``: ``pm(input_ids=..., labels=...)``, the parallel module as users call it (input checks,
  graph lookup, the fingerprint all-gather of ``check_inputs``, the graph, the DTensor logits);
* ``pm check_inputs=False``: the same without the fingerprint all-gather;
* ``graph``: the same captured graph called directly on this rank's local inputs, built once
  (``pm._graph_inputs``): the floor the module's own Python sits on;
* ``DTensor``: DTensor TP of the same model (``tp_vs_dtensor.dtensor_gpt2``, the compiled
  benchmark's anchor) under ``loss_parallel``;

each as a forward (``fwd``) and as forward + backward (``step``), and with ``--compiled`` the
``torch.compile`` of each (default inductor backend; the first call compiles, minutes on a busy
2-core machine). Sides are interleaved: every run times ``--calls`` calls of each side in turn,
and the table has the median, min and max over ``--runs`` runs of the time per call (each run's
figure is its slowest rank's). ``--cprofile N`` also prints rank 0's N functions with the most
cumulative time over ``--calls`` calls of ``pm`` (fwd + bwd), eager and compiled.

    python benchmarks/call_overhead.py [--layers 1 --hidden 64 --heads 4 --vocab 1024 --seq 64
        --batch 2 --threads 1 --runs 7 --calls 5] [--sp False True] [--compiled] [--cprofile 25]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import json
import os
import pathlib
import pstats
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_vs_dtensor import batch, common_args, dtensor_gpt2, gpt2, launch, linearize_gpt2, log  # noqa: E402


def _loss_index(pm, inputs: dict) -> int:
    """Which flat output of the graph is the loss (the HF output's ``loss``)."""
    from torch.utils._pytree import tree_leaves

    out = pm(**inputs)
    return next(i for i, leaf in enumerate(tree_leaves(out)) if leaf is out.loss)


def sides_for(sp: bool, args: argparse.Namespace, base, edited, inputs: dict) -> dict[str, tuple[Callable, Callable]]:
    """name -> (forward, forward + backward), each a no-argument callable."""
    import sptransform
    from torch.distributed.tensor.parallel import loss_parallel

    sides: dict[str, tuple[Callable, Callable]] = {}
    compiled = args.compiled and sp in args.compiled_sp
    for check in (True, False):
        pm = sptransform.parallelize(copy.deepcopy(base), tp=args.tp, sp=sp, example_inputs=inputs, check_inputs=check)
        name = "pm" if check else "pm check_inputs=False"
        sides[name] = _module_side(pm, inputs)
        if compiled:
            sides[name + " compiled"] = _module_side(torch.compile(pm), inputs)
        if check:
            loss_at = _loss_index(pm, inputs)
            call = {**pm._call_defaults, **inputs}
            cached = pm._graphs[pm._cache_key((), call)]
            gm, graph_inputs = cached.graph.captured.gm, pm._graph_inputs(cached, (), call)
            sides["graph"] = _graph_side(gm, graph_inputs, loss_at)
            if compiled:
                sides["graph compiled"] = _graph_side(torch.compile(gm), graph_inputs, loss_at)
    model = dtensor_gpt2(copy.deepcopy(edited), args.tp, sp)
    sides["DTensor"] = _module_side(model, inputs, loss_parallel)
    if compiled:
        sides["DTensor compiled"] = _module_side(torch.compile(model), inputs, loss_parallel)
    return sides


def _module_side(model, inputs: dict, context=contextlib.nullcontext) -> tuple[Callable, Callable]:
    def forward():
        with context():
            model(**inputs)

    def step():
        with context():
            model(**inputs).loss.backward()
    return forward, step


def _graph_side(gm, graph_inputs: list, loss_at: int) -> tuple[Callable, Callable]:
    def forward():
        gm(*graph_inputs)

    def step():
        gm(*graph_inputs)[loss_at].backward()
    return forward, step


def time_sides(sides: dict[str, tuple[Callable, Callable]], runs: int, calls: int) -> dict[str, list[list[float]]]:
    """Per side: [wall seconds, CPU seconds] per call, one pair per run (each the slowest rank's:
    its wall time, and the most CPU time a rank's process spent), sides interleaved. CPU time
    leaves out the time a rank waits for its peer, which on a loaded machine is most of a step."""
    for forward, step in sides.values():  # warm-up (and the compile of compiled sides)
        forward()
        step()
    times: dict[str, list[list[float]]] = {}
    for _ in range(runs):
        row = []
        for name, (forward, step) in sides.items():
            for kind, fn in (("fwd", forward), ("step", step)):
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    fn()
                row.append((f"{name} {kind}", [(time.perf_counter() - start) / calls, (time.process_time() - cpu) / calls]))
        slowest = torch.tensor([t for _, t in row], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        for (key, _), t in zip(row, slowest.tolist()):
            times.setdefault(key, []).append(t)
    return times


def profile_lines(name: str, fn: Callable, calls: int, top: int) -> list[str]:
    """Rank 0's ``top`` functions by cumulative time over ``calls`` calls of ``fn`` (every rank
    runs the calls: they meet in collectives)."""
    profiler = cProfile.Profile()
    dist.barrier()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("cumulative").print_stats(top)
    return [f"cProfile of {calls} calls of {name} (rank 0, cumulative):", *stream.getvalue().splitlines()]


def worker(args: argparse.Namespace) -> dict:
    base = gpt2(args)
    edited = linearize_gpt2(base)
    ids, labels = batch(args)
    inputs = {"input_ids": ids, "labels": labels, "use_cache": False}
    result: dict = {"config": vars(args), "times": {}, "profiles": []}
    for sp in args.sp:
        start = time.perf_counter()
        sides = sides_for(sp, args, base, edited, inputs)
        if args.sides:
            sides = {name: fns for name, fns in sides.items() if any(word in name for word in args.sides)}
        log(f"sp={sp}: {len(sides)} sides built in {time.perf_counter() - start:.1f}s")
        times = time_sides(sides, args.runs, args.calls)
        result["times"].update({f"sp={sp} {key}": value for key, value in times.items()})
        log(f"sp={sp}: timed in {time.perf_counter() - start:.1f}s")
        if args.cprofile:
            for name in ("pm", "pm compiled"):
                if name in sides:
                    lines = profile_lines(f"sp={sp} {name} fwd+bwd", sides[name][1], args.calls, args.cprofile)
                    if dist.get_rank() == 0:
                        result["profiles"] += lines
    return result


def table(times: dict[str, list[list[float]]]) -> list[str]:
    lines = ["| side | median ms | min ms | max ms | / graph | / DTensor | CPU ms (median) | CPU / graph | CPU / DTensor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    wall = {key: statistics.median(w for w, _ in value) for key, value in times.items()}
    cpu = {key: statistics.median(c for _, c in value) for key, value in times.items()}
    for key, value in times.items():
        sp, rest = key.split(" ", 1)
        name, kind = rest.rsplit(" ", 1)
        suffix = " compiled" if name.endswith(" compiled") else ""
        refs = [f"{sp} graph{suffix} {kind}", f"{sp} DTensor{suffix} {kind}"]
        ratios = [f"{table[key] / table[ref]:.2f}" if ref in table else "" for table in (wall, cpu) for ref in refs]
        walls = [w for w, _ in value]
        lines.append(f"| {key} | {wall[key] * 1e3:.2f} | {min(walls) * 1e3:.2f} | {max(walls) * 1e3:.2f} | "
                     f"{ratios[0]} | {ratios[1]} | {cpu[key] * 1e3:.2f} | {ratios[2]} | {ratios[3]} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                         layers=1, hidden=64, heads=4, vocab=1024, seq=64, batch=2)
    parser.add_argument("--sp", nargs="+", type=lambda s: s == "True", default=[False, True], metavar="BOOL")
    parser.add_argument("--runs", type=int, default=7, help="interleaved runs (the table's median, min, max)")
    parser.add_argument("--calls", type=int, default=5, help="calls per side and run")
    parser.add_argument("--compiled", action="store_true", help="also torch.compile of each side")
    parser.add_argument("--compiled-sp", nargs="+", type=lambda s: s == "True", default=[False], metavar="BOOL",
                        help="the sp values with compiled sides (DTensor's sp=True compiled step fails on torch 2.13: "
                             "pytorch/pytorch#173123, see the README's benchmarks)")
    parser.add_argument("--sides", nargs="+", metavar="WORD", help="only the sides whose name contains one of these")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print rank 0's top N functions of pm")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = launch(worker, args)
    a = args
    print(f"HF GPT-2, {a.layers} layer(s), hidden {a.hidden}, {a.heads} heads, vocab {a.vocab}, seq {a.seq}, "
          f"batch {a.batch}, tp={a.tp} on CPU/gloo, {a.threads} thread(s)/rank; time per call over {a.runs} "
          f"interleaved runs of {a.calls} calls (each run: its slowest rank); fwd = forward, step = forward + backward")
    print("\n".join(table(result["times"])))
    for line in result["profiles"]:
        print(line)
    print(f"total {time.perf_counter() - start:.0f}s")
    if args.json:  # the raw figures: [wall s, CPU s] per run and side, and the profiles
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
