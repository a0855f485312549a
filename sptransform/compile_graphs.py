"""Compiling partitioned graphs: AOTAutograd's one entry (``aot_compile``), the forward and
backward compilers it hands the partition to (``graph_compilers``: op by op, or inductor with the
overlap pass kept through its scheduler), their on-disk cache keys per rank, and the
rematerialising compile of a captured graph (``compile_with_remat``). ``transform`` builds the
parallel graph; this module turns a graph into something that runs forward and backward."""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from sptransform.options import GRAPH_COMPILERS, GraphCompiler, RematOptions
from sptransform.passes.base import run_logged
from sptransform.passes.overlap import OVERLAP_FOR_INDUCTOR_KEY, schedule_collectives, schedule_for_inductor
from sptransform.passes.remat import remat_partition
from sptransform.torch_internals import (
    INDUCTOR_MENDED, aot_module_simplified, inductor_graph_compilers, make_boxed_func, pytree,
    statistics_decompositions, stride_reporting,
)


def eager_compiler(gm: fx.GraphModule, _example_inputs):
    """Run a partitioned forward or backward graph op by op (no code generation)."""
    return make_boxed_func(gm.forward)


def graph_compilers(compile: GraphCompiler, num_user_outputs: int, module: torch.nn.Module | None = None, *,
                    overlap: bool = True):
    """The forward and backward compilers AOTAutograd hands the partitioned graphs to:
    ``"eager"`` runs them op by op; ``"inductor"`` decomposes each with inductor's table and
    generates fused kernels (C++ on CPU, Triton on GPU). Either way the graphs are the
    partition's: inductor compiles them as given and does not partition again, keyed by rank
    in torch's on-disk caches (``rank_cache_tag``). With ``overlap``, each graph's collectives
    are issued early and waited on late (``passes.overlap``), under inductor once more after its
    decompositions, its windows pinned (``schedule_for_inductor``)."""
    if compile == "eager":
        compilers = eager_compiler, eager_compiler
    elif compile == "inductor":
        pinned = (schedule_for_inductor, OVERLAP_FOR_INDUCTOR_KEY) if overlap else None
        graph = module if isinstance(module, fx.GraphModule) else None
        compilers = inductor_graph_compilers(num_user_outputs, graph, post_grad_pass=pinned)
        compilers = tuple(_keyed_by_rank(c, compile_cache_tag()) for c in compilers)
    else:
        raise ValueError(f"compile={compile!r}: use one of {list(GRAPH_COMPILERS)}")
    return tuple(_scheduled(c) for c in compilers) if overlap else compilers


def rank_cache_tag() -> str:
    """``torch.compiler.config.cache_key_tag`` with this process's rank added
    (``"sptransform rank 3/8"``; unchanged without a process group of several ranks). The
    on-disk caches of torch's compile path (inductor's FX graph cache, AOTAutograd's cache,
    the autotuning cache) put the tag into their keys. The ranks of one machine share those
    caches (``TORCHINDUCTOR_CACHE_DIR``), and a real rank's graph may be specialised on its
    rank (``narrow_vocab``'s width is a constant of it). Today every such value is written
    into the graph's code, which the keys read; keyed by rank as well, a rank never loads what
    another compiled even where a future specialisation hides from the key; a rank's second
    run can still load its own. (torch 2.13's FX graph cache bypasses these partitioned graphs,
    seen on tp=2 GPT-2: the tag guards a torch that caches them.)"""
    tag = torch.compiler.config.cache_key_tag
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tag
    return f"{tag}|sptransform rank {dist.get_rank()}/{dist.get_world_size()}".lstrip("|")


MENDED_TAG = "sptransform mends: inductor mutation renames; collective reads checked"
"""In the key of every graph sptransform compiles with inductor: code inductor generated without
``torch_internals.mend_inductor_mutation_renames`` (which may read a collective's result before
its wait) and unchecked by ``guard_inductor_collective_reads`` (which refuses such code; a cache
hit skips the scheduler it checks) is never loaded from a cache written before them."""


def compile_cache_tag() -> str:
    """``rank_cache_tag`` with ``MENDED_TAG`` added (where the mend is installed)."""
    tag = rank_cache_tag()
    return f"{tag}|{MENDED_TAG}".lstrip("|") if INDUCTOR_MENDED else tag


