"""Rematerialisation as a partition of the AOTAutograd joint forward+backward graph.

Paper's layer, policy ``"selective"`` (Korthikanti et al. 2022, section 5):

    before:  fw saves q, k, softmax(s), dropout mask, dropout(softmax(s)), v   (34sbh + 5as^2b a layer)
    after:   fw saves q, k, v and the RNG state of the attention dropout;   (34sbh + 5 KiB)
             bw runs s = q @ k^T; p = softmax(mask(s * scale)); d = dropout(p)  (dropout replayed exactly)
             just before the backward of attention-over-V reads d and p

The pass is a ``partition_fn`` for ``aot_module_simplified`` / ``aot_function``
(``remat_partition(options)``). It never edits the user's model; it reads the joint
graph and returns new forward and backward graph modules. Its steps are a pass list of
their own, ``JOINT_PASSES`` (``passes.base``), run on the joint graph. It is split in two:

* **find** (``analyze_joint`` + ``plan_remat``): which forward values to save.
  Every policy is the same s-t min cut over the forward nodes (node ``v`` split in
  ``v_in -> v_out`` with capacity = bytes ``v`` keeps alive if saved; ``source ->
  v_in`` with capacity = lambda * cost of recomputing ``v``; data edges and "needed
  by the backward" edges infinite). A policy only sets which nodes may not be saved
  (``must_recompute``) and which may not be recomputed (``banned``):

  - ``"none"``: no matmul, collective or random draw is recomputed (views, constants and a
    dropout's scaling of its own mask are free; with ``recompute_fusible``, the default, every
    policy may also recompute memory-bound ops where that keeps fewer bytes, as torch's
    default partitioner does, so none keeps more than ``torch.compile``);
  - ``"selective"``: the attention internals between QK^T and attention-over-V may
    not be saved (explicit softmax attention only; with a fused kernel there is
    nothing materialized there and the plan's notes say so);
  - ``"full"``: nothing inside a layer may be saved except the layer inputs;
  - ``"norm_upproj"``: norms and MLP up-projections are recomputed (DeepSeek-V3);
  - ``"budget"``: nothing is forced; a fractional budget f is ``minimum + f * (none - minimum)``
    bytes (linear, so it splits exactly over the graphs of one dynamo call). Candidates: the
    cut for every lambda (the lower convex hull of saved bytes against recompute cost; layers tie-broken so they
    switch one at a time), the same with everything outside the layers kept, and the
    named policies; the cheapest candidate under the budget is then filled greedily.

  Random ops are recomputed only by exact replay of their generator's state
  (``functionalize_rng_ops`` for the default generator, ``replay_own_generators`` for
  a generator of their own); with ``replay_rng=False`` their masks are saved.
  Collectives are never recomputed unless ``recompute_collectives=True`` (then priced
  at ``flops_per_comm_byte``), except SP's re-gather (``regather_sequence_shards``).
* **rewrite** (``apply_plan``): extract the forward and backward modules around the
  saved set, drop dead recomputation, replay the recomputed random ops and order the
  backward so recomputation happens just before use; every ``view`` of the two graphs becomes
  a ``reshape`` (a copy only where what runs lays the value out otherwise than the joint
  trace: inductor decomposes the graphs again and chooses the saved tensors' layouts, which
  the backward is then compiled for, see ``compile_graphs.aot_compile``). Before finding, two rewrites of
  the joint graph (``isolate_dropout_masks``, ``compact_bernoulli_masks``) make masks
  one byte and their replay independent of activations.

``node.meta``: reads ``"val"``; writes ``"recompute"`` on replayed random nodes of the
joint graph (what torch's RNG functionalization reads) and ``FORWARD_TAG`` on its
required forward nodes (so a backward graph's recomputed ops can be found and counted).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from sptransform.logs import logger
from sptransform.options import REMAT_POLICIES as POLICIES  # noqa: F401  (re-exported)
from sptransform.options import RematOptions, RematPolicy  # noqa: F401  (re-exported)
from sptransform.capture import views_as_reshapes
from sptransform.graph.cost import FORWARD_TAG
from sptransform.torch_internals import extract_fwd_bwd_modules
from sptransform.torch_internals import detect_fake_mode, run_with_rng_state
from sptransform.torch_internals import partitioners as torch_partitioners
from sptransform.graph.nodes import JOINT_ID, TANGENT, is_random, number_joint_nodes, val
from sptransform.passes.base import Pass, PassResult, run_passes

from sptransform.passes.remat_rng import (
    compact_bernoulli_masks,
    isolate_dropout_masks,
    pytree_leaves,
    replay_own_generators,
    _keeps_when_dead,
)

log = logger(__name__)
aten = torch.ops.aten



from sptransform.passes.remat_find import (  # noqa: F401  (re-exported: the pass's find half)
    Constraints, CutSolution, JointAnalysis, MinCut, RematPlan, analysis_cost, analyze_joint, best_within_budget,
    fill_budget, pareto, plan_remat, policy_constraints, replayable, solution_from_saved, _own_generator,
)


# ---------------------------------------------------------------------------
# rewrite


def apply_plan(analysis: JointAnalysis, plan: RematPlan) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Build the forward and backward graph modules for ``plan`` (the rewrite step). The joint
    graph is only tagged, so one analysis can be applied with several plans."""
    joint = analysis.joint
    for n in analysis.required_fw:
        n.meta[FORWARD_TAG] = True
    default_rng = [n for n in plan.solution.replayed if not _own_generator(n)]
    for n in analysis.forward:
        if is_random(n):
            n.meta.pop("recompute", None)  # a previous plan's replay tags
    for n in default_rng:
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    saved_sym = [n for n in plan.saved if isinstance(val(n), (torch.SymInt, torch.SymFloat, torch.SymBool))]
    saved_values = [n for n in plan.saved if n not in saved_sym]
    fw, bw = extract_fwd_bwd_modules(
        joint, saved_values, saved_sym_nodes=saved_sym, num_fwd_outputs=analysis.num_fwd_outputs
    )
    # Extraction copies every forward op whose inputs the backward has; the ones no
    # gradient needs (a random op included) are dead and go.
    bw.graph.eliminate_dead_code(is_impure_node=_keeps_when_dead)
    bw.recompile()
    if default_rng:
        # torch reads the fake mode from the context AOTAutograd runs in; outside it (replanning
        # an analysis), enter the graph's own
        mode = detect_fake_mode(pytree_leaves(val(default_rng[0])))
        with mode if mode is not None and detect_fake_mode() is None else contextlib.nullcontext():
            fw, bw = torch_partitioners.functionalize_rng_ops(joint, fw, bw, len(saved_sym))
        for n in bw.graph.nodes:
            if n.target is run_with_rng_state:
                n.meta[FORWARD_TAG] = True
    own = [n for n in plan.solution.replayed if _own_generator(n)]
    if own:
        replay_own_generators(fw, bw, own, num_sym_nodes=len(saved_sym))
    bw = torch_partitioners.reordering_to_mimic_autograd_engine(bw)
    # The joint graph's views are valid for the strides of its trace (ATen's kernels); the
    # partitioned graphs may run on other layouts: inductor re-traces them with its
    # decompositions (its ``cat`` of one non-empty tensor keeps that tensor's layout, ATen's
    # returns it contiguous) and hands the backward the saved tensors as its forward laid them out.
    views_as_reshapes(fw)
    views_as_reshapes(bw)
    return fw, bw


