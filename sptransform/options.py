"""Every public option of sptransform, as frozen keyword-only dataclasses validated once.

``ParallelOptions`` (tensor/sequence parallelism, dropout, recompute), ``PipelineOptions``
(pipeline parallelism) and ``RematOptions`` (the rematerialisation pass and the
``sptransform`` torch.compile backend). Each field is typed with ``Literal`` where it
takes names, and ``__post_init__`` checks types and ranges, so a bad value fails at the
call that passed it, naming the value, the rule and the fix.

This module imports nothing of sptransform: every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

RecomputePolicy = Literal["none", "selective", "full", "norm_upproj"]
"""What ``parallelize(..., recompute=...)`` names; a number instead is a memory budget."""
RECOMPUTE_POLICIES: tuple[RecomputePolicy, ...] = get_args(RecomputePolicy)

RematPolicy = Literal["none", "selective", "full", "norm_upproj", "budget", "blocks"]
"""The rematerialisation pass's policies: the named ones, a budget, and checkpointed blocks."""
REMAT_POLICIES: tuple[RematPolicy, ...] = get_args(RematPolicy)
BlockKind = Literal["attention", "mlp"]

ScheduleName = Literal["gpipe", "1f1b", "interleaved1f1b", "looped_bfs", "zbv", "dualpipev"]
SCHEDULE_NAMES: tuple[ScheduleName, ...] = get_args(ScheduleName)
DEFAULT_STAGES_PER_RANK: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2, "looped_bfs": 2, "zbv": 2,
                                             "dualpipev": 2}
"""Stages each rank holds when ``stages_per_rank`` is not given: one, or two for the
schedules that run several stages per rank."""

DropoutRng = Literal["independent", "reference"]
DpLoss = Literal["tokens", "replicas"]
"""How data-parallel replicas' gradients are combined (``ParallelOptions.dp_loss``)."""
DEFAULT_PEER_TIMEOUT_S = 300.0
"""Seconds a data-parallel rank waits for its peers by default (``ParallelOptions.peer_timeout_s``)."""
ZeroStage = Literal[0, 1, 2, 3]

GraphCompiler = Literal["eager", "inductor"]
"""How sptransform compiles the forward and backward graphs it partitions itself (``recompute``,
the ``sptransform`` torch.compile backend): ``"inductor"`` generates fused kernels, ``"eager"``
runs the ATen graphs op by op."""
GRAPH_COMPILERS: tuple[GraphCompiler, ...] = get_args(GraphCompiler)


