"""sptransform's pipeline split against ``torch.distributed.pipelining.pipeline()``, on HF GPT-2 (pp=2).

One invocation spawns 2 ranks (gloo, CPU) and trains the same HF GPT-2 (tied
embedding and head, dropout 0) with the same torch schedule and microbatches, two ways,
eager and (``--compiled``) compiled:

* **sptransform**: ``parallelize(model, tp=1, pp=2, schedule=..., n_microbatches=...)`` on the
  unmodified model: cut found on the graph, balanced by measured cost, the model's own
  loss, tied weights kept in sync. Compiled: ``recompute=1.0, compile="inductor"`` (a budget
  of the whole of what ``recompute="none"`` keeps, so nothing is recomputed; each stage's
  partitioned forward and backward compiled by inductor);
* **torch pipeline()**: the model wrapped to return logits (torch's schedules compute
  the loss from the last stage's output and ``target``), split by hand with
  ``split_spec={"model.transformer.h.<L/2>": SplitPoint.BEGINNING}``, one
  ``PipelineStage`` per rank from ``pipe.build_stage``, the same schedule class, and a
  ``loss_fn`` computing HF's shifted causal-LM cross-entropy. Compiled: the stage's module
  under ``torch.compile`` (default inductor backend).

The sides alternate step by step on one batch (``run_sides`` of ``tp_vs_dtensor.py``: each
step's time is the slower rank's; one profiled step gives the gloo collectives (sends and
receives here), waits, ``fill_`` and rank 0's peak memory). Per side also: peak activation
bytes per stage in that step (storages autograd saved for backward plus forward outputs the
stage still holds, sampled at every save, parameters left out), and whether the tied
embedding/head copies are equal after the steps. A side that fails is a row with its error.

    python benchmarks/pp_vs_torch_pipeline.py [--layers 4 --hidden 256 --heads 8 --vocab 8192
        --seq 128 --batch 8 --microbatches 4 --schedule 1f1b --steps 6 --warmup 2] [--compiled]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing sptransform
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_vs_dtensor import Side, launch, run_sides, summary_table  # noqa: E402  (the harness lives beside this file)

PP = 2
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def gpt2(args: argparse.Namespace) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab, n_positions=args.seq,
        attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).train()


def batch(args: argparse.Namespace) -> dict:
    """The one global batch every step trains on (labels drawn apart from the ids)."""
    torch.manual_seed(1)
    return dict(input_ids=torch.randint(0, args.vocab, (args.batch, args.seq)),
                labels=torch.randint(0, args.vocab, (args.batch, args.seq)))


# ---------------------------------------------------------------------------
# Peak activation bytes of one rank's stages


class ActivationMeter:
    """Live bytes held for backward: every storage autograd saves (pack hook, weak
    references, parameters excluded) plus the stages' forward outputs still held
    (``fwd_cache``), sampled at every save. Used alike on both sides, in the profiled step
    (``measuring``); ``peaks()`` gathers both ranks' (one per stage)."""

    def __init__(self, stages, params):
        self.stages = stages
        self.params = {StorageWeakRef(_local(p).untyped_storage()) for p in params}
        self.saved: dict[StorageWeakRef, int] = {}
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in self.params and ref not in self.saved:
            self.saved[ref] = t.untyped_storage().nbytes()
        self.sample()
        return t

    def sample(self) -> None:
        live = {ref: n for ref, n in self.saved.items() if not ref.expired()}
        self.saved = live
        for stage in self.stages:
            for outputs, _ in stage.fwd_cache.values():
                for out in outputs:
                    if isinstance(out, torch.Tensor):
                        ref = StorageWeakRef(out.untyped_storage())
                        if ref not in live and ref not in self.params:
                            live[ref] = out.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(live.values()))

    def measuring(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def peaks(self) -> list[int]:
        peaks: list = [None] * PP
        dist.all_gather_object(peaks, self.peak)
        return peaks


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


# ---------------------------------------------------------------------------
# The sides: a ``Side`` whose loss_fn runs one schedule step (forward and backward of every
# microbatch) and returns the batch's loss on every rank; ``tied`` reads the tied copies; the meter
# measures activations in the profiled step.


def sptransform_side(args: argparse.Namespace, compiled: bool) -> tuple[Side, Callable, ActivationMeter]:
    import sptransform

    data = batch(args)
    how = dict(recompute=1.0, compile="inductor") if compiled else {}
    model = sptransform.parallelize(gpt2(args), tp=1, pp=PP, schedule=args.schedule,
                                    n_microbatches=args.microbatches, example_inputs=data, **how)
    plan = model.pipeline_plan
    ends = plan.starts[1:] + [plan.num_layers]
    layers = ", ".join(f"stage {i}: layers {a}-{b - 1}" for i, (a, b) in enumerate(zip(plan.starts, ends)))
    extra = {"how": f"cut found and balanced on measured cost ({layers}); tied weights synced"}
    meter = ActivationMeter(model._stages, list(model._stages[0].submod.parameters()))

    def tied() -> dict[str, torch.Tensor]:
        held = dict(model.named_parameters(remove_duplicate=False))
        return {t.name: held[t.name].full_tensor().detach() for t in plan.tied if t.name in held}

    side = Side(side_name("sptransform", compiled), model, lambda m: m.step(**data), backward=False,
                count_collectives=False, note="unmodified HF GPT-2", extra=extra, profiled_context=meter.measuring)
    return side, tied, meter


class Logits(nn.Module):
    """What torch's pipelining expects: the model maps inputs to logits; the schedule's loss_fn does the rest."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's ForCausalLMLoss: predict token t+1 from position t, mean over tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def torch_pipeline_side(args: argparse.Namespace, compiled: bool) -> tuple[Side, Callable, ActivationMeter]:
    from torch.distributed.pipelining import SplitPoint, pipeline
    from torch.distributed.pipelining import schedules

    data = batch(args)
    micro = data["input_ids"][: args.batch // args.microbatches]
    split = f"model.transformer.h.{args.layers // 2}"
    pipe = pipeline(Logits(gpt2(args)), mb_args=(micro,), split_spec={split: SplitPoint.BEGINNING})
    rank = dist.get_rank()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    module = stage.submod
    if compiled:  # the stage runs its module through ``self.submod``: compile that
        stage.submod = torch.compile(module)
    schedule = getattr(schedules, TORCH_SCHEDULES[args.schedule])(stage, args.microbatches, loss_fn=causal_lm_loss)
    how = f"split by hand before {split}; tied weights copied into each stage that uses them"
    extra = {"how": how + ("; stage module under torch.compile" if compiled else "")}
    meter = ActivationMeter([stage], list(module.parameters()))

    def step(_module) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(data["input_ids"])
        else:
            schedule.step(target=data["labels"], losses=losses)
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(loss, src=PP - 1)
        return loss

    def tied() -> dict[str, torch.Tensor]:
        names = [None] * PP
        dist.all_gather_object(names, sorted(n for n, _ in module.named_parameters(remove_duplicate=False)))
        params = dict(module.named_parameters(remove_duplicate=False))
        return {name: params[name].detach() for name in sorted(set(names[0]) & set(names[1]))}

    side = Side(side_name("torch pipeline()", compiled), module, step, backward=False, count_collectives=False,
                note="model wrapped to return logits, split by hand", extra=extra,
                profiled_context=meter.measuring)
    return side, tied, meter


def side_name(base: str, compiled: bool) -> str:
    if not compiled:
        return base
    return base + (' recompute=1.0 compile="inductor"' if base.startswith("sptransform") else " + torch.compile")


def anchor(side: str) -> str | None:
    """sptransform's rows against torch's pipeline() in the same mode (eager or compiled)."""
    if not side.startswith("sptransform"):
        return None
    return side_name("torch pipeline()", "compile=" in side)


def tied_max_difference(copies: dict[str, torch.Tensor]) -> float | None:
    """Largest difference between the copies of a weight held by both ranks (None: no copies)."""
    gathered: list = [None] * PP
    dist.all_gather_object(gathered, {n: t.clone() for n, t in copies.items()})
    names = set(gathered[0]) & set(gathered[1])
    if not names:
        return None
    return max(float((gathered[0][n] - gathered[1][n]).abs().max()) for n in names)


# ---------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> dict:
    reference = single_device_losses(args, batch(args), args.warmup + 1 + args.steps)
    readers: dict[str, tuple[Callable, ActivationMeter]] = {}

    def maker(build, compiled: bool):
        def make() -> Side:
            side, tied, meter = build(args, compiled)
            readers[side.name] = tied, meter
            return side
        make.side_name = side_name("sptransform" if build is sptransform_side else "torch pipeline()", compiled)
        return make

    modes = (False, True) if args.compiled else (False,)
    makers = [maker(build, compiled) for compiled in modes for build in (sptransform_side, torch_pipeline_side)]
    results = run_sides(makers, steps=args.steps, warmup=args.warmup, lr=1e-3, profile=True)
    for r in results:
        if "error" not in r:
            tied, meter = readers[r["side"]]
            r["tied_max_difference"] = tied_max_difference(tied())
            r["peak_activation_bytes"] = meter.peaks()
    return {"args": vars(args), "single_device_loss": reference[0], "single_device_last_loss": reference[-1],
            "steps": args.warmup + 1 + args.steps, "results": results}


def single_device_losses(args: argparse.Namespace, data: dict, steps: int) -> list[float]:
    """The unsplit model trained on the same batch with the same optimizer: what every side should match."""
    model = gpt2(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    losses = []
    for _ in range(steps):
        loss = model(**data, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pipeline_lines(result: dict) -> list[str]:
    """Per side: peak activation bytes of each stage, the tied copies, and how it was split."""
    out = []
    for r in result["results"]:
        if "error" in r:
            out.append(f"{r['side']}: FAILED: {r['error']}")
            continue
        diff = r["tied_max_difference"]
        sync = "one copy" if diff is None else ("in sync (max diff 0)" if diff == 0 else f"DIVERGED (max diff {diff:.2e})")
        peaks = " / ".join(f"{b:,}" for b in r.get("peak_activation_bytes", []))
        out.append(f"{r['side']}: peak activation bytes per stage {peaks}; tied copies after {result['steps']} "
                   f"steps: {sync}; {r['how']}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=sorted(TORCH_SCHEDULES), default="1f1b")
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the profiled step")
    parser.add_argument("--compiled", action="store_true",
                        help='also the compiled sides: sptransform recompute=1.0 compile="inductor", and torch '
                             "pipeline() with each stage module under torch.compile")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // PP), help="torch threads per rank")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = launch(worker, args, world=PP)
    print(f"HF GPT-2, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x seq "
          f"{args.seq} in {args.microbatches} microbatches, pp={PP} on gloo, schedule {args.schedule}, AdamW, "
          f"{args.threads} thread(s)/rank, median of {args.steps} steps after {args.warmup + 1}")
    print("one table (each step's time is the slower rank's; collectives (gloo sends and receives), waits, fill_, "
          "peak MiB: one profiled step of rank 0):")
    print(summary_table(result["results"], result["single_device_loss"], anchor=anchor,
                        reference_last=result["single_device_last_loss"]))
    for line in pipeline_lines(result):
        print("  " + line)
    print(f"total {time.perf_counter() - start:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
