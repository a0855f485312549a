"""Saved bytes against recompute FLOPs: sptransform's budget policy beside every other partition.

    python benchmarks/remat_frontier.py                       # all three settings, table + PNG
    python benchmarks/remat_frontier.py --setting 175b-layer  # one setting
    python benchmarks/remat_frontier.py --png docs/remat_frontier.png

Settings (all traced under fake tensors, nothing allocated):
  gpt2-small       examples/nanogpt.py GPT at GPT-2 small (12 layers, h=768, 12 heads, vocab 50257),
                   seq 1024, batch 4, bf16, dropout 0.1, one device;
  gpt2-small-tp2   the same, tp=2 with sequence parallelism (rank 0 of sptransform.parallelize);
  175b-layer       one GPT-3 175B layer (examples/nanogpt.py Block), s=2048, b=1, bf16.

Points, each measured on its own partitioned graphs (bytes saved for backward, unique
storages, parameters left out; recompute = the forward ops found again in the backward
graph, counted there):
sptransform's "none", "selective", "full", "norm_upproj" (DeepSeek-V3: norms and the MLP
up-projection); torch's default min-cut partitioner; torch's activation_memory_budget
knapsack swept over its budget fraction; and sptransform's budget policy at budgets from
2% to 100% of "none" and at every other point's bytes. "dominated" says whether the budget
policy, given that point's bytes, saves no more and recomputes no more matmul FLOPs (the
paper's FLOPs); when it does more elementwise work (softmax, dropout, norms: memory-bound
ops the paper does not count), the ratio is shown.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.nanogpt import GPT, Block, GPTConfig  # noqa: E402
from sptransform.measure import partition_module  # noqa: E402
from sptransform.measure.models import fake_copy  # noqa: E402
from sptransform.measure.parallel import rank_graph  # noqa: E402
from sptransform.graph.nodes import is_random  # noqa: E402
from sptransform.passes.remat import RematOptions, best_within_budget  # noqa: E402

NAMED = ("none", "selective", "full", "norm_upproj")
BUDGET_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TORCH_FRACTIONS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)


@dataclass
class Point:
    label: str
    saved_bytes: int
    matmul_flops: int
    elementwise: int
    redraws: int = 0
    """Random ops the backward runs again without replaying their generator's state
    (it draws new dropout masks: the gradients are wrong)."""


def _point(label: str, partitioned) -> Point:
    # the forward ops the backward graph runs again, counted there (torch's CSE can make
    # "hardware - model" of its own graphs negative in elementwise work)
    extra = partitioned.flops().recomputed
    redraws = sum(1 for n in partitioned.backward.graph.nodes
                  if is_random(n) and n.target is not torch._prims.rng_prims.run_with_rng_state)
    return Point(label, partitioned.memory().total, extra.matmul_flops, extra.elementwise, redraws)


def _gpt2_small(tp: int):
    # tp=2 pads the vocabulary to 50304, as nanoGPT trains it (docs/remat.md was measured so)
    vocab = 50257 if tp == 1 else 50304
    cfg = GPTConfig(block_size=1024, vocab_size=vocab, n_layer=12, n_head=12, n_embd=768, dropout=0.1)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    if tp == 1:
        model, fake_mode = fake_copy(model)
        with fake_mode:
            idx = torch.zeros(4, 1024, dtype=torch.long)
        return dict(module=model, example_inputs=[idx, idx], select_output=lambda out: out[1])
    idx = torch.zeros(4, 1024, dtype=torch.long, device="meta")
    graph = rank_graph(model, (idx, idx), tp=tp, sp=True)
    return dict(module=graph.gm, example_inputs=graph.inputs, state_inputs=graph.state_inputs,
                select_output=lambda out: out[1])


def _gpt3_layer():
    cfg = GPTConfig(block_size=2048, vocab_size=51200, n_layer=1, n_head=96, n_embd=12288, dropout=0.1)
    with torch.device("meta"):
        block = Block(cfg)
    block, fake_mode = fake_copy(block, dtype=torch.bfloat16)
    with fake_mode:
        x = torch.empty(1, 2048, 12288, dtype=torch.bfloat16, requires_grad=True)
    return dict(module=block, example_inputs=[x])


SETTINGS = {
    "gpt2-small": lambda: _gpt2_small(1),
    "gpt2-small-tp2": lambda: _gpt2_small(2),
    "175b-layer": _gpt3_layer,
}


def measure_setting(name: str) -> tuple[list[Point], list[Point], list[Point]]:
    """(other points, budget-policy points at the sweep, budget-policy points at each other point)."""
    build = SETTINGS[name]
    start = time.perf_counter()
    base = partition_module(**build(), options=RematOptions(policy="budget", budget=1.0))
    candidates = base.plan.frontier + [base.replan(RematOptions(policy=p)).plan.solution for p in NAMED]
    print(f"[{name}] traced and solved the frontier in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    others = [_point(p, base.replan(RematOptions(policy=p))) for p in NAMED]
    others.append(_point("torch min-cut (default)", partition_module(**build(), torch_partitioner="torch-mincut")))
    for fraction in TORCH_FRACTIONS:
        torch._dynamo.reset()
        p = partition_module(**build(), torch_partitioner="torch-mincut", activation_memory_budget=fraction)
        others.append(_point(f"torch knapsack {fraction:g}", p))
    print(f"[{name}] measured torch's partitions at {time.perf_counter() - start:.1f} s", file=sys.stderr)
    none_bytes = next(p.saved_bytes for p in others if p.label == "none")

    def budget_point(label: str, budget: int) -> Point | None:
        # what policy="budget" picks (the same candidates, no new trace per budget)
        best = best_within_budget(base.analysis, candidates, budget, RematOptions())
        return None if best is None else _point(label, base.replan(solution=best))

    sweep = [budget_point(f"budget {f:g} x none", int(f * none_bytes)) for f in BUDGET_FRACTIONS]
    at_others = [budget_point(f"budget at '{p.label}'", p.saved_bytes) for p in others]
    print(f"[{name}] done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return others, [p for p in sweep if p is not None], at_others


def print_setting(name: str, others, sweep, at_others) -> None:
    print(f"\n## {name}\n")
    print("| point | saved MiB | recompute GFLOPs (matmul) | recompute Melem (elementwise) | budget policy at these bytes: "
          "GFLOPs + Melem | dominated |")
    print("|---|---:|---:|---:|---|---|")
    for p, b in zip(others, at_others):
        if b is None:
            verdict, mine = "below the budget solver's minimum", "-"
        else:
            on_or_below = b.matmul_flops <= p.matmul_flops and b.saved_bytes <= p.saved_bytes
            verdict = "yes" if on_or_below else "NO"
            if on_or_below and b.elementwise > p.elementwise:
                verdict += f" (elementwise {b.elementwise / max(p.elementwise, 1):.2f}x)"
            mine = f"{b.matmul_flops / 1e9:,.1f} + {b.elementwise / 1e6:,.1f} ({b.saved_bytes / 2**20:,.1f} MiB)"
        label = p.label + (f" (redraws {p.redraws} dropout masks in backward: wrong gradients)" if p.redraws else "")
        print(f"| {label} | {p.saved_bytes / 2**20:,.1f} | {p.matmul_flops / 1e9:,.1f} | "
              f"{p.elementwise / 1e6:,.1f} | {mine} | {verdict} |")
    print("\n| budget policy | saved MiB | recompute GFLOPs (matmul) | recompute Melem (elementwise) |")
    print("|---|---:|---:|---:|")
    for p in sweep:
        print(f"| {p.label} | {p.saved_bytes / 2**20:,.1f} | {p.matmul_flops / 1e9:,.1f} | {p.elementwise / 1e6:,.1f} |")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (name, (others, sweep, _)) in zip(axes[0], results.items()):
        ax.step([p.saved_bytes / 2**20 for p in sweep], [p.matmul_flops / 1e9 for p in sweep], where="post",
                marker="o", label="sptransform budget policy")
        markers = {"none": "s", "selective": "D", "full": "^", "norm_upproj": "v", "torch min-cut (default)": "X"}
        knapsack = [p for p in others if p.label.startswith("torch knapsack")]
        ax.scatter([p.saved_bytes / 2**20 for p in knapsack], [p.matmul_flops / 1e9 for p in knapsack], marker="x",
                   color="gray", label="torch activation_memory_budget")
        for p in others:
            if p.label in markers:
                ax.scatter(p.saved_bytes / 2**20, p.matmul_flops / 1e9, marker=markers[p.label], s=60, label=p.label)
        ax.set_title(name)
        ax.set_xlabel("saved for backward (MiB)")
        ax.set_ylabel("recompute (GFLOP, matmul)")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), action="append",
                        help="which setting (repeatable; default all)")
    parser.add_argument("--png", default="docs/remat_frontier.png", help="where to write the plot")
    args = parser.parse_args(argv)
    results = {}
    for name in args.setting or list(SETTINGS):
        results[name] = measure_setting(name)
        print_setting(name, *results[name])
    plot(results, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
