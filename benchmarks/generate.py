"""Tokens per second of ``pm.generate`` (tp ranks, gloo, CPU) against the single-device model.

One invocation builds a random HF GPT-2 or Llama and greedily generates ``--new`` tokens for a
``--batch`` of ``--prompt``-token prompts, three ways:

* ``hf``: the single-device model's own ``model.generate`` (with its KV cache);
* ``no-cache``: ``sptransform.generate(model, ...)`` on the single-device model: the same loop as
  the parallel side (each step reruns the whole padded sequence), so the ratio to it is the
  cost of tensor parallelism alone;
* ``tp``: ``pm.generate`` on ``--tp`` spawned gloo ranks;
* ``tp+cache``: a **prototype** KV cache on the same ranks (``CacheStep`` below, greedy, no mask,
  not in the library): ``parallelize`` (sp=False) of a wrapper whose forward takes the cache as
  inputs and returns the new token's K/V, two graphs (prefill, decode against a fixed-length
  cache whose unused slots the mask hides). It measures what a cache buys; its cache is whole on
  every rank (the TP pass places graph inputs Replicate), not split by heads as issue 19 asks.

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


class CacheStep(torch.nn.Module):
    """An HF causal LM run against a cache given as tensors: ``forward(ids, position_ids, attention_mask,
    k0, v0, k1, v1, ...)`` -> (logits, the new tokens' K and V per layer). Functional (no cache object
    survives the call), so capture sees no mutation."""

    def __init__(self, model: torch.nn.Module, layers: int):
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, ids, position_ids, attention_mask, *cache):
        from transformers import DynamicCache

        past = DynamicCache(config=self.model.config)
        for layer in range(self.layers):
            past.update(cache[2 * layer], cache[2 * layer + 1], layer)
        out = self.model(ids, position_ids=position_ids, attention_mask=attention_mask, past_key_values=past,
                         use_cache=True)
        new = ids.shape[1]
        kv = [t[:, :, -new:] for layer in out.past_key_values.layers[: self.layers] for t in (layer.keys, layer.values)]
        return (out.logits, *kv)


def cache_shapes(model: torch.nn.Module, batch: int) -> list[tuple[int, int]]:
    """(K/V heads, head size) of each layer's cache, read from one single-device token."""
    with torch.no_grad():
        past = model(torch.zeros(batch, 1, dtype=torch.long), use_cache=True).past_key_values
    return [(layer.keys.shape[1], layer.keys.shape[3]) for layer in past.layers]


def cached_greedy(step, shapes, ids: torch.Tensor, new: int, dtype) -> torch.Tensor:
    """Greedy tokens from ``step`` (a ``CacheStep``, parallel or not): prefill on the prompt, then one
    token a step against a cache of prompt + new slots; the mask hides the slots not yet written."""
    batch, prompt = ids.shape
    length = prompt + new
    empty = [torch.zeros(batch, heads, 0, size, dtype=dtype) for heads, size in shapes for _ in "kv"]
    out = step(ids, torch.arange(prompt).expand(batch, -1), torch.ones(batch, prompt, dtype=torch.long), *empty)
    cache = [torch.zeros(batch, heads, length, size, dtype=dtype) for heads, size in shapes for _ in "kv"]
    for slot, written in zip(cache, out[1:]):
        slot[:, :, :prompt] = written
    tokens = ids
    for position in range(prompt, length):
        logits = out[0]
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        chosen = logits[:, -1].argmax(-1)[:, None]
        tokens = torch.cat([tokens, chosen], dim=1)
        if position == length - 1:
            break
        mask = torch.zeros(batch, length + 1, dtype=torch.long)
        mask[:, :position] = 1
        mask[:, -1] = 1  # the new token, which the step appends after the cache's slots
        out = step(chosen, torch.full((batch, 1), position), mask, *cache)
        for slot, written in zip(cache, out[1:]):
            slot[:, :, position] = written[:, :, 0]
    return tokens


def worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    import sptransform

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.tp, timeout=datetime.timedelta(seconds=600))
    try:
        model, ids = build_model(args), prompt(args)
        pm = sptransform.parallelize(model, tp=args.tp)
        result = timed(lambda: pm.generate(ids, max_new_tokens=args.new, pad_token_id=0), args)
        shapes, dtype = cache_shapes(model, args.batch), getattr(torch, args.dtype)
        prefill = (ids, torch.arange(args.prompt).expand(args.batch, -1),
                   torch.ones(args.batch, args.prompt, dtype=torch.long),
                   *[torch.zeros(args.batch, heads, 0, size, dtype=dtype) for heads, size in shapes for _ in "kv"])
        step = sptransform.parallelize(CacheStep(model, len(shapes)), tp=args.tp, sp=False, example_inputs=prefill)
        with torch.no_grad():
            cached = timed(lambda: cached_greedy(step, shapes, ids, args.new, dtype), args)
        if rank == 0:  # plain lists: a tensor sent to the parent would live in this process's shared memory
            queue.put({**result, "tokens": result["tokens"].tolist()})
            queue.put({**cached, "tokens": cached["tokens"].tolist()})
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
