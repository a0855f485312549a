"""sptransform against a hand-written ``torch.distributed.tensor.parallel`` plan, on HF GPT-2.

One invocation spawns ``--tp`` ranks (gloo, CPU) and, in the same process tree, trains
the same HF GPT-2 (dropout 0, so losses are comparable) four ways:

* sptransform ``parallelize(model, tp, sp=True)`` and ``sp=False``, on the unmodified model;
* DTensor ``parallelize_module`` with a torchtitan-style plan (ColwiseParallel /
  RowwiseParallel / SequenceParallel / PrepareModuleInput), with and without sequence
  parallelism. ``ColwiseParallel`` does not accept GPT-2's ``Conv1D``, and a contiguous
  column split of the fused ``c_attn`` would hand rank 0 all of Q and half of K, so this
  side runs an edited copy: every ``Conv1D`` becomes an ``nn.Linear`` (transposed weight),
  ``c_attn`` becomes three Linears (q, k, v) concatenated, and after sharding each
  attention's ``split_size`` is set to ``hidden / tp``. The edit is numerically the same
  model (its single-device loss is printed beside the original's).

Per side: first-step loss (and the single-device loss), loss after the timed steps,
median AdamW step time after warm-up, and collectives per step (count and bytes of the
full tensor: all-reduce input, all-gather output, reduce-scatter input), counted the same
way on both sides by a dispatch mode that sees every c10d / functional collective issued
during one training step, split into forward / backward / optimizer. For sptransform the
counts read from its graph (``sptransform.runtime.explain.collective_counts``) are printed too.

    python benchmarks/tp_vs_dtensor.py [--layers 4 --hidden 256 --heads 8 --vocab 8192
        --seq 256 --batch 4 --steps 8 --warmup 2] [--compiled] [--json out.json]

``--compiled`` adds compiled sides with and without sequence parallelism: ``torch.compile(pm)``,
``parallelize(..., recompute=1.0, compile="inductor")`` (sptransform's own partition, which keeps
what ``"none"`` keeps, its overlap pass, then inductor) and ``torch.compile`` of the DTensor-planned model under ``loss_parallel`` (default inductor
backend, both), and the DTensor-planned model with each transformer block compiled on its own
(torchtitan's ``apply_compile``; embedding, head and loss eager), the form whose sp=True side runs
on torch 2.13 where the whole-model compile fails its first backward (pytorch/pytorch#173123);
``--compiled-recompute`` sptransform's ``recompute="selective"`` with
``compile="inductor"`` and ``"eager"``. Their first step (the compile) is a column of its own;
the dispatch counter does not count their collectives, the profiled step does. Each rank compiles
into its own inductor cache folder (``rank_cache_dir``): the ranks' graphs differ, and a cache the
ranks share can serve one rank's compiled graph to the other.

The last table has every side once: step time as median, min and max over the timed steps
(interleaved with the other sides'; each step's time is its slowest rank's), the ratio to the
DTensor side of the same sp and mode (and, for compiled sides, to the per-block compiled one),
and from one profiled step (``StepProfile``) the
collectives gloo ran, the ``wait_tensor`` and ``aten::fill_`` calls, and the peak memory;
``--ops N`` also lists each side's N ops with the most self CPU time in that step.

The launcher, the collective counter, the timing loop and the table are shared with
``tp_vs_hf_auto.py``, ``pp_vs_torch_pipeline.py`` and ``dp_tp_vs_dtensor.py``, which import them
from here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import getpass
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing sptransform
    sys.path.insert(0, ROOT)

# The ranks compile their graphs apart (one inductor compile took minutes on a loaded 2-core
# machine), and every step starts at a barrier: the group's timeout must outlast the slower compile.
TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("SPTRANSFORM_BENCH_TIMEOUT_S", "1800")))

# ---------------------------------------------------------------------------
# Launching: one process per rank, results back through a JSON file of rank 0.
# ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: Callable[[argparse.Namespace], dict], args: argparse.Namespace, world: int | None = None) -> dict:
    """Run ``worker(args)`` on ``world`` spawned ranks (default ``args.tp``); return what rank 0 returned."""
    world = world or args.tp
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(_rank_main, args=(worker, args, world, free_port(), result_path), nprocs=world, join=True)
        with open(result_path) as f:
            return json.load(f)


def _rank_main(rank: int, worker, args: argparse.Namespace, world: int, port: int, result_path: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
    )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = rank_cache_dir(rank)
    torch.set_num_threads(args.threads)
    quiet()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        result = worker(args)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


def rank_cache_dir(rank: int) -> str:
    """A folder of inductor's on-disk caches for this rank alone (under the usual one), so that
    no side's compiled graph can be served to another rank from a cache the ranks share.
    (Measured with torch 2.13, a 1-layer model: the compiled DTensor side's loss equalled the
    single device's with one shared folder too, cold and warm; its warm run compiled again.)"""
    shared = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")  # inductor's default
    return os.path.join(shared, f"rank{rank}")


def quiet() -> None:
    """Deprecation notices of funcol, CommDebugMode's hook notices, transformers' config chatter."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*backward hook.*")
    warnings.filterwarnings("ignore", message=".*Full backward hook.*")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Counting collectives the same way for every side.
# ---------------------------------------------------------------------------

_KIND = {
    # functional collectives (DTensor, sptransform)
    "all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce",
    "all_gather_into_tensor": "all-gather", "all_gather_into_tensor_coalesced": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter", "reduce_scatter_tensor_coalesced": "reduce-scatter",
    "all_to_all_single": "all-to-all", "broadcast": "broadcast",
    # c10d process-group ops (torch.distributed.all_reduce & co)
    "allreduce_": "all-reduce", "allreduce_coalesced_": "all-reduce",
    "allgather_": "all-gather", "_allgather_base_": "all-gather", "allgather_into_tensor_coalesced_": "all-gather",
    "reduce_scatter_": "reduce-scatter", "_reduce_scatter_base_": "reduce-scatter",
    "reduce_scatter_tensor_coalesced_": "reduce-scatter",
    "alltoall_": "all-to-all", "alltoall_base_": "all-to-all", "broadcast_": "broadcast",
}
PHASES = ("forward", "backward", "optimizer")


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(t) for t in x)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives at the dispatcher, by phase and kind, with bytes of the full tensor.

    DTensor ops are let through (``NotImplemented``) so that DTensor desugars them into the
    collectives this mode then sees, as ``CommDebugMode`` does."""

    def __init__(self):
        super().__init__()
        self.phase = PHASES[0]
        self.calls: list[tuple[str, str, int]] = []  # (phase, kind, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func.namespace in ("_c10d_functional", "c10d_functional", "c10d"):
            kind = _KIND.get(func._overloadpacket.__name__)
            if kind is not None:
                nbytes = _tensor_bytes(args[0])
                if kind == "all-gather" and func.namespace != "c10d":
                    nbytes *= int(args[1])  # functional all-gather: input is the shard
                elif kind == "all-gather":
                    nbytes = _tensor_bytes(args[0])  # c10d all-gather: output buffer(s)
                self.calls.append((self.phase, kind, nbytes))
        return func(*args, **kwargs)

    def summary(self) -> dict:
        out: dict[str, dict[str, dict[str, int]]] = {}
        for phase, kind, nbytes in self.calls:
            entry = out.setdefault(phase, {}).setdefault(kind, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += nbytes
        total = {"count": len(self.calls), "bytes": sum(b for _, _, b in self.calls)}
        return {"by_phase": out, "total": total}


# ---------------------------------------------------------------------------
# Training loop: warm-up, one counted step, timed steps.
# ---------------------------------------------------------------------------


@dataclass
class Side:
    name: str
    model: nn.Module
    loss_fn: Callable[[nn.Module], torch.Tensor]
    """Forward of one batch; returns the loss (plain tensor or DTensor)."""
    context: Callable[[], Any] = contextlib.nullcontext
    """Entered around forward and backward (DTensor's ``loss_parallel``)."""
    note: str = ""
    extra: dict = field(default_factory=dict)
    count_collectives: bool = True
    """False for compiled sides: their counted step runs outside the counting dispatch modes
    (which would see the compiled graphs only partly); and for pipeline schedules (torch's
    ``CommDebugMode`` fails in their stages' module hooks); their rows show no collectives but
    the profiled step's."""
    backward: bool = True
    """False where ``loss_fn`` runs the backward itself (a pipeline schedule's ``step``)."""
    loss_mean_over_ranks: bool = False
    """Each rank's loss is its data-parallel replica's: report the mean over all ranks (the
    tensor-parallel ranks of a replica hold equal losses), i.e. the whole batch's loss."""
    profiled_context: Callable[[], Any] = contextlib.nullcontext
    """Entered around the profiled step only (untimed), outside its profile: a side's own measurements."""


def scalar(loss: torch.Tensor) -> float:
    from torch.distributed.tensor import DTensor

    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return float(loss.detach())


class Trainer:
    """One side's AdamW loop: losses, step times, and one step counted by ``CollectiveCounter``
    (with torch's ``CommDebugMode`` counting the same step, as a cross-check)."""

    def __init__(self, side: Side, lr: float):
        self.side = side
        self.opt = torch.optim.AdamW(side.model.parameters(), lr=lr, foreach=False)
        self.counter, self.comm_debug = CollectiveCounter(), CommDebugMode()
        self.losses: list[float] = []
        self.times: list[float] = []
        self.partial_grads = 0
        self.first_s: float | None = None
        self.profiled: dict = {}

    def step(self, *, counted: bool, timed: bool, profiled: bool = False) -> None:
        counted = counted and self.side.count_collectives
        side, mode = self.side, self.counter if counted else None
        dist.barrier()
        start = time.perf_counter()
        with side.profiled_context() if profiled else contextlib.nullcontext(), \
                StepProfile() if profiled else contextlib.nullcontext() as profile:
            self.opt.zero_grad(set_to_none=True)
            with self.comm_debug if counted else contextlib.nullcontext(), mode or contextlib.nullcontext():
                with side.context():
                    loss = side.loss_fn(side.model)
                    if mode is not None:
                        mode.phase = "backward"
                    if side.backward:
                        loss.backward()
                if mode is not None:
                    mode.phase = "optimizer"
                    self.partial_grads = partial_grad_count(side.model)
                self.opt.step()
        if profile is not None:
            self.profiled = profile.counts
        self.losses.append(scalar(loss))
        if self.first_s is None:  # with torch.compile: the compile
            self.first_s = time.perf_counter() - start
        if timed:
            self.times.append(time.perf_counter() - start)

    def result(self) -> dict:
        # a step is as slow as its slowest rank: each step's time is the maximum over the ranks
        slowest = torch.tensor(self.times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times = slowest.tolist()
        first_last = torch.tensor([self.losses[0], self.losses[-1]], dtype=torch.float64)
        if self.side.loss_mean_over_ranks:
            dist.all_reduce(first_last)
            first_last /= dist.get_world_size()
        return {
            "side": self.side.name,
            "first_loss": float(first_last[0]),
            "last_loss": float(first_last[1]),
            "step_s": statistics.median(times),
            "step_s_min": min(times),
            "step_s_max": max(times),
            "step_s_all": times,
            "profiled": self.profiled,
            "collectives": self.counter.summary(),
            "comm_debug_mode_total": self.comm_debug.get_total_counts(),
            "partial_grads": self.partial_grads,
            "first_step_s": self.first_s,
            "note": self.side.note,
            **self.side.extra,
        }


class StepProfile:
    """One step under ``torch.profiler`` (CPU ops and memory), reduced to counts every side has
    alike, compiled or not: collectives the gloo backend ran, ``wait_tensor`` calls, ``aten::fill_``
    calls, and the peak of memory allocated during the step above what was allocated at its start
    (a running sum, in time order, of the net allocation of each top-level op and of the frees
    the profiler records outside any op)."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        if dist.is_available() and dist.is_initialized():
            # gloo runs a collective on its own thread under the caller's profiler state and may
            # still be releasing that collective's buffers (reported to the profiler) after the
            # caller saw it complete; stopping the profiler then races with that thread (seen once
            # in CI: "malloc(): unaligned tcache chunk detected" at profiler_stop). A barrier waits
            # for every earlier collective and a short pause lets the worker leave its last one.
            dist.barrier()
            time.sleep(0.05)
        self._profile.__exit__(*exc)
        events = list(self._profile.events())
        names = [e.name for e in events]
        # top-level ops (their memory counts their children's) and frees outside any op
        memory = sorted((e.time_range.start, e.cpu_memory_usage) for e in events if e.cpu_parent is None)
        live = peak = 0
        for _, change in memory:
            live += change
            peak = max(peak, live)
        # per op: calls and self CPU time (the op's own, without its children), the figures that
        # say where one side's step spends more than the other's
        ops: dict[str, list[float]] = {}
        for e in events:
            row = ops.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.self_cpu_time_total / 1e3
        self.counts = {
            "collectives": sum(1 for n in names if n.startswith("gloo:") and n != "gloo:barrier"),
            "waits": sum(1 for n in names if n.endswith("::wait_tensor")),
            "fills": names.count("aten::fill_"),
            "copies": names.count("aten::copy_"),
            "peak_mib": peak / 2**20,
            "ops": {name: {"calls": int(c), "self_ms": ms} for name, (c, ms) in ops.items()},
        }
        return False


def partial_grad_count(model: nn.Module) -> int:
    """Parameters whose gradient is a DTensor still pending a reduction (``Partial``)."""
    from torch.distributed.tensor import DTensor

    return sum(
        1 for p in model.parameters()
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)
    )


def _error(err: Exception) -> str:
    log(traceback.format_exc())
    first = str(err).splitlines()[0][:300] if str(err) else ""
    return f"{type(err).__name__}: {first}"


def run_sides(makers: list[Callable[[], Side]], *, steps: int, warmup: int, lr: float,
              profile: bool = False) -> list[dict]:
    """Build every side, then train them round-robin (step i of every side, then step i+1),
    so that load from elsewhere on the machine falls on all sides alike. Steps: ``warmup``
    untimed, one counted (untimed), ``steps`` timed. A side that fails (the same way on
    every rank) becomes a row with its reason and leaves the rotation. With ``profile`` the
    step after warm-up is profiled (``StepProfile``) and the collectives are counted on the step
    before it: the counting dispatch modes change what the profile sees (under a mode, a waited
    ``AsyncCollectiveTensor`` runs ``wait_tensor`` three times), so the profiled step runs
    without them. With no warm-up step both share the step after it (waits counted as inflated)."""
    rows: list[dict | Trainer] = []
    for make in makers:
        name = getattr(make, "side_name", make.__name__)
        start = time.perf_counter()
        try:
            trainer = Trainer(make(), lr)
            trainer.setup_s = time.perf_counter() - start
            rows.append(trainer)
        except Exception as err:  # report, don't hang: the other ranks raise the same
            rows.append({"side": name, "error": _error(err)})
        log(f"[{name}] built in {time.perf_counter() - start:.1f}s")
        dist.barrier()
    counted_at = warmup - 1 if profile and warmup >= 1 else warmup
    for i in range(warmup + 1 + steps):
        for k, row in enumerate(rows):
            if isinstance(row, Trainer):
                try:
                    row.step(counted=i == counted_at, timed=i > warmup, profiled=profile and i == warmup)
                except Exception as err:
                    rows[k] = {"side": row.side.name, "error": _error(err)}
    results = []
    for row in rows:
        if isinstance(row, Trainer):
            results.append({**row.result(), "setup_s": row.setup_s})
        else:
            results.append(row)
    return results


def input_check_cost(pm, inputs: dict, repeats: int = 50) -> dict:
    """What ``check_inputs`` adds to a call: the per-call checks (``ParallelModule._prepare``:
    structure, graph lookup, vocabulary range, and with the check the fingerprint all-gather),
    timed with and without the fingerprint, interleaved, medians over ``repeats``."""
    import dataclasses

    with_check, without = [], []
    options = pm._options
    unchecked = dataclasses.replace(options, check_inputs=False)
    for _ in range(repeats):
        for opts, times in ((options, with_check), (unchecked, without)):
            pm._options = opts
            dist.barrier()
            start = time.perf_counter()
            pm._prepare((), {**pm._call_defaults, **inputs})
            times.append(time.perf_counter() - start)
    pm._options = options
    result = torch.tensor([statistics.median(with_check), statistics.median(without)], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)  # the slowest rank's medians
    return {"prepare_s_with_check": float(result[0]), "prepare_s_without_check": float(result[1])}


def input_check_lines(results: list[dict]) -> list[str]:
    """The fingerprint check's cost: per call (timed alone) and in the step medians."""
    from sptransform.runtime.checks import FINGERPRINT

    by = {r["side"]: r for r in results}
    checked, unchecked = by.get("sptransform sp=True"), by.get("sptransform sp=True check_inputs=False")
    if not checked or not unchecked or "error" in checked or "error" in unchecked or "input_check" not in checked:
        return []
    cost = checked["input_check"]
    added = cost["prepare_s_with_check"] - cost["prepare_s_without_check"]
    step = checked["step_s"]
    return [
        f"input check (check_inputs=True, one all-gather of {FINGERPRINT} int64 per rank per call): "
        f"{cost['prepare_s_with_check'] * 1e3:.3f} ms per call with it, {cost['prepare_s_without_check'] * 1e3:.3f} ms "
        f"without (medians of 50): +{added * 1e3:.3f} ms = {100 * added / step:.3f}% of the {step:.3f} s step",
        f"  step medians: {step:.3f} s with the check, {unchecked['step_s']:.3f} s without "
        f"(ratio {step / unchecked['step_s']:.3f}; step-to-step noise on this machine is larger than the check)",
    ]


def sptransform_graph_counts(pm, tp: int) -> dict:
    """Collectives per step as sptransform's own graph states them (count and bytes)."""
    from sptransform.runtime.collectives import sync_grads
    from sptransform.runtime.explain import COLLECTIVE_DIRECTIONS, collective_bytes, collective_counts, collective_nodes

    gm = pm._last.gm
    nbytes = 0
    for node in collective_nodes(gm):
        directions = sum(len(kinds) for kinds in COLLECTIVE_DIRECTIONS[node.target])
        nbytes += directions * collective_bytes(node, tp)
    buckets = [n for n in collective_nodes(gm) if n.target is sync_grads]
    return {
        "counts": collective_counts(gm),
        "bytes": nbytes,
        "grad_buckets": len(buckets),
        "grad_bucket_params": sum(len(n.args) - 1 for n in buckets),
    }


# ---------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------


def _fmt_counts(by_kind: dict) -> str:
    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A", "broadcast": "BC"}
    return " ".join(f"{v['count']}{short.get(k, k)}" for k, v in sorted(by_kind.items())) or "-"


def _merge_phases(by_phase: dict) -> dict:
    merged: dict[str, dict[str, int]] = {}
    for kinds in by_phase.values():
        for kind, v in kinds.items():
            m = merged.setdefault(kind, {"count": 0, "bytes": 0})
            m["count"] += v["count"]
            m["bytes"] += v["bytes"]
    return merged


def render_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def results_table(results: list[dict]) -> str:
    header = ["side", "first loss", "last loss", "step s (median)", "collectives/step (fwd | bwd | opt)", "total",
              "MiB/step", "setup s", "1st step s"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["side"], "failed", "-", "-", r["error"][:60], "-", "-", "-", "-"])
            continue
        c = r["collectives"]
        phases = " | ".join(_fmt_counts(c["by_phase"].get(p, {})) for p in PHASES) if c["total"]["count"] else \
            "not counted (compiled or pipelined)"
        rows.append([
            r["side"], f"{r['first_loss']:.6f}", f"{r['last_loss']:.6f}", f"{r['step_s']:.3f}",
            phases, str(c["total"]["count"]), f"{c['total']['bytes'] / 2**20:.2f}", f"{r['setup_s']:.1f}",
            f"{r['first_step_s']:.1f}",
        ])
    return render_table(rows, header)


def anchor_of(side: str) -> str | None:
    """The DTensor side an sptransform side is compared with: same sp, same mode (eager or
    ``torch.compile``); ``None`` for the anchors themselves and sides without a twin."""
    if not side.startswith("sptransform "):
        return None
    sp = "sp=True" if "sp=True" in side else "sp=False"
    compiled = "torch.compile" in side or "compile=" in side
    return f"DTensor {sp}" + (" torch.compile" if compiled else "")


def second_anchor_of(side: str) -> str | None:
    """For a compiled sptransform side, the DTensor side compiled per block (torchtitan's form)."""
    if not side.startswith("sptransform ") or ("torch.compile" not in side and "compile=" not in side):
        return None
    return ("DTensor sp=True" if "sp=True" in side else "DTensor sp=False") + " per-block torch.compile"


def summary_table(results: list[dict], reference: float, anchor: Callable[[str], str | None] = anchor_of,
                  reference_last: float | None = None) -> str:
    """Every side in one table: losses, step time (median, min, max over the timed steps), ratio
    to its anchor (``anchor(side)``: by default the DTensor side of the same sp and mode; median
    over median, lower is better; for compiled sides also to the per-block compiled DTensor side
    when the run has one), and per step the collectives, waits, ``aten::fill_`` calls and peak
    memory of the profiled step."""
    by = {r["side"]: r for r in results}
    anchor_of = anchor
    per_block = any(second_anchor_of(r["side"]) in by for r in results)
    header = ["side", "first loss", "last loss", "median s", "min s", "max s", "/ anchor",
              *(["/ per-block"] if per_block else []), "collectives", "waits", "fill_", "peak MiB"]
    last = "" if reference_last is None else f"{reference_last:.6f}"
    rows = [["(single device)", f"{reference:.6f}", last, *["" for _ in header[3:]]]]
    for r in results:
        if "error" in r:
            rows.append([r["side"], "failed", *["-" for _ in header[2:]]])
            continue
        anchor = by.get(anchor_of(r["side"]) or "")
        ratio = f"{r['step_s'] / anchor['step_s']:.2f}" if anchor and "error" not in anchor else "-"
        blocks = by.get(second_anchor_of(r["side"]) or "")
        ratio_blocks = f"{r['step_s'] / blocks['step_s']:.2f}" if blocks and "error" not in blocks else "-"
        p = r.get("profiled") or {}
        rows.append([
            r["side"], f"{r['first_loss']:.6f}", f"{r['last_loss']:.6f}", f"{r['step_s']:.3f}",
            f"{r['step_s_min']:.3f}", f"{r['step_s_max']:.3f}", ratio, *([ratio_blocks] if per_block else []),
            *(str(p.get(k, "-")) for k in ("collectives", "waits", "fills")),
            f"{p['peak_mib']:.1f}" if "peak_mib" in p else "-",
        ])
    return render_table(rows, header)


def op_lines(results: list[dict], top: int) -> list[str]:
    """Per side, the ``top`` ops by self CPU time in the profiled step of rank 0 (calls, ms)."""
    out = []
    for r in results:
        ops = (r.get("profiled") or {}).get("ops")
        if not ops:
            continue
        total = sum(v["self_ms"] for v in ops.values())
        out.append(f"{r['side']}: profiled step, self CPU {total:.1f} ms in {sum(v['calls'] for v in ops.values())} "
                   f"events; top {top} by self CPU (calls, ms):")
        ranked = sorted(ops.items(), key=lambda kv: -kv[1]["self_ms"])[:top]
        out += [f"    {name[:70]:70s} {v['calls']:6d} {v['self_ms']:9.2f}" for name, v in ranked]
    return out


def ratio_lines(results: list[dict], pairs: list[tuple[str, str]]) -> list[str]:
    by = {r["side"]: r for r in results}
    out = []
    for ours, theirs in pairs:
        a, b = by.get(ours), by.get(theirs)
        if not a or not b or "error" in a or "error" in b:
            out.append(f"{ours} / {theirs}: n/a (a side failed)")
            continue
        ca, cb = a["collectives"]["total"], b["collectives"]["total"]
        rel = abs(a["first_loss"] - b["first_loss"]) / max(abs(b["first_loss"]), 1e-12)
        out.append(
            f"{ours} / {theirs}: step time {a['step_s'] / b['step_s']:.2f}x, "
            f"collectives {ca['count']}/{cb['count']} = {ca['count'] / max(cb['count'], 1):.2f}x, "
            f"bytes {ca['bytes'] / max(cb['bytes'], 1):.2f}x, first-loss rel. diff {rel:.1e}"
        )
    return out


def grad_sync_lines(results: list[dict]) -> list[str]:
    """Gradient reductions of replicated parameters: sptransform's buckets vs DTensor's per-read."""
    out = []
    for r in results:
        if "error" in r:
            continue
        c = r["collectives"]["by_phase"]
        opt = _merge_phases({"optimizer": c.get("optimizer", {})})
        if "graph" in r:
            g = r["graph"]
            out.append(
                f"{r['side']}: {g['grad_buckets']} bucketed all-reduce(s) per step in backward for "
                f"{g['grad_bucket_params']} replicated params (graph); optimizer step: "
                f"{sum(v['count'] for v in opt.values())} collectives"
            )
        else:
            n_opt = sum(v["count"] for v in opt.values())
            if not n_opt and not r["partial_grads"]:
                out.append(f"{r['side']}: no Partial gradients after backward; optimizer step: 0 collectives")
                continue
            out.append(
                f"{r['side']}: {n_opt} collectives inside optimizer.step(): {r['partial_grads']} params "
                f"(of {r.get('replicated_params', '?')} replicated DTensor params) leave backward with a Partial "
                "gradient, reduced again each time AdamW reads it"
            )
    return out


def graph_lines(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        if "graph" in r:
            g = r["graph"]
            counts = ", ".join(f"{v} {k}" for k, v in sorted(g["counts"].items()))
            counted = r["collectives"]["total"]["count"]
            out.append(
                f"{r['side']}: explain.collective_counts says {counts} = {sum(g['counts'].values())} "
                f"({g['bytes'] / 2**20:.2f} MiB); counted at dispatch: {counted}"
            )
    checks = [f"{r['side']} {r['comm_debug_mode_total']}" for r in results if "comm_debug_mode_total" in r]
    if checks:
        out.append("CommDebugMode's total for the same step: " + ", ".join(checks))
    return out


def common_args(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    d = dict(layers=4, hidden=256, heads=8, vocab=8192, seq=256, batch=4, steps=8, warmup=2)
    d.update(defaults)
    parser.add_argument("--tp", type=int, default=2, help="ranks (tensor-parallel degree)")
    parser.add_argument("--layers", type=int, default=d["layers"])
    parser.add_argument("--hidden", type=int, default=d["hidden"])
    parser.add_argument("--heads", type=int, default=d["heads"])
    parser.add_argument("--vocab", type=int, default=d["vocab"])
    parser.add_argument("--seq", type=int, default=d["seq"])
    parser.add_argument("--batch", type=int, default=d["batch"])
    parser.add_argument("--steps", type=int, default=d["steps"], help="timed AdamW steps per side")
    parser.add_argument("--warmup", type=int, default=d["warmup"], help="untimed steps before the counted step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per rank")
    parser.add_argument("--json", metavar="FILE", help="write the numbers here")
    return parser


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return ids, ids.clone()


def finish(args: argparse.Namespace, title: str, result: dict, lines: list[str]) -> None:
    print(title)
    print(results_table(result["results"]))
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


# ---------------------------------------------------------------------------
# GPT-2: the model, its Linear edit for DTensor, and the DTensor plans.
# ---------------------------------------------------------------------------


def gpt2(args: argparse.Namespace) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=args.vocab, n_positions=max(args.seq, 64), n_embd=args.hidden, n_layer=args.layers,
        n_head=args.heads, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config).train()


class FusedQKV(nn.Module):
    """``c_attn`` as three Linears whose outputs are concatenated: the same function, but
    each of q, k, v can be column-split on its own."""

    def __init__(self, conv, hidden: int):
        super().__init__()
        w, b = conv.weight.detach(), conv.bias.detach()  # Conv1D: weight [in, out]
        for i, name in enumerate("qkv"):
            lin = nn.Linear(hidden, hidden)
            lin.weight.data.copy_(w[:, i * hidden : (i + 1) * hidden].t())
            lin.bias.data.copy_(b[i * hidden : (i + 1) * hidden])
            self.add_module(name, lin)

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def linearize_gpt2(model: nn.Module) -> nn.Module:
    """A copy of HF GPT-2 with every ``Conv1D`` an ``nn.Linear`` (and ``c_attn`` split into
    q/k/v Linears): what ``ColwiseParallel``/``RowwiseParallel`` need."""
    from transformers.pytorch_utils import Conv1D

    model = copy.deepcopy(model)
    hidden = model.config.n_embd
    for block in model.transformer.h:
        block.attn.c_attn = FusedQKV(block.attn.c_attn, hidden)
        for parent, name in ((block.attn, "c_proj"), (block.mlp, "c_fc"), (block.mlp, "c_proj")):
            conv = getattr(parent, name)
            assert isinstance(conv, Conv1D)
            lin = nn.Linear(conv.weight.shape[0], conv.weight.shape[1])
            lin.weight.data.copy_(conv.weight.detach().t())
            lin.bias.data.copy_(conv.bias.detach())
            setattr(parent, name, lin)
    model.lm_head.weight = model.transformer.wte.weight  # keep the tie
    return model


def dtensor_gpt2(model: nn.Module, tp: int, sp: bool, mesh=None) -> nn.Module:
    """torchtitan-style plan on the Linear-edited GPT-2, over ``mesh`` (a 1-D tensor-parallel
    mesh; default: all ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,)) if mesh is None else mesh
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        # wte's output is sequence-sharded (reduce-scatter) with sp; DTensor outputs keep the
        # global shape, so GPT2Model's position ids and causal mask stay right.
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=not sp),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        # positions must be a DTensor too (a plain + DTensor add fails)
        plan["transformer.wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False)
        plan["transformer.ln_f"] = SequenceParallel()
    for i in range(len(model.transformer.h)):
        p = f"transformer.h.{i}."
        for lin in ("attn.c_attn.q", "attn.c_attn.k", "attn.c_attn.v", "mlp.c_fc"):
            plan[p + lin] = ColwiseParallel()
        for lin in ("attn.c_proj", "mlp.c_proj"):
            plan[p + lin] = RowwiseParallel(output_layouts=seq, use_local_output=not sp)
        # One replicated DTensor input shared by q, k, v (and c_fc): their input gradients
        # add up as a Partial DTensor and are reduced once, not once per Linear.
        for sub in ("attn", "mlp"):
            plan[p + sub] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        if sp:
            plan[p + "ln_1"] = SequenceParallel()
            plan[p + "ln_2"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.transformer.wte.weight  # both Shard(0) over the vocab: re-tie
    for block in model.transformer.h:
        block.attn.split_size = model.config.n_embd // tp  # local q/k/v widths
    return model


def replicated_dtensor_params(model: nn.Module) -> int:
    from torch.distributed.tensor import DTensor, Replicate

    return sum(
        1 for p in model.parameters()
        if isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements)
    )


def single_device_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=labels, use_cache=False).loss)


def dtensor_worker(args: argparse.Namespace) -> dict:
    import sptransform
    from torch.distributed.tensor.parallel import loss_parallel

    ids, labels = batch(args)
    base = gpt2(args)
    edited = linearize_gpt2(base)
    reference = {"original": single_device_loss(base, ids, labels), "linear_edit": single_device_loss(edited, ids, labels)}
    log(f"single device: {reference}")

    def hf_loss(m):
        return m(input_ids=ids, labels=labels, use_cache=False).loss

    def ours(sp: bool, check_inputs: bool = True):
        name = f"sptransform sp={sp}" + ("" if check_inputs else " check_inputs=False")

        def make() -> Side:
            inputs = {"input_ids": ids, "labels": labels, "use_cache": False}
            pm = sptransform.parallelize(copy.deepcopy(base), tp=args.tp, sp=sp, example_inputs=inputs,
                                         check_inputs=check_inputs)
            extra = {"graph": sptransform_graph_counts(pm, args.tp)}
            if check_inputs and sp:
                extra["input_check"] = input_check_cost(pm, inputs)
            return Side(name, pm, hf_loss, note="unmodified HF GPT-2", extra=extra)
        make.side_name = name
        return make

    def theirs(sp: bool):
        def make() -> Side:
            model = dtensor_gpt2(copy.deepcopy(edited), args.tp, sp)
            return Side(f"DTensor sp={sp}", model, hf_loss, context=loss_parallel,
                        note="Conv1D->nn.Linear, c_attn->q/k/v, attn.split_size=hidden/tp",
                        extra={"replicated_params": replicated_dtensor_params(model)})
        make.side_name = f"DTensor sp={sp}"
        return make

    def ours_compiled(how: str, sp: bool = False, recompute="selective"):
        """Compiled: ``torch.compile(pm)`` (default inductor backend) or ``recompute=recompute``
        with the partitioned graphs compiled by ``compile=how`` (``recompute=1.0``: the budget that
        keeps what ``"none"`` keeps, so nothing costly is recomputed, through sptransform's own
        partition, overlap pass and inductor)."""
        name = f"sptransform sp={sp} torch.compile(pm)" if how == "torch.compile" else \
            f'sptransform sp={sp} recompute={recompute} compile="{how}"'

        def make() -> Side:
            inputs = {"input_ids": ids, "labels": labels, "use_cache": False}
            if how == "torch.compile":
                pm = sptransform.parallelize(copy.deepcopy(base), tp=args.tp, sp=sp, example_inputs=inputs)
                compiled = torch.compile(pm)
                return Side(name, pm, lambda m: hf_loss(compiled), note="unmodified HF GPT-2", count_collectives=False)
            pm = sptransform.parallelize(copy.deepcopy(base), tp=args.tp, sp=sp, example_inputs=inputs,
                                         recompute=recompute, compile=how)
            return Side(name, pm, hf_loss, note="unmodified HF GPT-2", count_collectives=False)
        make.side_name = name
        return make

    def theirs_compiled(sp: bool = False):
        name = f"DTensor sp={sp} torch.compile"

        def make() -> Side:
            model = dtensor_gpt2(copy.deepcopy(edited), args.tp, sp)
            compiled = torch.compile(model)
            return Side(name, model, lambda m: hf_loss(compiled), context=loss_parallel,
                        note="Conv1D->nn.Linear, c_attn->q/k/v, attn.split_size=hidden/tp", count_collectives=False,
                        extra={"replicated_params": replicated_dtensor_params(model)})
        make.side_name = name
        return make

    def theirs_compiled_blocks(sp: bool = False):
        """torchtitan's ``apply_compile``: each transformer block compiled on its own (embedding, head
        and loss eager). The whole-model compiled DTensor sp=True side fails its first backward on
        torch 2.13 (pytorch/pytorch#173123); compiled per block it has no output without a gradient."""
        name = f"DTensor sp={sp} per-block torch.compile"

        def make() -> Side:
            model = dtensor_gpt2(copy.deepcopy(edited), args.tp, sp)
            for block in model.transformer.h:
                block.compile()
            return Side(name, model, hf_loss, context=loss_parallel,
                        note="Conv1D->nn.Linear, c_attn->q/k/v, attn.split_size=hidden/tp; blocks compiled",
                        count_collectives=False, extra={"replicated_params": replicated_dtensor_params(model)})
        make.side_name = name
        return make

    makers = [ours(True), ours(True, check_inputs=False), theirs(True), ours(False), theirs(False)]
    if args.compiled:
        makers += [ours_compiled("torch.compile", sp=True), ours_compiled("inductor", sp=True, recompute=1.0),
                   theirs_compiled(sp=True), theirs_compiled_blocks(sp=True),
                   ours_compiled("torch.compile"), ours_compiled("inductor", recompute=1.0), theirs_compiled(),
                   theirs_compiled_blocks()]
    if args.compiled_recompute:
        makers += [ours_compiled("inductor"), ours_compiled("eager")]
    if args.sides:
        makers = [m for m in makers if any(word in m.side_name for word in args.sides)]
    results = run_sides(makers, steps=args.steps, warmup=args.warmup, lr=args.lr, profile=args.profile)
    return {"config": vars(args), "single_device_loss": reference, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--compiled", action="store_true",
                        help="also the compiled sides, sp=True and sp=False: torch.compile(pm) and torch.compile of "
                             "the DTensor plan (default inductor backend)")
    parser.add_argument("--compiled-recompute", action="store_true",
                        help="also recompute='selective' with compile='inductor' and 'eager' (sp=False)")
    parser.add_argument("--sides", nargs="+", metavar="WORD",
                        help="only the sides whose name contains one of these words (e.g. torch.compile)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the profiled step (collectives, waits, fill_ and peak memory per step)")
    parser.add_argument("--ops", type=int, default=0, metavar="N",
                        help="also list each side's N ops with the most self CPU time in the profiled step")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = launch(dtensor_worker, args)
    ref = result["single_device_loss"]
    lines = [
        "",
        f"single-device first loss: {ref['original']:.6f} (HF GPT-2 as is), {ref['linear_edit']:.6f} "
        "(Conv1D->Linear edit the DTensor side needs)",
        *ratio_lines(result["results"], [("sptransform sp=True", "DTensor sp=True"), ("sptransform sp=False", "DTensor sp=False")]
                     + ([(f"sptransform sp={sp} torch.compile(pm)", f"DTensor sp={sp}{blocks} torch.compile")
                          for sp in (True, False) for blocks in ("", " per-block")] if args.compiled else [])),
        *input_check_lines(result["results"]),
        "gradient sync of replicated params:",
        *("  " + l for l in grad_sync_lines(result["results"])),
        *graph_lines(result["results"]),
        "model edit: DTensor's ColwiseParallel/RowwiseParallel need nn.Linear (not HF Conv1D) and a per-rank",
        "  split of the fused c_attn; sptransform runs the unmodified HF GPT-2.",
        f"total {time.perf_counter() - start:.0f}s",
    ]
    a = args
    if args.profile:
        lines += ["", "one table (each step's time is the slowest rank's; per step: from one profiled step of rank 0):",
                  summary_table(result["results"], ref["original"])]
        if args.ops:
            lines += ["", *op_lines(result["results"], args.ops)]
    finish(args, f"HF GPT-2, {a.layers} layers, hidden {a.hidden}, {a.heads} heads, vocab {a.vocab}, seq {a.seq}, "
                 f"batch {a.batch}, tp={a.tp} on CPU/gloo, {a.threads} thread(s)/rank, AdamW, median of {a.steps} steps",
           result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