def _keyed_by_rank(compiler, tag: str):
    """``compiler`` run with ``tag`` as the compile caches' key tag (``rank_cache_tag``): set
    for that one compile (AOTAutograd compiles the backward lazily, at the first backward)."""
    def compile_graph(gm: fx.GraphModule, example_inputs):
        with torch.compiler.config.patch(cache_key_tag=tag):
            return compiler(gm, example_inputs)
    return compile_graph


def _scheduled(compiler):
    """``compiler`` after the overlap pass [schedule collectives]."""
    def compile_graph(gm: fx.GraphModule, example_inputs):
        run_logged("schedule_collectives", gm, lambda: schedule_collectives(gm))
        return compiler(gm, example_inputs)
    return compile_graph


def aot_compile(module: torch.nn.Module, tensor_inputs: Sequence[torch.Tensor], *, partition_fn,
                compile: GraphCompiler = "eager", overlap: bool = True, decompositions: dict | None = None) -> Callable:
    """The one AOTAutograd entry: ``module``'s joint graph, split by ``partition_fn``, with the
    forward and backward compiled by ``compile`` (``graph_compilers``). AOTAutograd lifts
    ``module``'s own parameters and buffers in front of ``tensor_inputs`` (``state_count``);
    ``overlap`` runs the overlap pass on both partitioned graphs. The joint graph keeps the
    model's own ops for the partition to read (``_softmax``, SDPA) but for two decompositions
    when inductor compiles: ``_log_softmax``'s and ``native_layer_norm``'s
    (``statistics_decompositions``: their per-row statistics can then be saved and only the
    pointwise rest recomputed; with ``compile="eager"`` the graphs run ATen's kernels, bit for
    bit eager's numbers); inductor decomposes each
    partitioned graph itself, and may lay a saved tensor out otherwise than the joint trace did:
    the backward is compiled for the strides the compiled forward reports (``stride_reporting``),
    as under ``torch.compile``. ``decompositions``: trace the joint graph with these instead (for
    measuring torch's own partitioner on the graph torch.compile gives it)."""
    fw_compiler, bw_compiler = graph_compilers(compile, _num_outputs(module), module, overlap=overlap)
    if decompositions is None and compile == "inductor":
        decompositions = statistics_decompositions()
    with stride_reporting(tensor_inputs):
        return aot_module_simplified(module, list(tensor_inputs), fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                     partition_fn=partition_fn, decompositions=decompositions)


def _num_outputs(module: torch.nn.Module) -> int:
    """How many outputs an FX module returns (1 for any other module: only read for output strides)."""
    if not isinstance(module, fx.GraphModule):
        return 1
    output = next(iter(module.graph.find_nodes(op="output")))
    return len(pytree.tree_leaves(output.args[0]))


def state_count(module: torch.nn.Module) -> int:
    """How many joint inputs AOTAutograd lifts from ``module`` (its parameters and buffers)."""
    return len(
        {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
    )


def compile_with_remat(gm: fx.GraphModule, inputs: list, remat: RematOptions, state_positions: Sequence[int],
                       compile: GraphCompiler = "eager", overlap: bool = True):
    """AOTAutograd over a captured graph with the rematerialisation partition of ``remat``.

    Non-tensor inputs (flags such as ``use_cache``) are baked in as constants first;
    the parameters/buffers (``gm``'s own index tables, then the inputs at
    ``state_positions``) are state, never activations. Returns a function of the
    tensor inputs, in order, that returns a tuple (also when ``gm`` returns one tensor);
    ``compile`` chooses the forward/backward compiler (``graph_compilers``)."""
    gm = copy.deepcopy(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensor_index: dict[int, int] = {}
    for position, (node, value) in enumerate(zip(placeholders, inputs)):
        if isinstance(value, torch.Tensor):
            tensor_index[position] = len(tensor_index)
        else:
            node.replace_all_uses_with(value) if node.users else None
            gm.graph.erase_node(node)
    output = next(iter(gm.graph.find_nodes(op="output")))
    if not isinstance(output.args[0], (tuple, list)):  # AOTAutograd wants tuple outputs
        output.args = ((output.args[0],),)
    gm.recompile()
    own = state_count(gm)
    state = list(range(own)) + [own + tensor_index[p] for p in state_positions if p in tensor_index]
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    return aot_compile(gm, tensors, partition_fn=remat_partition(remat, state_indices=state), compile=compile,
                       overlap=overlap)
