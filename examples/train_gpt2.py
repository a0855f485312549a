"""Train an HF GPT-2 (small config, random init) with tensor + sequence parallelism on CPU.

The model is ``transformers.GPT2LMHeadModel`` exactly as HF ships it; sptransform
captures its graph and splits it over ``--tp`` ranks (gloo). Rank 0 also trains an
unmodified copy on the same batches, so every step prints the parallel loss beside
the single-device one.

    python examples/train_gpt2.py                  # spawns 2 ranks itself
    torchrun --nproc-per-node 2 examples/train_gpt2.py --steps 50
    python examples/train_gpt2.py --data my.txt    # train on your own text (bytes as tokens)

The default data is generated here: short arithmetic sentences ("17 plus 25 is 42.")
read as bytes, so the vocabulary is 256 and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sptransform  # noqa: E402


@dataclass
class TrainConfig:
    tp: int = 2
    sp: bool = True
    steps: int = 200
    batch: int = 8
    seq: int = 64  # a multiple of tp (sequence parallelism splits it)
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    dropout: float = 0.1
    lr: float = 1e-3
    seed: int = 0
    dtype: str = "float32"  # float64: is the late parallel/single-device gap rounding? (README)
    data: str | None = None


def arithmetic_corpus(n_sentences: int = 20000, seed: int = 0) -> bytes:
    """Sentences like ``17 plus 25 is 42.``: structure a small model learns in a minute."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op, value = rng.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
        lines.append(f"{a} {op} {b} is {value}.")
    return " ".join(lines).encode()


def batches(data: torch.Tensor, cfg: TrainConfig):
    """Random windows of ``seq`` bytes; inputs and labels are the same ids (HF shifts)."""
    g = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.steps):
        starts = torch.randint(0, len(data) - cfg.seq - 1, (cfg.batch,), generator=g)
        ids = torch.stack([data[s : s + cfg.seq] for s in starts.tolist()])  # [b, s]
        yield ids


def build_model(cfg: TrainConfig):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(cfg.seed)
    config = GPT2Config(
        vocab_size=256, n_positions=max(128, cfg.seq), n_layer=cfg.layers, n_embd=cfg.hidden, n_head=cfg.heads,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, attn_implementation="eager",
    )
    dtype = {"float32": torch.float32, "float64": torch.float64}.get(cfg.dtype)
    if dtype is None:
        raise ValueError(f"--dtype {cfg.dtype!r} is not supported; use float32 or float64")
    model = GPT2LMHeadModel(config).to(dtype).train()
    if dtype == torch.float64:
        model.loss_function = _loss_in_model_dtype  # HF's default loss upcasts logits to fp32
    return model


def _loss_in_model_dtype(logits, labels, vocab_size, **kwargs):
    """HF's causal-LM loss (labels shifted left, -100 ignored) without its cast to fp32, so a
    float64 run computes everything in float64."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shifted.reshape(-1), ignore_index=-100)


def train(cfg: TrainConfig) -> None:
    rank = dist.get_rank()
    text = Path(cfg.data).read_bytes() if cfg.data else arithmetic_corpus(seed=cfg.seed)
    data = torch.tensor(list(text), dtype=torch.long)
    model = build_model(cfg)
    reference = copy.deepcopy(model) if rank == 0 else None
    example = dict(input_ids=data[: cfg.seq].repeat(cfg.batch, 1), labels=data[: cfg.seq].repeat(cfg.batch, 1))
    # reference RNG: dropout masks equal the single-device model's, so the losses match exactly
    parallel = sptransform.parallelize(model, tp=cfg.tp, sp=cfg.sp, example_inputs=example, dropout_rng="reference")
    opt = torch.optim.AdamW(parallel.parameters(), lr=cfg.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cfg.lr) if reference is not None else None
    if rank == 0:
        print(parallel.explain().split("parameters:")[0].rstrip())
        from tqdm import tqdm

        progress = tqdm(total=cfg.steps, unit="step", dynamic_ncols=True)
    for step, ids in enumerate(batches(data, cfg)):
        torch.manual_seed(cfg.seed + 1 + step)
        loss = parallel(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parallel.parameters(), 1.0)  # works on DTensor parameters
        opt.step()
        opt.zero_grad()
        if reference is not None:
            torch.manual_seed(cfg.seed + 1 + step)
            ref_loss = reference(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            progress.update(1)
            progress.write(
                f"step {step:3d}  loss tp={cfg.tp}: {loss.item():.5f}   single device: {ref_loss.item():.5f}"
                f"   |diff| {abs(loss.item() - ref_loss.item()):.1e}"
            )
    if rank == 0:
        progress.close()


def _worker(rank: int, cfg: TrainConfig, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cfg.tp))
    _run(cfg)


def _run(cfg: TrainConfig) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        train(cfg)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = TrainConfig()
    for name, value in vars(defaults).items():
        if isinstance(value, bool):
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(f"--{name}", type=type(value) if value is not None else str, default=value)
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    if "RANK" in os.environ:  # launched by torchrun
        _run(cfg)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(cfg, port), nprocs=cfg.tp, join=True)


if __name__ == "__main__":
    main()
