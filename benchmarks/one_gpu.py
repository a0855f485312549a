"""One device, compiled as users train: sptransform's partition + inductor against plain ``torch.compile``.

    python benchmarks/one_gpu.py                       # on a CUDA device, the sizes below
    python benchmarks/one_gpu.py --device cpu --layers 1 --hidden 64 --heads 4 --seq 32 --batch 2 \
        --vocab 512 --dtype float32 --steps 3          # the same code path, small, on a CPU

Per model (HF GPT-2 and HF Llama built from configs, random weights, SDPA attention, dropout 0,
the token loss computed on the logits inside the compiled region), per side:

* ``eager``: the model as is;
* ``torch.compile``: ``torch.compile(model)`` (inductor, torch's own partition);
* ``backend <policy>``: ``torch.compile(model, backend="sptransform", options={"policy": ...})``
  (sptransform's partition of the joint graph, the two graphs compiled by inductor);
* ``parallelize tp=1 selective``: ``sptransform.parallelize(model, tp=1, recompute="selective")``,
  the module users get (input checks, its own graph capture and partition, inductor).

Measured on each: first step (compile included), median / min / max of ``--steps`` training steps
(forward, backward, AdamW; synchronised), the loss of the first step (every side must match
``eager``), peak memory allocated during a step beyond the parameters, gradients and optimizer
state, and the bytes a forward leaves allocated for its backward (allocated after the forward
less before it). Beside the measured bytes: the bytes the partitioned graphs say they keep
(``sptransform.measure.partition_module``: ours for the backend sides, ``"torch-inductor"`` for
``torch.compile``), traced on the same device, inputs and dtype.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SIDES = ("eager", "torch.compile", "backend none", "backend selective", "backend budget 0.5",
         "parallelize tp=1 selective")


class TokenLoss(nn.Module):
    """``model(ids).logits`` and the mean token cross entropy against ``labels``, as one call."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # use_cache left at its default: with it off, HF looks for packed sequences in the
        # position ids with a data-dependent branch that AOTAutograd (the graph readings) cannot trace
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(name: str, args) -> nn.Module:
    import transformers

    common = dict(vocab_size=args.vocab, attn_implementation="sdpa")
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                         n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         **common)
        model = transformers.GPT2LMHeadModel(config)
    elif name == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or max(1, args.heads // 4),
                                          intermediate_size=args.hidden * 11 // 4, max_position_embeddings=args.seq,
                                          **common)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown model {name!r}: use gpt2 or llama")
    return model.to(device=args.device, dtype=DTYPES[args.dtype]).train()


