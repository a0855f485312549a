"""How long ``compile="inductor"`` takes to compile and how fast it then trains, against
``compile="eager"`` (the partitioned ATen graphs run op by op), on one process (CPU).

The ``sptransform`` torch.compile backend with ``policy="selective"`` on a tiny HF GPT-2
(dropout 0): per mode, ``--repeats`` fresh compiles (``torch._dynamo.reset()``, inductor's
caches off), each timed as its first training step (forward + backward) less the median
later step; and the median of ``--steps`` training steps after it.

    python benchmarks/compile_modes.py [--layers 2 --hidden 128 --heads 4 --vocab 1024
        --seq 128 --batch 4 --repeats 5 --steps 5 --threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # each compile is a real one

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing sptransform
    sys.path.insert(0, ROOT)


def _step(model, ids) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return time.perf_counter() - start


def measure(args) -> dict:
    import torch._dynamo
    import transformers

    from sptransform.backend import sptransform_backend

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                     vocab_size=args.vocab, n_positions=args.seq, attn_implementation="eager",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"  # unset, HF logs a warning inside the traced forward
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    results = {}
    eager_model = copy.deepcopy(model)
    eager_steps = [_step(eager_model, ids) for _ in range(args.steps + 1)][1:]
    results["torch eager (no compile)"] = dict(compile_s=0.0, step_ms=1e3 * statistics.median(eager_steps))
    for mode in ("eager", "inductor"):
        compiles, steps = [], []
        for _ in range(args.repeats):
            torch._dynamo.reset()
            copied = copy.deepcopy(model)
            compiled = torch.compile(copied, backend=sptransform_backend,
                                     options={"policy": "selective", "compile": mode}, fullgraph=True)
            first = _step(compiled, ids)
            later = [_step(compiled, ids) for _ in range(args.steps)]
            compiles.append(first - statistics.median(later))
            steps.extend(later)
        results[f'backend compile="{mode}"'] = dict(compile_s=statistics.median(compiles),
                                                    step_ms=1e3 * statistics.median(steps))
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier on a shared machine, where OpenMP spin-waits)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args)
    print(f"HF GPT-2 {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x seq "
          f"{args.seq}, recompute selective; {torch.get_num_threads()} threads; medians of {args.repeats} compiles, "
          f"{args.steps} steps each")
    print(f"{'side':34} {'compile s':>10} {'step ms':>9}")
    for side, r in results.items():
        print(f"{side:34} {r['compile_s']:10.2f} {r['step_ms']:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
