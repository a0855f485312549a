"""A survey of bad inputs: what a user gets for each, classified.

Each case builds a small HF GPT-2 (or Llama), parallelizes it on simulated ranks (fake process
group + LocalTensorMode, tp=2) and makes one mistake: an argument of ``parallelize``, a bad
call input, a mesh, a model state. The outcome is classified from what happened:

* ``clear``: a ``ValueError``/``TypeError``/``IndexError``/``KeyError`` raised by sptransform's
  own code (the raising frame is in the ``sptransform`` package), whose message names the
  argument given (``names`` below) — the value and the rule are in the message by construction;
* ``poor``: any other exception (raised inside torch or transformers, or not naming the argument);
* ``silent``: no exception (the call ran).

Hangs are not possible here (simulated ranks have no peers to wait for); the bounded-wait cases
(a replica that skips backward, a killed peer) run on real gloo ranks in
``tests/integration/test_faults_gloo.py``.

    python tools/bad_inputs.py [--markdown]
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import sptransform  # noqa: E402
from simulate import simulated_ranks  # noqa: E402

VOCAB, SEQ = 64, 8


def gpt2(**overrides):
    import transformers

    torch.manual_seed(0)
    config = dict(n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))


def ids(batch=2, seq=SEQ):
    return torch.randint(0, VOCAB, (batch, seq))


def built(**kwargs):
    return sptransform.parallelize(gpt2(), tp=2, example_inputs=dict(input_ids=ids(), labels=ids()), **kwargs)


def meta_gpt2():
    with torch.device("meta"):
        return gpt2()


def mesh(names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, 2), mesh_dim_names=names)


# (what, names: words the message must contain, the mistake)
CASES = [
    # -- parallelize's arguments
    ("tp=0", ["tp"], lambda: sptransform.parallelize(gpt2(), tp=0)),
    ("tp='2'", ["tp"], lambda: sptransform.parallelize(gpt2(), tp="2")),
    ("tp=3 (does not divide 4 heads)", ["tp=3"], lambda: sptransform.parallelize(gpt2(), tp=3)),
    ("sp='yes'", ["sp"], lambda: built(sp="yes")),
    ("dropout_rng='same'", ["dropout_rng"], lambda: built(dropout_rng="same")),
    ("seed='1'", ["seed"], lambda: built(seed="1")),
    ("recompute='some'", ["recompute"], lambda: built(recompute="some")),
    ("recompute=1.5 (budget above 1)", ["1.5"], lambda: built(recompute=1.5)),
    ("zero='3'", ["zero"], lambda: built(zero="3")),
    ("zero=-1", ["zero"], lambda: built(zero=-1)),
    ("zero=4", ["zero"], lambda: built(zero=4)),
    ("zero=True", ["zero"], lambda: built(zero=True)),
    ("dp=0", ["dp"], lambda: built(dp=0)),
    ("dp_loss='sum'", ["dp_loss"], lambda: built(dp_loss="sum")),
    ("peer_timeout_s=-1", ["peer_timeout_s"], lambda: built(peer_timeout_s=-1)),
    ("compile='tvm'", ["compile"], lambda: built(compile="tvm")),
    ("graph_cache_size=0", ["graph_cache_size"], lambda: built(graph_cache_size=0)),
    ("check_inputs='no'", ["check_inputs"], lambda: built(check_inputs="no")),
    ("n_microbatches=3 for a batch of 2", ["n_microbatches"],
     lambda: built(pp=1, n_microbatches=3)),
    ("schedule='zigzag'", ["schedule"], lambda: built(pp=2, schedule="zigzag", n_microbatches=2)),
    ("example_inputs=[1, 2]", ["example_inputs"], lambda: sptransform.parallelize(gpt2(), tp=2, example_inputs=[1, 2])),
    ("sequence 7 under SP at tp=2", ["sequence length 7"],
     lambda: sptransform.parallelize(gpt2(), tp=2, example_inputs=(ids(seq=7),))),
    ("a function, not a module", ["nn.Module"], lambda: sptransform.parallelize(lambda x: x, tp=2)),
    ("parallelize(pm) of a parallel module", ["already"], lambda: sptransform.parallelize(built(), tp=2)),
    ("mesh dims ('tp', 'dp')", ["mesh"], lambda: built(mesh=mesh(("tp", "dp")))),
    ("mesh dims ('pp', 'dp')", ["mesh"], lambda: built(mesh=mesh(("pp", "dp")))),
    ("meta model never loaded, first call", ["meta"],
     lambda: sptransform.parallelize(meta_gpt2(), tp=2, example_inputs=(ids(),))(ids())),
    # -- call inputs
    ("float input_ids", ["input_ids"], lambda: built()(input_ids=ids().float(), labels=ids())),
    ("float labels", ["labels"], lambda: built()(input_ids=ids(), labels=ids().float())),
    ("1-D input_ids", ["input_ids"], lambda: built()(input_ids=ids()[0], labels=ids()[0])),
    ("labels shaped unlike ids", ["labels"], lambda: built()(input_ids=ids(), labels=ids(seq=4))),
    ("misspelt keyword input_idz=", ["input_idz"], lambda: built()(input_idz=ids(), labels=ids())),
    ("token id = vocab", ["vocab"], lambda: built()(input_ids=ids().fill_(VOCAB), labels=ids())),
    ("negative token id", ["-5"], lambda: built()(input_ids=ids().fill_(-5), labels=ids())),
    ("label = vocab", ["labels"], lambda: built()(input_ids=ids(), labels=ids().fill_(VOCAB))),
    ("sequence longer than the positions (24 > 16)", ["16"],
     lambda: built()(input_ids=ids(seq=24), labels=ids(seq=24))),
    ("use_cache=True", ["use_cache"], lambda: built()(input_ids=ids(), labels=ids(), use_cache=True)),
    ("inputs on the meta device", ["meta"], lambda: built()(input_ids=ids().to("meta"), labels=ids().to("meta"))),
    ("pm.to('meta') after parallelize", ["device"], lambda: built().to("meta")(ids())),
    ("own loss without loss_parallel()", ["loss_parallel"],
     lambda: torch.nn.functional.cross_entropy(built()(ids()).logits.flatten(0, 1), ids().flatten())),
    ("generate with num_beams=2", ["num_beams"], lambda: built().generate(ids(), max_new_tokens=2, num_beams=2)),
]


def classify(case) -> tuple[str, str]:
    what, names, mistake = case
    try:
        with warnings.catch_warnings(), simulated_ranks(2):
            warnings.simplefilter("ignore")
            mistake()
    except Exception as error:  # the survey's point: what reaches the user
        frames = traceback.extract_tb(error.__traceback__)
        raiser = frames[-1].filename if frames else ""
        message = f"{type(error).__name__}: {error}".replace("\n", " ")
        ours = f"{os.sep}sptransform{os.sep}" in raiser and f"{os.sep}tests{os.sep}" not in raiser
        named = all(name.lower() in str(error).lower() for name in names)
        kind = "clear" if ours and named and isinstance(error, (ValueError, TypeError, IndexError, KeyError)) else "poor"
        return kind, message
    return "silent", "(no error)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    counts: dict[str, int] = {}
    rows = []
    for case in CASES:
        kind, message = classify(case)
        counts[kind] = counts.get(kind, 0) + 1
        rows.append((case[0], kind, message[:160]))
        if not args.markdown:
            print(f"{kind:<6} {case[0]:<48} {message[:120]}", flush=True)
    if args.markdown:
        print("| bad input | outcome | message (first 160 characters) |\n|---|---|---|")
        for what, kind, message in rows:
            print(f"| {what} | {kind} | {message.replace('|', '/')} |")
    print(f"\n{len(CASES)} bad inputs: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("clear", "poor", "silent")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