def _check_int(name: str, value, *, minimum: int, maximum: int | None = None, fix: str = "") -> None:
    """An int (not a bool) in ``[minimum, maximum)``; the error names the value, the rule and ``fix``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})" + (f": {fix}" if fix else ""))
    if value < minimum or (maximum is not None and value >= maximum):
        rule = f"at least {minimum}" if maximum is None else f"in [{minimum}, {maximum})"
        raise ValueError(f"{name}={value} must be {rule}" + (f": {fix}" if fix else ""))


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def check_graph_compiler(compile) -> None:
    """``compile`` (of ``parallelize``, ``ParallelOptions`` and the backend's options) is one of
    ``GRAPH_COMPILERS``; the error names the value, the rule and the fix."""
    if not isinstance(compile, str) or compile not in GRAPH_COMPILERS:
        raise ValueError(
            f"compile={compile!r} must be one of {list(GRAPH_COMPILERS)}: use 'inductor' (fused kernels, "
            "the default) or 'eager' (the partitioned ATen graphs run op by op, for debugging)"
        )


SEED_LIMIT = 2**63
"""Seeds are ints in ``[0, 2**63)``: ``torch.Generator.manual_seed`` takes a 64-bit value and
the per-rank generators add the rank to it."""

DEFAULT_GRAPH_CACHE_SIZE = 8
"""Input signatures (shape, dtype, structure, train/eval mode) whose transformed graphs a
``ParallelModule`` keeps; the least recently used is dropped beyond this (each graph holds
about 1-2 MiB for a small model, several times that with ``recompute``)."""


def check_recompute(recompute) -> None:
    """A policy name, or a budget: bytes per rank (int >= 2) or a fraction of ``"none"`` in (0, 1]."""
    if isinstance(recompute, str):
        if recompute not in RECOMPUTE_POLICIES:
            raise ValueError(
                f"recompute={recompute!r} is not a policy: use one of {list(RECOMPUTE_POLICIES)} "
                "or a memory budget (bytes per rank, or a fraction of 'none' in (0, 1])"
            )
        return
    if isinstance(recompute, bool) or not isinstance(recompute, (int, float)):
        raise TypeError(
            f"recompute={recompute!r} ({type(recompute).__name__}) is neither a policy nor a budget: use one of "
            f"{list(RECOMPUTE_POLICIES)}, an int of bytes per rank, or a float fraction of 'none' in (0, 1]"
        )
    if isinstance(recompute, float):
        if not 0 < recompute <= 1:  # also false for nan
            raise ValueError(
                f"recompute={recompute!r}: a float budget is a fraction of what recompute='none' saves and must be "
                "in (0, 1]; pass bytes per rank as an int"
            )
    elif recompute < 2:
        raise ValueError(
            f"recompute={recompute!r}: an int budget is bytes per rank and must be at least 2; "
            "pass 1.0 for the whole of recompute='none', or a fraction in (0, 1] as a float"
        )


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    tp: int
    """Tensor-parallel degree: ranks that split every linear."""
    sp: bool = True
    """Sequence parallelism: norms, dropouts and residuals split along the sequence."""
    dropout_rng: DropoutRng = "independent"
    """``independent``: split activations draw masks from a per-rank generator;
    ``reference``: masks equal the single-device model's bit for bit (tests)."""
    seed: int | None = None
    """Seed of the per-rank dropout generators; default ``torch.initial_seed()``."""
    recompute: RecomputePolicy | float | int = "none"
    """Rematerialisation of the parallel graph (``sptransform.passes.remat``): ``"none"``,
    ``"selective"`` (attention internals), ``"full"`` (all but each layer's input),
    ``"norm_upproj"``, or a memory budget: bytes per rank (int > 1) or a fraction of
    ``"none"`` (float in (0, 1])."""
    check_inputs: bool = True
    """Before each call, compare a fingerprint of the inputs (shapes, dtypes, values, train/eval
    mode) across the tensor-parallel ranks in one small all-gather, so that ranks given
    different batches fail with a clear error on every rank instead of computing a loss that
    matches neither, or aborting inside a collective. ``False`` skips the collective (the
    cheap local checks, token ids and labels inside the vocabulary, stay)."""
    graph_cache_size: int = DEFAULT_GRAPH_CACHE_SIZE
    """Transformed graphs kept, one per input signature and mode; least recently used dropped."""
    dp: int = 1
    """Data-parallel degree: groups of ranks that each train on their own batch, gradients
    averaged over them."""
    ep: int = 1
    """Expert-parallel degree: the data-parallel ranks fall into groups of ``ep`` that split every
    routed expert layer's experts (``E/ep`` each) and run them on the group's tokens (all-gather of
    the tokens, reduce-scatter of the outputs: ``passes.expert_parallel``). Divides ``dp``."""
    zero: ZeroStage = 0
    """0: parameters, gradients and optimizer state replicated over the data-parallel ranks.
    1, 2 and 3: parameters stored in 1/dp pieces (so the optimizer's state is 1/dp), each layer's
    parameters gathered when it runs; 1 and 2 keep the gathered parameters for backward
    (gathered once per forward), 3 gathers them again for its backward. Gradients: all-reduced
    whole and this rank's piece kept (1), or reduce-scattered to the pieces (2 and 3)."""
    shard_whole: bool = False
    """Parameters the tensor-parallel rewrite uses whole on every rank (norms, routers, and weights
    no rule splits: a fused multi-query projection, data-dependent experts) stored in 1/tp pieces
    instead, each layer's all-gathered where it starts (``passes.shard_whole``): their weights,
    gradients and optimizer state split over the tp ranks, their computation still whole; one
    all-gather per layer more in each forward, nothing more in the backward. Needs ``tp > 1``.
    (Parameters split in the graph whose split no DTensor placement holds, a fused weight of
    unequal segments, are stored so either way: gathered where read, their gradient
    reduce-scattered, the bytes the all-reduce of their gradient moved otherwise.)"""
    dp_loss: DpLoss = "tokens"
    """With ``dp > 1``, how the replicas' gradients are combined. ``"tokens"``: where the loss
    the model returns is a mean over its non-ignored targets (cross-entropy or NLL with mean
    reduction and no class weights, found on the graph), each replica's gradient is weighted by
    its share of the global count of those targets (one all-reduce of a count per call), so
    training equals one device on the concatenated batch even when replicas hold different
    numbers of ``-100`` labels or different local batch sizes; any other loss gets the mean of
    the replicas' gradients. ``"replicas"``: always the mean of the replicas' gradients (plain
    DDP). Either way each replica's returned loss is its own local mean."""
    peer_timeout_s: float | None = DEFAULT_PEER_TIMEOUT_S
    """With ``dp > 1``, the longest a rank waits for its data-parallel peers: at each call's
    replica check and in the gradient collectives of the data-parallel process group sptransform
    creates (the group's timeout). Past it every waiting rank raises, naming the rank that did
    not arrive. ``None``: the process group's own timeout (torch's default: 30 minutes)."""
    compile: GraphCompiler = "inductor"
    """How the forward and backward graphs that ``recompute`` partitions (of the module, or of each
    pipeline stage) are compiled: ``"inductor"`` (default) generates fused kernels (C++/OpenMP on
    CPU, Triton on GPU) for both, with the rematerialisation partition unchanged; ``"eager"`` runs
    them op by op, for debugging (and where no C++ compiler / Triton is available). Compiled on the
    first call of each input signature. With ``recompute="none"`` nothing is partitioned and this
    is not used: ``torch.compile(pm)`` compiles such a module."""
    overlap: bool | None = None
    """Overlap communication with computation. The graphs sptransform compiles itself
    (``recompute``) issue each collective as early and wait on it as late as dataflow allows
    (``passes.overlap``), unless ``False``. Eagerly, the gradient buckets' all-reduces and
    reduce-scatters (data-parallel, and replicated parameters' partial gradients) are left in
    flight through the rest of the backward and waited on when it ends: with ``True``, or by
    default (``None``) on accelerators only — on CPU, gloo reduces on the cores that compute, and
    steps measured 3-17% slower with it. ``False`` waits on each collective right after issuing
    it (for debugging, and to measure what overlap hides)."""

    def overlaps_buckets(self, device_type: str) -> bool:
        """Whether eager gradient buckets stay in flight on a ``device_type`` rank (see ``overlap``)."""
        return self.overlap if self.overlap is not None else device_type != "cpu"

    def __post_init__(self) -> None:
        _check_int("tp", self.tp, minimum=1)
        _check_int("dp", self.dp, minimum=1)
        _check_int("ep", self.ep, minimum=1, fix="the number of ranks that split the experts (1: every rank holds all)")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: expert parallelism splits the experts over groups "
                             f"of ep data-parallel ranks; use dp={self.ep * max(1, -(-self.dp // self.ep))} or an ep "
                             f"that divides {self.dp}")
        if isinstance(self.zero, bool) or not isinstance(self.zero, int):
            raise TypeError(f"zero={self.zero!r} ({type(self.zero).__name__}): the ZeRO stage is an int, 0 to 3")
        if self.zero not in get_args(ZeroStage):
            raise ValueError(f"zero={self.zero}: ZeRO stages are 0, 1, 2 and 3; use one of them (0: no sharding)")
        _check_bool("sp", self.sp)
        _check_bool("shard_whole", self.shard_whole)
        if self.shard_whole and self.tp == 1:
            raise ValueError("shard_whole=True splits what tensor parallelism keeps whole over the tp ranks, and "
                             "tp=1 has none: pass tp > 1, or zero=1..3 with dp > 1 to split parameters over "
                             "data-parallel ranks")
        if self.dropout_rng not in get_args(DropoutRng):
            raise ValueError(f"dropout_rng={self.dropout_rng!r}: use 'independent' or 'reference'")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0, maximum=SEED_LIMIT,
                       fix="pass an int in [0, 2**63), or None for torch.initial_seed()")
        check_recompute(self.recompute)
        _check_bool("check_inputs", self.check_inputs)
        _check_int("graph_cache_size", self.graph_cache_size, minimum=1,
                   fix="the number of input signatures whose graphs are kept (default 8)")
        check_graph_compiler(self.compile)
        if self.overlap is not None:
            _check_bool("overlap", self.overlap)
        if self.dp_loss not in get_args(DpLoss):
            raise ValueError(f"dp_loss={self.dp_loss!r}: use 'tokens' (weighted by each replica's count of "
                             "non-ignored targets) or 'replicas' (the mean of the replicas' gradients)")
        if self.peer_timeout_s is not None and (isinstance(self.peer_timeout_s, bool) or not isinstance(
                self.peer_timeout_s, (int, float)) or not 0 < self.peer_timeout_s < float("inf")):
            raise ValueError(f"peer_timeout_s={self.peer_timeout_s!r}: pass a positive number of seconds, or None "
                             "for the process group's own timeout")

    @property
    def remat(self) -> "RematOptions | None":
        """The rematerialisation pass's options for ``recompute`` (None for ``"none"``)."""
        if self.recompute == "none":
            return None
        if isinstance(self.recompute, str):
            return RematOptions(policy=self.recompute)
        return RematOptions(policy="budget", budget=self.recompute)


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    pp: int
    """Pipeline-parallel degree: ranks that each hold a slice of the layers."""
    schedule: ScheduleName = "1f1b"
    """Torch schedule that runs the stages (see ``sptransform.pipeline.schedule.SCHEDULES``)."""
    n_microbatches: int = 1
    """Microbatches each global batch is split into (along dim 0 of every tensor input)."""
    stages_per_rank: int | None = None
    """Virtual stages per rank; default 1, or 2 for multi-stage schedules."""
    stored_microbatches: int | None = None
    """Microbatch-level recomputation (Korthikanti et al., Appendix C): each stage keeps every
    activation of up to this many in-flight microbatches, a moving window, and runs the
    recompute policy on the others. ``None``: every microbatch runs the policy."""

    def __post_init__(self) -> None:
        _check_int("pp", self.pp, minimum=1)
        _check_int("n_microbatches", self.n_microbatches, minimum=1,
                   fix="the number of microbatches each global batch is split into (1: the whole batch at once)")
        if self.stored_microbatches is not None:
            _check_int("stored_microbatches", self.stored_microbatches, minimum=0,
                       fix="the in-flight microbatches whose activations are all kept (0: recompute every one)")
        if self.stages_per_rank is not None:
            _check_int("stages_per_rank", self.stages_per_rank, minimum=1,
                       fix="pipeline stages per rank (1, or 2 for interleaved1f1b/looped_bfs/zbv/dualpipev)")
        if not isinstance(self.schedule, str):
            raise TypeError(f"schedule must be a name, got {self.schedule!r}; use one of {', '.join(SCHEDULE_NAMES)}")
        if str(self.schedule).lower() not in SCHEDULE_NAMES:
            raise ValueError(f"schedule={self.schedule!r} is not one sptransform runs; use one of {', '.join(SCHEDULE_NAMES)}")
        if str(self.schedule).lower() == "dualpipev" and self.n_microbatches < self.num_stages:
            raise ValueError(
                f"schedule='dualpipev' needs at least as many microbatches as stages: n_microbatches="
                f"{self.n_microbatches} < {self.num_stages} stages (pp={self.pp} x {self.virtual} per rank); "
                f"use n_microbatches={self.num_stages} or more")

    @property
    def virtual(self) -> int:
        """Stages per rank."""
        return self.stages_per_rank or DEFAULT_STAGES_PER_RANK[str(self.schedule).lower()]

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual


