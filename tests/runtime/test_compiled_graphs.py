"""What ``torch.compile(pm)`` hands to inductor is lean: one ``wait_tensor`` per collective, read
straight from it, and no zero-filled buffer that a reorder could do without.

The graphs are the ones inductor would lower: AOTAutograd with inductor's decompositions and its
min-cut partitioner, caught by a backend that only records them (no code generated), on a fake
process group of 2 ranks (tracing needs no peer)."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

import sptransform
from simulate import fake_group

transformers = pytest.importorskip("transformers")

_functional = torch.ops._c10d_functional
COLLECTIVES = {_functional.all_reduce.default, _functional.all_gather_into_tensor.default,
               _functional.reduce_scatter_tensor.default}
WAIT = _functional.wait_tensor.default
aten = torch.ops.aten


def _gpt2(layers: int):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(config).train()


def _graphs_for_inductor(sp: bool, layers: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The partitioned forward and backward of one training step of ``torch.compile(pm)``."""
    graphs: list[fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record, decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=ids, labels=ids, use_cache=False)
    torch._dynamo.reset()
    with fake_group(2):
        pm = sptransform.parallelize(copy.deepcopy(_gpt2(layers)), tp=2, sp=sp, example_inputs=inputs)
        torch.compile(pm, backend=backend)(**inputs).loss.backward()
    torch._dynamo.reset()
    assert len(graphs) == 2, f"{len(graphs)} graphs: the compiled region is one forward and one backward"
    return graphs[0], graphs[1]


def _count(gm: fx.GraphModule) -> collections.Counter:
    calls = collections.Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            calls["collective" if node.target in COLLECTIVES else node.target] += 1
    return calls


def _zero_fills(gm: fx.GraphModule) -> list[fx.Node]:
    """Buffers of more than one element filled with zeros (``full(shape, 0)`` after decomposition)."""
    return [n for n in gm.graph.nodes if n.target is aten.full.default and n.args[1] == 0
            and torch.Size(n.args[0]).numel() > 1]


@pytest.mark.slow  # two inductor-decomposed AOTAutograd traces per case (~20 s of CPU each)
@pytest.mark.in_process  # no spawned ranks: runs beside the process tests
@pytest.mark.parametrize("sp", [False, True])
def test_compiled_graphs_wait_once_per_collective_and_fill_only_embedding_gradients(sp):
    """Per layer, tp=2: sp=False 2 all-reduces forward, 2 backward; sp=True 2 all-gathers and 2
    reduce-scatters each way; plus the embedding, the vocabulary-parallel loss and the gradient
    bucket. Each is waited on exactly once (a second ``wait_tensor`` on a waited tensor cost a
    call per collective: 42 waits for 21 collectives before). Zero-filled buffers: only the
    gradients of the two embedding tables (and, with sp, of the position embedding's cut), which
    DTensor's compiled graph has too; the token reorders of sp=True are views, not an
    ``index_select`` whose backward scatters into zeros (16 fills per step on 4 layers before)."""
    layers = 1
    forward, backward = _graphs_for_inductor(sp, layers)
    for name, gm in (("forward", forward), ("backward", backward)):
        calls = _count(gm)
        assert calls[WAIT] == calls["collective"], f"{name}: {calls[WAIT]} waits for {calls['collective']} collectives"
        for node in gm.graph.nodes:
            if node.target is WAIT:
                assert node.args[0].target in COLLECTIVES, f"{name}: {node} waits on {node.args[0]}, not a collective"
    # per layer 2 collectives in each direction (all-reduces, or all-gather + reduce-scatter pairs)
    per_layer = 4 if sp else 2
    # forward: the embedding's sum (sp: its reduce-scatter, and the all-gather in front of the
    # head), 1 in the vocabulary-parallel loss (each rank's row statistics, gathered)
    assert _count(forward)["collective"] == per_layer * layers + (3 if sp else 2), _count(forward)
    assert [n.target for n in _zero_fills(forward)] == []
    fills = _zero_fills(backward)
    assert len(fills) == (3 if sp else 2), [(n.name, n.args[0], [u.target for u in n.users]) for n in fills]
    # sp=True: the position embedding's cut (its gradient is this rank's rows, zeros elsewhere)
    assert _count(backward)[aten.index_put.default] == (1 if sp else 0), _count(backward)


