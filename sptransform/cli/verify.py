"""``sptransform verify``: does the parallel model train exactly like the original? (``sptransform.verify``)

    sptransform verify --model gpt2 --tp 2
    sptransform verify --model llama3-8b --tp 4 --no-sp --layers 1 --steps 3
    sptransform verify --model path/to/config.json --tp 2 --seq 32
    sptransform verify --model my_models.py:build --tp 2        # or a dotted module: pkg.models:build
    sptransform verify --model gpt2 --tp 2 --simulated           # ranks simulated in this process
    torchrun --nproc-per-node 2 -m sptransform verify --model gpt2 --tp 2   # on the job's ranks

Where the ranks run: by default real processes, dp x pp x tp of them, spawned on gloo (CPU),
unless the model cannot be pickled to them (a lambda on a module, a class defined in
``__main__``; then simulated, with a note); ``--processes`` insists on real processes,
``--simulated`` runs the tp ranks in this one process (``LocalTensorMode``; pp = dp = 1). Under
``torchrun`` (its environment variables set) the command initializes the job's process group
(gloo) and runs on the job's ranks, whose number must be dp x pp x tp; rank 0 prints the report,
every rank exits with its code. The report's first line says which ran.

``--model`` is one of:

* a preset (``sptransform.planner.presets.PRESETS``). A small REAL model of the preset's family is
  built: HF ``GPT2LMHeadModel`` for the GPT shapes (LayerNorm, GELU, learned positions, fused
  QKV, tied head, the preset's dropout in train() mode; eager attention for "explicit", SDPA
  for "sdpa"), HF ``LlamaForCausalLM`` for the Llama shapes (RMSNorm, RoPE, SwiGLU, grouped K/V
  heads, untied head). It keeps what decides whether and how the model splits and shrinks the
  rest: the real numbers of attention heads and K/V heads (so a tp that does not divide them
  is refused as for the real model), head size 8 (hidden = heads x 8), the MLP width in the
  preset's ratio to hidden (rounded to a multiple of 64), a vocabulary of 1024 + (v mod 1024)
  (the same remainder modulo every power of two up to 1024, so vocabulary padding happens for
  the same tp as in the real model), ``--layers`` layers (default 2);
* a HF ``config.json`` (or its folder): ``AutoConfig`` + ``AutoModelForCausalLM.from_config``,
  only the layer count shrunk to ``--layers`` (default 2);
* ``module:factory``: the module (a ``.py`` path, or a dotted name importable from here) is
  imported and ``factory()`` called with no arguments; it returns the ``nn.Module``, or a
  pair ``(module, example_inputs)`` (the forms ``parallelize`` takes) for a model whose
  forward needs more than token ids. ``--layers`` does not apply.

Inputs: token ids ``[--batch, --seq]`` (default 2*dp x 8*tp) below the model's vocabulary, plus
``labels`` = the same ids when ``forward`` takes labels (HF), so that the loss is compared.

Exit code: 0 equal, 1 different, 2 refused by ``parallelize`` or bad arguments (one
``error:`` line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys

from sptransform.cli.args import int_type, non_negative_float, positive_float
from sptransform.equivalence import verify
from sptransform.planner.presets import PRESETS

DEFAULT_LAYERS = 2
HEAD_DIM = 8
MAX_RANKS = 64
"""tp ranks, and dp x pp x tp processes, at most."""
MAX_LAYERS = 1024
MAX_TOKENS = 2**20
"""batch x seq of the token inputs, at most."""
MAX_STEPS = 10_000


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify", help="compare the parallel model with the original on real (or simulated) ranks: outputs, "
                       "gradients, updates",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(run=run)
    parser.add_argument("--model", help=f"a preset ({', '.join(sorted(PRESETS))}), a HF config.json, or module:factory")
    parser.add_argument("--tp", type=int_type(1, MAX_RANKS, why="ranks run on this machine"),
                        help=f"tensor-parallel degree (required; at most {MAX_RANKS})")
    parser.add_argument("--no-sp", dest="sp", action="store_false", help="without sequence parallelism")
    parser.add_argument("--pp", type=int_type(1, MAX_RANKS, why="dp x pp x tp processes are spawned"), default=1,
                        help=f"pipeline ranks (default 1; dp x pp x tp at most {MAX_RANKS} processes)")
    parser.add_argument("--dp", type=int_type(1, MAX_RANKS, why="dp x pp x tp processes are spawned"), default=1,
                        help="data-parallel groups, each on its piece of the batch (default 1)")
    parser.add_argument("--ep", type=int_type(1, MAX_RANKS, why="it divides --dp"), default=1,
                        help="expert-parallel groups of this many dp ranks split the experts (default 1; divides --dp)")
    parser.add_argument("--shard-whole", dest="shard_whole", action="store_true",
                        help="store what tensor parallelism keeps whole in 1/tp pieces (parallelize's shard_whole)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--processes", dest="processes", action="store_true", default=None,
                       help="real gloo processes, also where that needs the model pickled and it cannot be (an error)")
    where.add_argument("--simulated", dest="processes", action="store_false",
                       help="the tp ranks simulated in this process (LocalTensorMode); pp = dp = 1 only")
    parser.add_argument("--layers", type=int_type(1, MAX_LAYERS, why="the model is built for real"),
                        help=f"layers of a preset or config.json model (default {DEFAULT_LAYERS}; at most {MAX_LAYERS})")
    parser.add_argument("--seq", type=int_type(1, MAX_TOKENS, why="the inputs are real tensors"),
                        help="sequence length (default 8 x tp)")
    parser.add_argument("--batch", type=int_type(1, MAX_TOKENS, why="the inputs are real tensors"),
                        help=f"batch size (default 2; batch x seq at most {MAX_TOKENS:,} tokens)")
    parser.add_argument("--steps", type=int_type(1, MAX_STEPS), default=1, help="SGD steps (default 1)")
    parser.add_argument("--rtol", type=non_negative_float, default=1e-4,
                        help="largest relative error of a row that is ok, a finite number >= 0 (default 1e-4)")
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="seconds before spawned processes are killed (default 600)")


def run(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("--model is required: a preset, a HF config.json, or module:factory")
    if args.tp is None:
        raise ValueError("--tp is required: the tensor-parallel degree to verify")
    tp, pp, dp, layers, seq, batch = args.tp, args.pp, args.dp, args.layers, args.seq, args.batch
    steps, rtol, timeout = args.steps, args.rtol, args.timeout
    if dp * pp * tp > MAX_RANKS:
        raise ValueError(f"--dp {dp} x --pp {pp} x --tp {tp} = {dp * pp * tp} processes is above the limit of "
                         f"{MAX_RANKS}: use fewer ranks")
    default_batch = 2 * dp
    tokens = (batch or default_batch) * (seq or 8 * tp)
    if tokens > MAX_TOKENS:
        raise ValueError(f"--batch {batch or default_batch} x --seq {seq or 8 * tp} = {tokens:,} tokens is above the "
                         f"limit of {MAX_TOKENS:,} (the inputs and activations are real tensors): use a smaller "
                         "--batch or --seq")

    import torch

    torch.manual_seed(0)  # the model's initial weights (alike on every rank of a torchrun job)
    model, example_inputs = build_model(args.model, layers=layers, seq=seq or 8 * tp)
    if example_inputs is None and (seq is not None or batch is not None):
        example_inputs = token_inputs(model, batch=batch or default_batch, seq=seq or 8 * tp)
    with _torchrun_group() as rank:
        try:
            report = verify(model, tp=tp, sp=args.sp, pp=pp, dp=dp, ep=args.ep, example_inputs=example_inputs, steps=steps,
                            rtol=rtol, timeout_s=timeout, processes=args.processes, shard_whole=args.shard_whole)
        except Exception as error:  # bad inputs, the model itself failing on single device, a timeout
            message = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            raise ValueError(_one_line(message)) from error
    if rank == 0:
        print(describe(model, args.model))
        print(report)
    if report.status == "refused":
        return 2
    return 0 if report.ok else 1


@contextlib.contextmanager
def _torchrun_group():
    """Under torchrun (its RANK/WORLD_SIZE/MASTER_ADDR set) with no process group yet: the job's
    gloo group for the body, destroyed after; yields this process's rank (0 outside a job)."""
    import torch.distributed as dist

    launched = all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if not launched or dist.is_initialized():
        yield dist.get_rank() if dist.is_initialized() else 0
        return
    dist.init_process_group("gloo")
    try:
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()


