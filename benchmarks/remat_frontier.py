"""Saved bytes against recompute cost: sptransform's budget policy beside torch's partitions.

    python benchmarks/remat_frontier.py                   # both models, table + PNG
    python benchmarks/remat_frontier.py --setting llama   # one model
    python benchmarks/remat_frontier.py --png docs/remat_frontier.png

Settings (traced under fake tensors, nothing allocated; one device, fp32, dropout 0.1 where the
model has it), small enough for a 2-core CPU:
  gpt2    HF GPT2LMHeadModel, 2 layers, h=128, 4 heads, vocab 2048, seq 256, batch 2, eager attention;
  llama   HF LlamaForCausalLM, 2 layers, h=128, 4 heads (2 K/V), ffn 344, vocab 2048, seq 256, batch 2, SDPA.

Points, each measured on its own partitioned graphs (bytes saved for backward: unique storages,
parameters left out): sptransform's "none", "selective", "full", "norm_upproj"; torch.compile's
own partition (inductor's decompositions and joint-graph passes, then the default min cut:
``torch_partitioner="torch-inductor"``) and its ``activation_memory_budget`` knapsack swept over
the budget fraction, on the same decomposed graphs; sptransform's budget policy swept over its
budget and at every other point's bytes.

Recompute cost: the forward ops found again in the backward graph, counted there, three ways:
matmul FLOPs; FLOPs of all ops (matmuls, plus one per output element of every other op); and the
bytes the memory-bound ops among them move (inputs read plus output written). Torch's graphs are
decomposed (a norm is several pointwise ops, each counted), ours are not (a norm is one op,
counted once), which favours ours in the last two counts by up to the number of primitives a
composite op decomposes into.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sptransform.graph.cost import node_cost, recomputed_nodes  # noqa: E402
from sptransform.graph.nodes import is_random, is_view, storage_nbytes, tensor_val  # noqa: E402
from sptransform.measure import partition_module  # noqa: E402
from sptransform.measure.models import fake_copy  # noqa: E402
from sptransform.passes.remat import RematOptions, best_within_budget  # noqa: E402
from sptransform.torch_internals import run_with_rng_state  # noqa: E402

NAMED = ("none", "selective", "full", "norm_upproj")
BUDGET_FRACTIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
TORCH_FRACTIONS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass
class Point:
    label: str
    saved_bytes: int
    matmul_flops: int
    all_flops: int
    """Matmul FLOPs plus one per output element of every other recomputed op."""
    moved_bytes: int
    """Bytes the recomputed memory-bound ops read and write."""
    redraws: int = 0
    """Random ops the backward runs again without replaying their generator's state
    (it draws new dropout masks: the gradients are wrong)."""


def _recompute_cost(partitioned) -> tuple[int, int, int]:
    matmul = other = moved = 0
    for n in recomputed_nodes(partitioned.backward):
        if is_view(n):
            continue
        cost = node_cost(n)
        matmul += cost.matmul_flops
        out = tensor_val(n)
        if cost.matmul_flops or out is None:
            continue
        other += out.numel()
        moved += storage_nbytes(n) + sum(storage_nbytes(a) for a in n.all_input_nodes if tensor_val(a) is not None)
    return matmul, matmul + other, moved


def _point(label: str, partitioned) -> Point:
    redraws = sum(1 for n in partitioned.backward.graph.nodes if is_random(n) and n.target is not run_with_rng_state)
    matmul, flops, moved = _recompute_cost(partitioned)
    return Point(label, partitioned.memory().total, matmul, flops, moved, redraws)


class _Loss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, labels):
        return self.model(input_ids=idx, labels=labels).loss


def _hf(name: str):
    import transformers

    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=2048, n_positions=256,
                                      bos_token_id=0, eos_token_id=0, attn_implementation="eager")
        build = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=344, vocab_size=2048,
                                       max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
        build = transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = _Loss(build(cfg)).train()
    model, fake_mode = fake_copy(model)
    with fake_mode:
        idx = torch.zeros(2, 256, dtype=torch.long)
    return dict(module=model, example_inputs=[idx, idx], select_output=lambda loss: loss)


SETTINGS = {"gpt2": lambda: _hf("gpt2"), "llama": lambda: _hf("llama")}


def measure_setting(name: str) -> tuple[list[Point], list[Point], list[Point]]:
    """(other points, budget-policy points at the sweep, budget-policy points at each other point)."""
    build = SETTINGS[name]
    start = time.perf_counter()
    base = partition_module(**build(), options=RematOptions(policy="budget", budget=1.0))
    candidates = base.plan.frontier + [base.replan(RematOptions(policy=p)).plan.solution for p in NAMED]
    print(f"[{name}] traced and solved the frontier in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    others = [_point(p, base.replan(RematOptions(policy=p))) for p in NAMED]
    others.append(_point("torch.compile (default)", partition_module(**build(), torch_partitioner="torch-inductor")))
    for fraction in TORCH_FRACTIONS:
        torch._dynamo.reset()
        p = partition_module(**build(), torch_partitioner="torch-inductor", activation_memory_budget=fraction)
        others.append(_point(f"torch knapsack {fraction:g}", p))
    print(f"[{name}] measured torch's partitions at {time.perf_counter() - start:.1f} s", file=sys.stderr)
    def budget_point(label: str, budget: int) -> Point | None:
        # what policy="budget" picks (the same candidates, no new trace per budget)
        best = best_within_budget(base.analysis, candidates, budget, RematOptions())
        return None if best is None else _point(label, base.replan(solution=best))

    minimum, none_bytes = base.plan.minimum_feasible_bytes, next(p.saved_bytes for p in others if p.label == "none")
    sweep = [budget_point(f"budget {f:g}", minimum + int(f * (none_bytes - minimum))) for f in BUDGET_FRACTIONS]
    at_others = [budget_point(f"budget at '{p.label}'", p.saved_bytes) for p in others]
    print(f"[{name}] done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return others, [p for p in sweep if p is not None], at_others


def _cells(p: Point) -> str:
    return (f"{p.saved_bytes / 2**20:,.2f} | {p.matmul_flops / 1e9:,.3f} | {p.all_flops / 1e9:,.3f} | "
            f"{p.moved_bytes / 2**20:,.1f}")


def print_setting(name: str, others, sweep, at_others) -> None:
    print(f"\n## {name}\n")
    print("| point | saved MiB | recompute GFLOPs (matmul) | recompute GFLOPs (all ops) | recompute MiB moved | "
          "budget policy at these bytes: MiB, GFLOPs all ops, MiB moved | on or below |")
    print("|---|---:|---:|---:|---:|---|---|")
    for p, b in zip(others, at_others):
        if b is None:
            verdict, mine = "below the budget policy's minimum", "-"
        else:
            below = b.saved_bytes <= p.saved_bytes and b.all_flops <= p.all_flops
            verdict = "yes" if below else f"NO: {b.all_flops / max(p.all_flops, 1):.2f}x the FLOPs"
            if below and b.moved_bytes > p.moved_bytes:
                verdict += f" (moves {b.moved_bytes / max(p.moved_bytes, 1):.2f}x the bytes)"
            mine = f"{b.saved_bytes / 2**20:,.2f}, {b.all_flops / 1e9:,.3f}, {b.moved_bytes / 2**20:,.1f}"
        label = p.label + (f" (redraws {p.redraws} dropout masks in backward: wrong gradients)" if p.redraws else "")
        print(f"| {label} | {_cells(p)} | {mine} | {verdict} |")
    print("\n| budget policy (fraction from the minimum to none) | saved MiB | recompute GFLOPs (matmul) | "
          "recompute GFLOPs (all ops) | recompute MiB moved |")
    print("|---|---:|---:|---:|---:|")
    for p in sweep:
        print(f"| {p.label} | {_cells(p)} |")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 8), squeeze=False)
    costs = [("all_flops", 1e9, "recompute (GFLOP, all ops)"), ("moved_bytes", 2**20, "recompute (MiB moved)")]
    for column, (name, (others, sweep, _)) in enumerate(results.items()):
        for row, (field, unit, ylabel) in enumerate(costs):
            ax = axes[row][column]
            y = lambda p: getattr(p, field) / unit  # noqa: E731
            frontier = sorted(sweep, key=lambda p: p.saved_bytes)
            ax.step([p.saved_bytes / 2**20 for p in frontier], [y(p) for p in frontier], where="post", marker="o",
                    label="sptransform budget policy")
            knapsack = sorted((p for p in others if p.label.startswith("torch knapsack")), key=lambda p: p.saved_bytes)
            ax.plot([p.saved_bytes / 2**20 for p in knapsack], [y(p) for p in knapsack], marker="x", color="gray",
                    label="torch.compile activation_memory_budget")
            markers = {"none": "s", "selective": "D", "full": "^", "norm_upproj": "v", "torch.compile (default)": "X"}
            for p in others:
                if p.label in markers:
                    ax.scatter(p.saved_bytes / 2**20, y(p), marker=markers[p.label], s=60, label=p.label, zorder=3)
            ax.set_title(name)
            ax.set_xlabel("saved for backward (MiB)")
            ax.set_ylabel(ylabel)
            ax.set_yscale("symlog", linthresh=1e-3 if field == "all_flops" else 1.0)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
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
