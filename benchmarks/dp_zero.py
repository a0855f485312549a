"""Data parallelism x tensor parallelism, ZeRO 0, 1, 2 and 3, on HF GPT-2 and Llama.

One invocation spawns ``dp * tp`` gloo ranks (default 2 x 2 = 4) and, per model and ZeRO stage,
trains ``parallelize(model, tp, dp, zero)`` for ``--steps`` AdamW steps on each rank's own batch.
Per rank 0 it reports:

* the bytes this rank holds of parameters, gradients and AdamW state (local shards, measured
  after a step), beside the planner's ``model_state_bytes`` for the same layout (fp32 weights
  and gradients, 8 bytes of AdamW state per parameter; a parameter counts ``1/tp`` when
  its tensor-parallel placement splits it, whole otherwise) and the ratio measured / planner;
* the gathered parameters autograd keeps from the forward to the backward (bytes of the distinct
  storages saved for backward that ``runtime.zero.gather_params`` made, at the end of the first
  forward: ZeRO 1 and 2 keep them, ZeRO-3 stores its bucket instead and gathers again, counted by
  its own hook), and every tensor saved for backward;
* the ratio ZeRO-n / ZeRO-0 of those bytes (the target is ``1/dp``);
* the median step time (forward + backward + optimizer) after ``--warmup`` steps.

    python benchmarks/dp_zero.py [--dp 2 --tp 2 --layers 4 --hidden 256 --heads 8 --vocab 4096
        --seq 128 --batch 2 --steps 6 --warmup 2 --zero 0 1 2 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODELS = ("gpt2", "llama")
ZERO_STAGES = (0, 1, 2, 3)


def _model(kind: str, args):
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                         vocab_size=args.vocab, n_positions=args.seq, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                      num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                                      intermediate_size=args.hidden * 8 // 3, vocab_size=args.vocab,
                                      max_position_embeddings=args.seq)
    return transformers.LlamaForCausalLM(config)


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def _planner_bytes(pm, tp: int, dp: int, zero: int) -> dict:
    """The planner's per-rank model state for this layout (fp32 weights/gradients, AdamW)."""
    from sptransform.planner.memory import model_state_bytes
    from sptransform.planner.workload import StateBytes

    params = 0.0
    for p in pm.parameters():
        tp_placement = p.placements[-1]
        params += p.numel() / (1 if tp_placement.is_replicate() else tp)  # Shard or _StridedShard (fused QKV)
    state = model_state_bytes(params, zero_stage=zero, dp=dp, state_bytes=StateBytes(weights=4, gradients=4, optimizer=8))
    return dict(params=state.weights, grads=state.gradients, optimizer=state.optimizer)


class _Saved:
    """Saved-tensor hooks that count the distinct storages autograd keeps for backward, and those
    of them that are gathered parameters. ZeRO-3's own hooks are inner ones and hide its tensors
    from these, so its hook class is replaced by ``regather_class``, which counts what it stores
    as a bucket instead (``regathered``) and passes what it keeps to ``pack``."""

    def __init__(self):
        from sptransform.runtime import zero as zero_
        from sptransform.torch_internals import StorageWeakRef

        self.saved, self.gathered, self.regathered = {}, {}, {}
        counter = self

        class Counting(zero_.Regather):
            def pack(self, tensor):
                packed = super().pack(tensor)
                if packed is not tensor:
                    counter.regathered[StorageWeakRef(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
                    return packed
                return counter.pack(tensor)  # kept: counted as the outer hooks count it

        self.regather_class, self._ref, self._gathered = Counting, StorageWeakRef, zero_._gathered

    def pack(self, tensor):
        key, size = self._ref(tensor.untyped_storage()), tensor.untyped_storage().nbytes()
        self.saved[key] = size
        if self._gathered(tensor) is not None:
            self.gathered[key] = size
        return tensor


def _run_case(kind: str, zero: int, args) -> dict:
    import sptransform
    import sptransform.runtime.module as module_

    rank, tp, dp = dist.get_rank(), args.tp, args.dp
    dp_rank = rank // tp
    torch.manual_seed(1 + dp_rank)  # each data-parallel replica trains on its own batch
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq)) for _ in range(args.steps)]
    pm = sptransform.parallelize(_model(kind, args), tp=tp, dp=dp, zero=zero,
                                 example_inputs=dict(input_ids=batches[0], labels=batches[0]))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    times, losses, saved = [], [], None
    for ids in batches:
        dist.barrier()
        start = time.perf_counter()
        if saved is None:  # the first step (not timed below: warmup) counts what backward keeps
            saved = _Saved()
            original, module_.regather_saved = module_.regather_saved, saved.regather_class
            try:
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    loss = pm(input_ids=ids, labels=ids).loss
            finally:
                module_.regather_saved = original
        else:
            loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = _local_bytes([p.grad for p in pm.parameters()])
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    measured = dict(params=_local_bytes(list(pm.parameters())), grads=grads, optimizer=_local_bytes(state))
    kept = dict(gathered=sum(saved.gathered.values()), regathered=sum(saved.regathered.values()),
                saved=sum(saved.saved.values()))
    return dict(measured=measured, planner=_planner_bytes(pm, tp, dp, zero), kept=kept,
                step_s=statistics.median(times[args.warmup:]), first_loss=losses[0], last_loss=losses[-1])


