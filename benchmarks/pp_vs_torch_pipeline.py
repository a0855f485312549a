"""sptransform's pipeline split against ``torch.distributed.pipelining.pipeline()``, on HF GPT-2 (pp=2).

One invocation spawns 2 ranks (gloo, CPU) and trains the same HF GPT-2 (tied
embedding and head, dropout 0) with the same torch schedule and microbatches, two ways:

* **sptransform**: ``parallelize(model, tp=1, pp=2, schedule=..., n_microbatches=...)`` on the
  unmodified model: cut found on the graph, balanced by measured cost, the model's own
  loss, tied weights kept in sync;
* **torch pipeline()**: the model wrapped to return logits (torch's schedules compute
  the loss from the last stage's output and ``target``), split by hand with
  ``split_spec={"model.transformer.h.<L/2>": SplitPoint.BEGINNING}``, one
  ``PipelineStage`` per rank from ``pipe.build_stage``, the same schedule class, and a
  ``loss_fn`` computing HF's shifted causal-LM cross-entropy.

The sides alternate step by step (this box is noisy). Per side: first loss (and the
single-device loss), last loss, median step time after warm-up, peak activation bytes
per stage (storages autograd saved for backward plus forward outputs the stage still
holds, sampled at every save, parameters left out), and whether the tied
embedding/head copies are equal after the steps.

    python benchmarks/pp_vs_torch_pipeline.py [--layers 4 --hidden 256 --heads 8 --vocab 8192
        --seq 128 --batch 8 --microbatches 4 --schedule 1f1b --steps 6 --warmup 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing sptransform
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_vs_dtensor import launch  # noqa: E402  (the harness lives beside this file)

PP = 2
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def gpt2(args: argparse.Namespace) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab, n_positions=args.seq,
        attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).train()


def batches(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(1)
    return [dict(input_ids=torch.randint(0, args.vocab, (args.batch, args.seq)),
                 labels=torch.randint(0, args.vocab, (args.batch, args.seq)))
            for _ in range(args.warmup + args.steps)]


# ---------------------------------------------------------------------------
# Peak activation bytes of one rank's stages


class ActivationMeter:
    """Live bytes held for backward: every storage autograd saves (pack hook, weak
    references, parameters excluded) plus the stages' forward outputs still held
    (``fwd_cache``), sampled at every save. Used alike on both sides."""

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

    def run(self, fn):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            return fn()


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


# ---------------------------------------------------------------------------
# The two sides: each has step(batch) -> loss on every rank, stages, params, tied copies


class SptransformSide:
    name = "sptransform"

    def __init__(self, args):
        import sptransform

        self.model = sptransform.parallelize(gpt2(args), tp=1, pp=PP, schedule=args.schedule,
                                             n_microbatches=args.microbatches, example_inputs=batches(args)[0])
        self.stages = self.model._stages
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        plan = self.model.pipeline_plan
        ends = plan.starts[1:] + [plan.num_layers]
        layers = ", ".join(f"stage {i}: layers {a}-{b - 1}" for i, (a, b) in enumerate(zip(plan.starts, ends)))
        self.how = f"cut found and balanced on measured cost ({layers}); tied weights synced"

    def step(self, batch) -> float:
        loss = self.model.step(**batch)
        self.opt.step()
        self.opt.zero_grad()
        return float(loss)

    def tied_copies(self) -> dict[str, torch.Tensor]:
        held = dict(self.model.named_parameters(remove_duplicate=False))
        return {t.name: held[t.name].full_tensor().detach() for t in self.model.pipeline_plan.tied if t.name in held}


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


class TorchPipelineSide:
    name = "torch pipeline()"

    def __init__(self, args):
        from torch.distributed.pipelining import SplitPoint, pipeline
        from torch.distributed.pipelining import schedules

        first = batches(args)[0]
        micro = first["input_ids"][: args.batch // args.microbatches]
        split = f"model.transformer.h.{args.layers // 2}"
        pipe = pipeline(Logits(gpt2(args)), mb_args=(micro,), split_spec={split: SplitPoint.BEGINNING})
        self.rank = dist.get_rank()
        stage = pipe.build_stage(self.rank, torch.device("cpu"))
        self.stages = [stage]
        self.module = stage.submod
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-3)
        schedule_class = getattr(schedules, TORCH_SCHEDULES[args.schedule])
        self.schedule = schedule_class(stage, args.microbatches, loss_fn=causal_lm_loss)
        self.how = f"split by hand before {split}; tied weights copied into each stage that uses them"

    def step(self, batch) -> float:
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(batch["input_ids"])
        else:
            self.schedule.step(target=batch["labels"], losses=losses)
        self.opt.step()
        self.opt.zero_grad()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(loss, src=PP - 1)
        return float(loss)

    def tied_copies(self) -> dict[str, torch.Tensor]:
        names = [None] * PP
        mine = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        dist.all_gather_object(names, sorted(mine))
        shared = set(names[0]) & set(names[1])
        params = dict(self.module.named_parameters(remove_duplicate=False))
        return {name: params[name].detach() for name in sorted(shared)}


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
    data = batches(args)
    reference = single_device_losses(args, data)
    sides, errors = [], []
    for make in (SptransformSide, TorchPipelineSide):
        try:
            sides.append(make(args))
        except Exception as error:  # report a side that does not run instead of stopping the other
            errors.append({"side": make.name, "error": f"{type(error).__name__}: {str(error)[:300]}"})
            traceback.print_exc()
    times = {s.name: [] for s in sides}
    losses = {s.name: [] for s in sides}
    peaks = {s.name: 0 for s in sides}
    for i, batch in enumerate(data):
        for side in sides:
            meter = ActivationMeter(side.stages, list(side.stages[0].submod.parameters()))
            dist.barrier()
            start = time.perf_counter()
            losses[side.name].append(meter.run(lambda: side.step(batch)))
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                times[side.name].append(elapsed)
            peaks[side.name] = max(peaks[side.name], meter.peak)
    results = []
    for side in sides:
        stage_peaks: list = [None] * PP
        dist.all_gather_object(stage_peaks, peaks[side.name])
        results.append({
            "side": side.name, "first_loss": losses[side.name][0], "last_loss": losses[side.name][-1],
            "step_s": statistics.median(times[side.name]), "peak_activation_bytes": stage_peaks,
            "tied_max_difference": tied_max_difference(side.tied_copies()), "how": side.how,
        })
    return {"args": vars(args), "single_device_loss": reference[0], "single_device_last_loss": reference[-1],
            "steps": len(data), "results": results + errors}


def single_device_losses(args: argparse.Namespace, data: list[dict]) -> list[float]:
    """The unsplit model trained on the same batches with the same optimizer: what both sides should match."""
    model = gpt2(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in data:
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def table(result: dict) -> str:
    rows = [("side", "first loss", "last loss", "step (s)", "peak act. stage 0", "peak act. stage 1",
             f"tied copies after {result['steps']} steps")]
    for r in result["results"]:
        if "error" in r:
            rows.append((r["side"], "error: " + r["error"][:60], "", "", "", "", ""))
            continue
        diff = r["tied_max_difference"]
        sync = "one copy" if diff is None else ("in sync (max diff 0)" if diff == 0 else f"DIVERGED (max diff {diff:.2e})")
        rows.append((r["side"], f"{r['first_loss']:.6f}", f"{r['last_loss']:.6f}", f"{r['step_s']:.3f}",
                     f"{r['peak_activation_bytes'][0]:,}", f"{r['peak_activation_bytes'][1]:,}", sync))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // PP), help="torch threads per rank")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    args.tp = PP  # the shared launcher spawns ``args.tp`` ranks
    result = launch(worker, args)
    print(f"HF GPT-2, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x seq "
          f"{args.seq} in {args.microbatches} microbatches, pp={PP} on gloo, schedule {args.schedule}")
    print(f"single device: first loss {result['single_device_loss']:.6f}, last loss {result['single_device_last_loss']:.6f}")
    print(table(result))
    for r in result["results"]:
        if "how" in r:
            print(f"  {r['side']}: {r['how']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
