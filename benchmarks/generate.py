"""Tokens per second of ``pm.generate`` (tp ranks, gloo, CPU) against the single-device model.

One invocation builds a random HF GPT-2 or Llama and greedily generates ``--new`` tokens for a
``--batch`` of ``--prompt``-token prompts, four ways:

* ``hf``: the single-device model's own ``model.generate`` (with its KV cache);
* ``no-cache``: ``sptransform.generate(model, ...)`` on the single-device model: the same loop as
  the parallel side (each step reruns the whole padded sequence), so the ratio to it is the
  cost of tensor parallelism alone;
* ``tp``: ``pm.generate(..., use_cache=False)`` on ``--tp`` spawned gloo ranks (every step the
  whole padded sequence);
* ``tp+cache``: ``pm.generate`` on the same ranks with its KV cache (``runtime.kv_cache``: a
  prefill graph, then one decode graph per token; each rank holds its K/V heads).

Each side runs once untimed (the parallel side captures its graph then: printed as ``first
call``), then ``--runs`` timed runs; printed: median seconds, tokens/s, and whether the tokens
equal ``hf``'s. Every rank and the single-device sides use ``--threads`` intra-op threads.

    python benchmarks/generate.py [--model gpt2|llama --layers 4 --hidden 256 --heads 8 --vocab 4096
        --batch 2 --prompt 32 --new 32 --tp 2 --runs 3 --threads 1 --dtype float32]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def build_model(args: argparse.Namespace):
    import transformers as T

    torch.manual_seed(0)
    if args.model == "gpt2":
        config = T.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                              n_positions=args.prompt + args.new + args.tp)
        model = T.GPT2LMHeadModel(config)
    else:
        config = T.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               num_key_value_heads=args.heads // 2, intermediate_size=args.hidden * 3,
                               vocab_size=args.vocab, max_position_embeddings=args.prompt + args.new + args.tp)
        model = T.LlamaForCausalLM(config)
    return model.to(getattr(torch, args.dtype)).eval()


def prompt(args: argparse.Namespace) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(1, args.vocab, (args.batch, args.prompt))


def timed(generate, args: argparse.Namespace) -> dict:
    """First call (untimed warm-up, includes any capture), then the median of ``--runs`` calls."""
    start = time.perf_counter()
    tokens = generate()
    first = time.perf_counter() - start
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        generate()
        times.append(time.perf_counter() - start)
    return dict(first_s=first, median_s=statistics.median(times), tokens=tokens)


def worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    import sptransform

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.tp, timeout=datetime.timedelta(seconds=600))
    try:
        model, ids = build_model(args), prompt(args)
        pm = sptransform.parallelize(model, tp=args.tp, sp=args.tp > 1 and args.prompt % args.tp == 0)
        results = [timed(lambda: pm.generate(ids, max_new_tokens=args.new, pad_token_id=0, use_cache=False), args),
                   timed(lambda: pm.generate(ids, max_new_tokens=args.new, pad_token_id=0), args)]
        if rank == 0:  # plain lists: a tensor sent to the parent would live in this process's shared memory
            for result in results:
                queue.put({**result, "tokens": result["tokens"].tolist()})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("layers", 4), ("hidden", 256), ("heads", 8), ("vocab", 4096), ("batch", 2),
                          ("prompt", 32), ("new", 32), ("tp", 2), ("runs", 3), ("threads", 1)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = parser.parse_args()

    import sptransform

    torch.set_num_threads(args.threads)
    model, ids = build_model(args), prompt(args)
    with torch.no_grad():
        sides = {"hf": timed(lambda: model.generate(ids, max_new_tokens=args.new, do_sample=False, pad_token_id=0), args),
                 "no-cache": timed(lambda: sptransform.generate(model, ids, max_new_tokens=args.new, pad_token_id=0),
                                   args)}
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args, port, queue), nprocs=args.tp, start_method="spawn")
    for name in (f"tp={args.tp}", f"tp={args.tp}+cache"):
        result = queue.get()
        sides[name] = {**result, "tokens": torch.tensor(result["tokens"])}

    generated = args.batch * args.new
    print(f"{args.model}: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {args.dtype}, "
          f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, {args.threads} thread(s) per process")
    print(f"{'side':<12} {'first call s':>12} {'median s':>9} {'tokens/s':>9} {'vs hf':>7} {'vs no-cache':>11}  tokens = hf")
    for name, side in sides.items():
        rate = generated / side["median_s"]
        print(f"{name:<12} {side['first_s']:>12.3f} {side['median_s']:>9.3f} {rate:>9.1f} "
              f"{sides['hf']['median_s'] / side['median_s']:>7.3f} "
              f"{sides['no-cache']['median_s'] / side['median_s']:>11.3f}  "
              f"{torch.equal(side['tokens'], sides['hf']['tokens'])}")


if __name__ == "__main__":
    main()