@dataclass(frozen=True, kw_only=True)
class RematOptions:
    """How the rematerialisation pass partitions a joint forward+backward graph."""

    policy: RematPolicy = "none"
    """What to recompute; see ``sptransform.passes.remat``."""
    budget: int | float | None = None
    """For ``policy="budget"``: bytes saved for backward per rank and graph (an int), or a
    fraction f in (0, 1] of the way from the smallest feasible partition (inputs and RNG states
    only) to ``"none"``: ``minimum + f * (none - minimum)`` bytes. A fraction holds for a whole
    model call that dynamo compiles as several graphs (a graph break at the loss): each graph
    gets its own share, and the shares add up to the same fraction of the whole call."""
    replay_rng: bool = True
    """Recompute random ops by replaying their RNG state exactly; else save their outputs."""
    recompute_collectives: bool = False
    """Allow recomputing collectives (priced by the bytes they move)."""
    regather_sequence_shards: bool = True
    """Sequence parallelism: never save an all-gather's output that feeds a weight matmul;
    save its local shard and gather again in backward (the paper's section 4.2.2). A no-op
    on graphs without such all-gathers."""
    recompute_fusible: bool = True
    """Let every policy recompute memory-bound ops (pointwise ops, casts, norms, softmax: no
    matmul, collective or random draw) in the backward where that keeps fewer bytes, as torch's
    default partitioner does after inductor's decompositions, so no policy keeps more than
    ``torch.compile`` would. A bare reduction (``sum``, ``mean``, ``amax``, ``var_mean``: a loss's
    log-softmax statistics, a hand-written RMSNorm's mean) is saved, never run again, as torch
    bans too: its output is small and running it again re-reads its whole input. False saves
    their outputs, as eager PyTorch (and the paper's Table 2) counts."""
    flops_per_comm_byte: float = 1000.0
    """Recompute cost of moving one byte, in FLOPs (about an A100's FLOP/s over its NVLink B/s)."""
    blocks: tuple[BlockKind, ...] = ()
    """For ``policy="blocks"``: checkpoint these sublayer kinds like ``torch.utils.checkpoint``
    of a block (save its input, recompute its body): ``("attention",)``, ``("mlp",)`` or both."""

    def __post_init__(self):
        if self.policy not in REMAT_POLICIES:
            raise ValueError(f"unknown recompute policy {self.policy!r}; use one of {list(REMAT_POLICIES)}")
        if (self.policy == "blocks") != bool(self.blocks) or set(self.blocks) - set(get_args(BlockKind)):
            raise ValueError(
                f"blocks={self.blocks!r} with policy={self.policy!r}: policy='blocks' takes blocks from "
                "('attention', 'mlp'), and only it does"
            )
        if self.policy == "budget":
            if self.budget is None:
                raise ValueError('policy="budget" needs budget=<bytes per rank> or a fraction of "none" in (0, 1]')
            if isinstance(self.budget, float) and not 0 < self.budget <= 1:
                raise ValueError(f"budget={self.budget} as a fraction of 'none' must be in (0, 1]; pass bytes as an int")
            if isinstance(self.budget, int) and self.budget < 0:
                raise ValueError(f"budget={self.budget} bytes is negative")
        elif self.budget is not None:
            raise ValueError(f'budget={self.budget!r} only applies to policy="budget", not {self.policy!r}')


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """How ``pm.generate`` / ``sptransform.generate`` choose tokens: HF ``generate``'s meaning for
    each field (``runtime.generate`` resolves them from the call, then the model's
    ``generation_config``, then HF's defaults)."""

    max_new_tokens: int
    """Tokens appended to every row (fewer when every row has ended with ``eos_token_id``)."""
    do_sample: bool = False
    """``False``: greedy (argmax); ``True``: multinomial sampling from the default generator."""
    temperature: float = 1.0
    """Scores are divided by it before sampling (sampling only)."""
    top_k: int | None = None
    """Keep the ``top_k`` highest scores before sampling (None or 0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches ``top_p`` (1.0: all)."""
    eos_token_id: tuple[int, ...] = ()
    """A row that produced one of these has ended: it gets ``pad_token_id`` afterwards."""
    pad_token_id: int | None = None
    """What ended rows get (default: the first ``eos_token_id``)."""
    use_cache: bool = True
    """A parallel module of an HF causal LM keeps each rank's heads' keys and values
    (``runtime.kv_cache``); ``False``, or a model it does not apply to: every step runs the model
    on the whole sequence so far."""

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1, fix="the number of tokens to generate")
        _check_bool("use_cache", self.use_cache)
        _check_bool("do_sample", self.do_sample)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} must be a number > 0 (1.0 leaves the scores as they are)")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=0, fix="the number of highest-scoring tokens kept, or None for all")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1] (1.0 keeps every token)")
        for token in self.eos_token_id:
            _check_int("eos_token_id", token, minimum=0, fix="a token id, a list of them, or None")
        if self.pad_token_id is not None:
            _check_int("pad_token_id", self.pad_token_id, minimum=0, fix="a token id, or None")