def remat_partition(
    options: RematOptions,
    *,
    state_indices: Sequence[int] | None = None,
    on_partition: Callable[[JointAnalysis, RematPlan, fx.GraphModule, fx.GraphModule], None] | None = None,
) -> Callable:
    """A ``partition_fn`` for AOTAutograd applying ``options``.

    ``state_indices``: which joint inputs are parameters/buffers (default: the
    ``static_lifetime_input_indices`` AOTAutograd passes). ``on_partition`` is called
    with the analysis, the plan and the two graphs (measurement hooks in here)."""

    def partition(joint_module: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        indices = state_indices if state_indices is not None else kwargs.get("static_lifetime_input_indices") or []
        joint = Partition(options, joint_inputs, num_fwd_outputs, indices)
        run_passes(JOINT_PASSES, joint_module, joint)
        if on_partition is not None:
            on_partition(joint.analysis, joint.plan, joint.fw, joint.bw)
        return joint.fw, joint.bw

    return partition


@dataclass
class Partition:
    """One joint graph's partition: AOTAutograd's arguments, then what ``JOINT_PASSES`` add."""

    options: RematOptions
    joint_inputs: object
    num_fwd_outputs: int
    state_indices: Sequence[int]
    """Which joint inputs are parameters or buffers."""
    analysis: JointAnalysis | None = None
    plan: RematPlan | None = None
    fw: fx.GraphModule | None = None
    bw: fx.GraphModule | None = None


def _remove_dead_code(joint: fx.GraphModule, _: Partition) -> PassResult:
    before = len(joint.graph.nodes)
    joint.graph.eliminate_dead_code(is_impure_node=_keeps_when_dead)
    return PassResult(joint, len(joint.graph.nodes) != before)


def _number(joint: fx.GraphModule, p: Partition) -> PassResult:
    number_joint_nodes(joint.graph, p.joint_inputs)
    return PassResult(joint, False)


def _compact_masks(joint: fx.GraphModule, _: Partition) -> PassResult:
    changed = compact_bernoulli_masks(joint)
    joint.recompile()  # the masks' passes edit the graph only
    return PassResult(joint, changed > 0)


def _analyze(joint: fx.GraphModule, p: Partition) -> PassResult:
    p.analysis = analyze_joint(joint, num_fwd_outputs=p.num_fwd_outputs, state_indices=p.state_indices)
    return PassResult(joint, False)


def _plan(joint: fx.GraphModule, p: Partition) -> PassResult:
    p.plan = plan_remat(p.analysis, p.options)
    return PassResult(joint, False)


def _apply(joint: fx.GraphModule, p: Partition) -> PassResult:
    p.fw, p.bw = apply_plan(p.analysis, p.plan)
    return PassResult(joint, False)  # only tagged: the partition is in fw and bw


# The partition's own pass list, run on the joint graph in order (``passes.base``).
JOINT_PASSES: list[Pass] = [
    Pass("remove_dead_code", _remove_dead_code),
    Pass("number_joint_nodes", _number, adds=(JOINT_ID, TANGENT)),
    Pass("isolate_dropout_masks", lambda joint, p: PassResult(joint, isolate_dropout_masks(joint) > 0),
         requires=(JOINT_ID,), enabled=lambda p: p.options.replay_rng),
    Pass("compact_bernoulli_masks", _compact_masks, requires=(JOINT_ID,)),
    Pass("analyze_joint", _analyze, requires=(TANGENT, "val"), adds=("analysis",)),
    Pass("plan_remat", _plan, requires=("analysis",), adds=("plan",)),
    Pass("apply_plan", _apply, requires=("analysis", "plan", JOINT_ID),
         adds=("fw", "bw", FORWARD_TAG, "recompute")),
]


def tag_forward(joint: fx.GraphModule, *, num_fwd_outputs: int) -> None:
    """Mark the forward nodes of ``joint`` (for counting recomputation done by other partitioners)."""
    info = torch_partitioners.classify_nodes(joint, [], num_fwd_outputs)
    for n in info.required_fw_nodes:
        n.meta[FORWARD_TAG] = True

