"""sptransform against transformers' own tensor parallelism (``tp_plan="auto"``), on HF Llama.

A small random ``LlamaForCausalLM`` is saved with ``save_pretrained`` to a temporary
folder; then one invocation spawns ``--tp`` ranks (gloo, CPU) that each load it

* with ``from_pretrained(dir, tp_plan="auto", dtype=torch.float32)``: transformers'
  hand-written per-model plan (``config.base_model_tp_plan``), tensor parallel only;
* with ``from_pretrained(dir, dtype=torch.float32)`` and ``sptransform.parallelize(model,
  tp=tp, sp=True)``, and ``sp=False`` (tensor parallel only, like the anchor);

and trains each for a few AdamW steps on the same batch. Printed per side: first loss
(and the single-device loss), loss after the timed steps, median step time, collectives
per step counted at the dispatcher (forward | backward | optimizer) and bytes, and the
ratio sptransform / transformers. If ``tp_plan="auto"`` fails here its exact error is
printed and the sptransform side still runs.

    python benchmarks/tp_vs_hf_auto.py [--layers 4 --hidden 256 --heads 8 --kv-heads 4
        --mlp 688 --vocab 4096 --seq 256 --batch 4 --steps 8 --warmup 2] [--json out.json]

The launcher, counter, timing loop and table come from ``tp_vs_dtensor.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_vs_dtensor import (  # noqa: E402  (the harness lives beside this file)
    Side, batch, common_args, finish, graph_lines, launch, log, quiet, ratio_lines, run_sides, sptransform_graph_counts,
)


def llama_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 64),
        attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )


def save_model(args: argparse.Namespace, folder: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    LlamaForCausalLM(llama_config(args)).save_pretrained(folder)


def hf_auto_worker(args: argparse.Namespace) -> dict:
    import sptransform
    from transformers import LlamaForCausalLM

    ids, labels = batch(args)

    def load(**kw):
        return LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa", **kw).train()

    def hf_loss(m):
        return m(input_ids=ids, labels=labels, use_cache=False).loss

    with torch.no_grad():
        reference = float(hf_loss(load()))
    log(f"single device: {reference}")

    def ours(sp: bool):
        def make() -> Side:
            pm = sptransform.parallelize(
                load(), tp=args.tp, sp=sp, example_inputs={"input_ids": ids, "labels": labels, "use_cache": False}
            )
            return Side(f"sptransform sp={sp}", pm, hf_loss, note="from_pretrained(dir) + parallelize",
                        extra={"graph": sptransform_graph_counts(pm, args.tp)})
        make.side_name = f"sptransform sp={sp}"
        return make

    def hf_auto() -> Side:
        model = load(tp_plan="auto")
        return Side('transformers tp_plan="auto"', model, hf_loss, note="from_pretrained(dir, tp_plan='auto')")
    hf_auto.side_name = 'transformers tp_plan="auto"'

    results = run_sides([ours(True), ours(False), hf_auto], steps=args.steps, warmup=args.warmup, lr=args.lr)
    return {"config": vars(args), "single_device_loss": reference, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), vocab=4096)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=688, help="intermediate size")
    args = parser.parse_args(argv)
    quiet()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        args.model_dir = folder
        save_model(args, folder)
        result = launch(hf_auto_worker, args)
    del result["config"]["model_dir"]
    hf = 'transformers tp_plan="auto"'
    failed = [r for r in result["results"] if "error" in r]
    lines = [
        "",
        f"single-device first loss: {result['single_device_loss']:.6f}",
        *ratio_lines(result["results"], [("sptransform sp=False", hf), ("sptransform sp=True", hf)]),
        *graph_lines(result["results"]),
        *(f"{r['side']} did not run: {r['error']}" for r in failed),
        f"total {time.perf_counter() - start:.0f}s",
    ]
    a = args
    finish(args, f"HF Llama, {a.layers} layers, hidden {a.hidden}, {a.heads} heads / {a.kv_heads} KV heads, MLP {a.mlp}, "
                 f"vocab {a.vocab}, seq {a.seq}, batch {a.batch}, tp={a.tp} on CPU/gloo, {a.threads} thread(s)/rank, "
                 f"AdamW, median of {a.steps} steps", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