@pytest.mark.parametrize("sp", [False, True])
def test_an_eager_step_waits_once_per_collective(sp):
    """Eagerly too, each functional collective of a training step is waited on once: its
    ``AsyncCollectiveTensor`` is resolved by ``trigger_wait``, not by ``funcol.wait_tensor``, whose
    Python dispatch waited to unwrap it and then ran ``wait_tensor`` again (3 per collective:
    27 waits for 9 all-reduces in a profiled 1-layer GPT-2 step on gloo)."""
    from torch.profiler import profile

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=ids, labels=ids, use_cache=False)
    with fake_group(2):
        pm = sptransform.parallelize(copy.deepcopy(_gpt2(1)), tp=2, sp=sp, example_inputs=inputs)
        pm(**inputs).loss.backward()
        with profile() as prof:
            pm(**inputs).loss.backward()
    names = collections.Counter(e.name for e in prof.events())
    # each functional collective once (its in-place variant underneath is not another one)
    collectives = sum(names[f"_c10d_functional::{op}"]
                      for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"))
    assert collectives >= (4 if sp else 2), names
    assert names["_c10d_functional::wait_tensor"] == collectives, names


def _matmuls_in_windows(code: str) -> list[int]:
    """Per all-reduce of inductor's generated ``call``: the matmul kernels between it and its wait."""
    import re

    lines = [line.strip() for line in code[code.index("def call("):].splitlines()]
    found = []
    for i, line in enumerate(lines):
        issued = re.match(r"torch\.ops\._c10d_functional\.all_reduce_\.default\((?:reinterpret_tensor\()?(buf\d+)\b", line)
        if issued:
            wait = next(j for j in range(i, len(lines)) if re.search(rf"wait_tensor\.default\((?:reinterpret_tensor\()?{issued.group(1)}\b", lines[j]))
            found.append(sum(1 for x in lines[i + 1: wait] if re.match(r"extern_kernels\.(add)?mm\(", x)))
    return found


@pytest.mark.slow  # two inductor compiles of a 1-layer GPT-2 step (~20 s each)
@pytest.mark.in_process
@pytest.mark.parametrize("pinned", [True, False])
def test_inductor_keeps_the_weight_gradients_matmuls_inside_the_all_reduce_windows(pinned, monkeypatch):
    """``compile="inductor"``, tp=2 without SP: in the generated backward, the input gradient's
    all-reduce of a column-parallel linear is in flight while the weight gradient's matmul runs
    (the overlap pass's window, kept by ``pin_windows``). Without the pins inductor's scheduler
    waits on each all-reduce at once (the counterpart case, so that this test can fail)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    import sptransform.passes.overlap as overlap

    if not pinned:
        monkeypatch.setattr(overlap, "window_order", lambda gm: {})
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=ids, labels=ids, use_cache=False)
    torch._dynamo.reset()
    with fake_group(2), inductor_config.patch(force_disable_caches=True):
        pm = sptransform.parallelize(copy.deepcopy(_gpt2(1)), tp=2, sp=False, example_inputs=inputs,
                                     recompute=1.0, compile="inductor")
        _, codes = run_and_get_code(lambda: pm(**inputs).loss.backward())
    assert len(codes) == 2, len(codes)  # the forward, then (at the first backward) the backward
    windows = _matmuls_in_windows(codes[1])
    assert len(windows) == 3, windows  # the head's, the MLP's and the attention's input gradients
    assert (sum(windows) >= 2) if pinned else (sum(windows) == 0), windows