def make_side(side: str, base: nn.Module, ids: torch.Tensor):
    import sptransform
    from sptransform.backend import sptransform_backend

    module = TokenLoss(copy.deepcopy(base))
    if side == "eager":
        return module, module
    if side == "torch.compile":
        return module, torch.compile(module)
    if side.startswith("backend "):
        policy, *budget = side.split()[1:]
        options = {"policy": policy, **({"budget": float(budget[0])} if budget else {})}
        return module, torch.compile(module, backend=sptransform_backend, options=options)
    if side == "parallelize tp=1 selective":
        pm = sptransform.parallelize(module, tp=1, example_inputs=(ids, ids), recompute="selective")
        return pm, pm
    raise ValueError(f"unknown side {side!r}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def run_side(side: str, base: nn.Module, ids: torch.Tensor, args) -> dict:
    params_module, call = make_side(side, base, ids)
    optimizer = torch.optim.AdamW(params_module.parameters(), lr=1e-4, foreach=True)
    cuda = args.device.startswith("cuda")

    def step(record: dict | None = None) -> float:
        optimizer.zero_grad(set_to_none=True)
        _sync(args.device)
        start = time.perf_counter()
        before = _allocated(args.device)
        loss = call(ids, ids)
        if record is not None:
            _sync(args.device)
            record["kept_after_forward"] = _allocated(args.device) - before
            record["loss"] = float(loss.detach())
        loss.backward()
        optimizer.step()
        _sync(args.device)
        return time.perf_counter() - start

    first: dict = {}
    first_s = step(first)
    step()  # AdamW's state now exists: the baseline below includes it
    optimizer.zero_grad(set_to_none=True)
    _sync(args.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = _allocated(args.device)
    kept: dict = {}
    times = [step(kept)] + [step() for _ in range(args.steps - 1)]
    peak = (torch.cuda.max_memory_allocated() - baseline) if cuda else 0
    profile = kernels(step, args) if args.profile else None
    return dict(profile=profile, first_s=first_s, loss=first["loss"], median_ms=1e3 * statistics.median(times),
                min_ms=1e3 * min(times), max_ms=1e3 * max(times), peak_step_bytes=peak,
                kept_bytes=kept["kept_after_forward"])


def kernels(step, args, steps: int = 3, top: int = 12) -> dict:
    """Device kernels of ``steps`` training steps under torch.profiler: count and time per step,
    and the ``top`` kernels by total time (where a side's step time goes)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if args.device.startswith("cuda") else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA] \
        if activity is ProfilerActivity.CUDA else list(prof.key_averages())
    attr = "self_device_time_total" if activity is ProfilerActivity.CUDA else "self_cpu_time_total"
    events.sort(key=lambda e: -getattr(e, attr))
    total_us = sum(getattr(e, attr) for e in events)
    return dict(kernels_per_step=sum(e.count for e in events) / steps, device_ms_per_step=total_us / 1e3 / steps,
                top=[(e.key[:90], e.count // steps, round(getattr(e, attr) / 1e3 / steps, 3)) for e in events[:top]])


def predicted_bytes(side: str, base: nn.Module, ids: torch.Tensor) -> int | None:
    """What the partitioned graphs of this side keep for backward, read off the graphs."""
    from sptransform.measure import partition_module
    from sptransform.passes.remat import RematOptions

    module = TokenLoss(copy.deepcopy(base))
    if side == "torch.compile":
        return partition_module(module, (ids, ids), torch_partitioner="torch-inductor").memory().total
    if side.startswith("backend ") or side.startswith("parallelize"):
        words = side.split()
        policy = words[1] if side.startswith("backend ") else words[-1]
        options = RematOptions(policy=policy, budget=float(words[2]) if len(words) > 2 and policy == "budget" else None)
        return partition_module(module, (ids, ids), options=options).memory().total
    return None


def measure(args) -> dict:
    torch.manual_seed(0)
    results: dict = {}
    for name in args.models:
        base = build(name, args)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
        rows = results.setdefault(name, {})
        for side in args.sides:
            torch._dynamo.reset()
            try:
                rows[side] = run_side(side, base, ids, args)
            except Exception as error:  # one side failing must not lose the others' figures
                rows[side] = dict(error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
                traceback.print_exc()
            try:
                rows[side]["predicted_bytes"] = predicted_bytes(side, base, ids)
            except Exception as error:
                rows[side]["predicted_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                traceback.print_exc()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            print(f"[{name}] {side}: {rows[side]}", flush=True)
            if args.json:  # after every side: a run stopped at its time limit keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(dict(args=vars(args), results=results), f, indent=2)
    return results


def table(results: dict, args) -> str:
    mib = 2.0 ** 20
    lines = [f"{'model':6} {'side':28} {'first s':>8} {'median ms':>10} {'min':>8} {'max':>8} {'/compile':>8} "
             f"{'loss':>9} {'peak MiB':>9} {'kept MiB':>9} {'graph MiB':>9}"]
    for name, rows in results.items():
        anchor = rows.get("torch.compile", {}).get("median_ms")
        for side, r in rows.items():
            if "error" in r:
                lines.append(f"{name:6} {side:28} failed: {r['error']}")
                continue
            ratio = f"{r['median_ms'] / anchor:.2f}x" if anchor else ""
            graph = f"{r['predicted_bytes'] / mib:9.1f}" if r.get("predicted_bytes") is not None else f"{'':>9}"
            lines.append(f"{name:6} {side:28} {r['first_s']:8.1f} {r['median_ms']:10.2f} {r['min_ms']:8.2f} "
                         f"{r['max_ms']:8.2f} {ratio:>8} {r['loss']:9.5f} {r['peak_step_bytes'] / mib:9.1f} "
                         f"{r['kept_bytes'] / mib:9.1f} {graph}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--sides", nargs="+", default=list(SIDES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="Llama's K/V heads (default heads // 4)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true",
                        help="also profile 3 steps per side: kernels per step, device time, the top kernels")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    unknown = sorted(set(args.sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown side(s) {unknown}; choose from {list(SIDES)}")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    header = (f"{device}, torch {torch.__version__}; {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
              f"vocab {args.vocab}, batch {args.batch} x seq {args.seq}, {args.dtype}; medians of {args.steps} steps "
              f"(forward, backward, AdamW)")
    print(header, flush=True)
    results = measure(args)
    print(header)
    print(table(results, args))
    if args.profile:
        for name, rows in results.items():
            for side, r in rows.items():
                if r.get("profile"):
                    p = r["profile"]
                    print(f"{name} {side}: {p['kernels_per_step']:.0f} kernels per step, {p['device_ms_per_step']:.2f} ms")
                    for key, count, ms in p["top"]:
                        print(f"    {ms:8.3f} ms {count:4d}x {key}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, args=vars(args), results=results), f, indent=2)
    return results


if __name__ == "__main__":
    main()