def describe(model, spec: str) -> str:
    """One line: the class built for ``--model`` and the sizes that matter for splitting it."""
    config = getattr(model, "config", None)
    line = f"model: {type(model).__name__} from {spec!r}"
    if config is not None:
        sizes = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                 "kv heads": "num_key_value_heads", "vocab": "vocab_size"}
        found = [f"{name} {getattr(config, key)}" for name, key in sizes.items() if getattr(config, key, None)]
        line += f" ({', '.join(found)})"
    params = sum(p.numel() for p in model.parameters())
    return line + f", {params:,} parameters"


def _one_line(text: str) -> str:
    return " ".join(text.split())


# -- models ---------------------------------------------------------------------


def build_model(spec: str, *, layers: int | None, seq: int):
    """(model, example_inputs or None) for ``--model``."""
    if spec in PRESETS:
        return preset_model(spec, layers=layers or DEFAULT_LAYERS, seq=seq), None
    if spec.endswith(".json") or os.path.isdir(spec):
        return config_model(spec, layers=layers or DEFAULT_LAYERS), None
    if ":" in spec:
        if layers is not None:
            raise ValueError(f"--layers applies to presets and config.json files; {spec!r} builds its own model")
        return factory_model(spec)
    raise ValueError(
        f"--model {spec!r} is not a preset ({', '.join(sorted(PRESETS))}), a config.json file or folder, "
        "or module:factory"
    )


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise ValueError("this --model needs the transformers package: pip install transformers") from error
    return transformers