def _worker(rank: int, world: int, port: int, args, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        for kind in MODELS:
            for zero in args.zero:
                result = _run_case(kind, zero, args)
                if rank == 0:
                    out[f"{kind} zero={zero}"] = result
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _table(results: dict, args) -> str:
    lines = [f"dp={args.dp} x tp={args.tp} ({args.dp * args.tp} gloo ranks), {args.layers} layers, hidden {args.hidden}, "
             f"vocab {args.vocab}, batch {args.batch} x seq {args.seq} per replica; bytes on rank 0",
             "| model | zero | params B (planner) | grads B (planner) | AdamW state B (planner) | measured/planner | "
             "gathered params kept for backward B | regathered B | saved for backward B | step s (median) | "
             "loss first -> last |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        kind, zero = key.split(" zero=")
        m, p, k = r["measured"], r["planner"], r["kept"]
        total_m, total_p = sum(m.values()), sum(p.values())
        lines.append(f"| {kind} | {zero} | {m['params']:,} ({p['params']:,.0f}) | {m['grads']:,} ({p['grads']:,.0f}) | "
                     f"{m['optimizer']:,} ({p['optimizer']:,.0f}) | {total_m / total_p:.4f} | {k['gathered']:,} | "
                     f"{k['regathered']:,} | {k['saved']:,} | {r['step_s']:.4f} | "
                     f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} |")
    lines.append("")
    for kind in MODELS if 0 in args.zero else ():
        z0 = results[f"{kind} zero=0"]
        for zero in [z for z in args.zero if z]:
            zn = results[f"{kind} zero={zero}"]
            ratios = {k: zn["measured"][k] / z0["measured"][k] for k in z0["measured"]}
            state = ((zn["measured"]["params"] + zn["measured"]["optimizer"])
                     / (z0["measured"]["params"] + z0["measured"]["optimizer"]))
            lines.append(f"{kind}: zero{zero}/zero0 params {ratios['params']:.4f}, grads {ratios['grads']:.4f}, AdamW "
                         f"state {ratios['optimizer']:.4f}, params+optimizer {state:.4f} (target 1/dp = "
                         f"{1 / args.dp:.4f}); step time zero{zero}/zero0 {zn['step_s'] / z0['step_s']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dp", 2), ("tp", 2), ("layers", 4), ("hidden", 256), ("heads", 8), ("vocab", 4096),
                          ("seq", 128), ("batch", 2), ("steps", 6), ("warmup", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--zero", type=int, nargs="+", choices=ZERO_STAGES, default=ZERO_STAGES,
                        help="ZeRO stages to run (default all; the ratios need 0)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: the median is over the steps after it")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    world = args.dp * args.tp
    mp.spawn(_worker, args=(world, port, args, out), nprocs=world, join=True)
    results = {key: out[key] for key in (f"{k} zero={z}" for k in MODELS for z in args.zero)}
    print(_table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