def preset_model(name: str, *, layers: int, seq: int):
    """A small HF model of the preset's family (see the module docstring for what is kept)."""
    transformers = _transformers()
    shape = PRESETS[name]
    hidden = shape.num_heads * HEAD_DIM
    ffn = max(64, round(shape.ffn / shape.hidden * hidden / 64) * 64)
    vocab = 1024 + shape.vocab_size % 1024
    positions = max(64, seq)
    llama_like = shape.norm == "rmsnorm" or shape.activation == "swiglu" or shape.position == "rope"
    attn = "sdpa" if shape.attention == "sdpa" else "eager"
    if llama_like:
        config = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.kv_heads, intermediate_size=ffn, vocab_size=vocab,
            max_position_embeddings=positions, attention_bias=shape.bias, mlp_bias=shape.bias,
            attention_dropout=shape.dropout, tie_word_embeddings=shape.tied_embeddings, attn_implementation=attn,
        )
        return transformers.LlamaForCausalLM(config).train()
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=shape.num_heads, n_inner=ffn, vocab_size=vocab, n_positions=positions,
        resid_pdrop=shape.dropout, embd_pdrop=shape.dropout, attn_pdrop=shape.dropout, attn_implementation=attn,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )
    return transformers.GPT2LMHeadModel(config).train()


def config_model(path: str, *, layers: int):
    if not os.path.exists(path):
        raise ValueError(f"--model {path!r}: no such file or folder")
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as error:
        raise ValueError(_one_line(f"--model {path!r}: cannot read it as a HF config: {error}")) from None
    if not hasattr(config, "num_hidden_layers"):
        raise ValueError(f"--model {path!r}: the config has no layer count (num_hidden_layers) to shrink")
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer kinds (sliding/full attention)
        config.layer_types = config.layer_types[:layers]
    try:
        return transformers.AutoModelForCausalLM.from_config(config).train()
    except Exception as error:
        raise ValueError(_one_line(f"--model {path!r}: AutoModelForCausalLM cannot build it: {error}")) from None


def factory_model(spec: str):
    import torch.nn as nn

    module_name, _, factory_name = spec.rpartition(":")
    if not module_name or not factory_name.isidentifier():
        raise ValueError(f"--model {spec!r}: write module:factory, e.g. my_models.py:build or pkg.models:build")
    try:
        module = _import(module_name)
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(_one_line(f"--model {spec!r}: importing {module_name!r} failed: "
                                   f"{type(error).__name__}: {error}")) from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name!r} has no callable {factory_name!r}")
    try:
        made = factory()
    except Exception as error:
        raise ValueError(_one_line(f"--model {spec!r}: {factory_name}() raised {type(error).__name__}: {error}")) \
            from None
    model, example_inputs = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: {factory_name}() returned {type(model).__name__}, not an nn.Module "
                         "(or a pair (module, example_inputs))")
    return model, example_inputs


def _import(name: str):
    if name.endswith(".py") or os.sep in name or "/" in name:
        path = os.path.abspath(name)
        if not os.path.isfile(path):
            raise ValueError(f"--model: no such file {name!r}")
        folder, stem = os.path.split(path)
        stem = stem.removesuffix(".py")
        # importable by name (its folder on sys.path): pp > 1 sends the model to spawned processes by pickle
        if folder not in sys.path:
            sys.path.insert(0, folder)
        existing = sys.modules.get(stem)
        if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == path:
            return importlib.reload(existing)
        spec = importlib.util.spec_from_file_location(stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[stem] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(stem, None)
            raise
        return module
    return importlib.import_module(name)


def token_inputs(model, *, batch: int, seq: int):
    """Token ids ``[batch, seq]`` below the model's input vocabulary (``api.default_token_ids``'s rule),
    and ``labels`` = the ids when ``forward`` takes labels."""
    import inspect

    import torch
    import torch.nn as nn

    embedding = model.get_input_embeddings() if callable(getattr(type(model), "get_input_embeddings", None)) else None
    if embedding is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError("--seq/--batch build token ids, and the model has no nn.Embedding: "
                         "have the factory return (model, example_inputs)")
    ids = torch.randint(0, embedding.num_embeddings, (batch, seq))
    if "labels" in inspect.signature(model.forward).parameters:
        return (ids,), {"labels": ids}
    return (ids,)


__all__ = ["register", "run", "build_model", "preset_model", "config_model", "factory_model", "token_inputs"]
