"""The driver: the pass list's contract (each pass requires only what an earlier one adds, every
meta key a build writes is declared), the build at tp=1 and tp=2, tp=1 analysing its graph once,
and the AOTAutograd driver's compile-cache key (sptransform's inductor compiles are keyed by rank)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.distributed as dist

import sptransform
import sptransform.graph.analysis as graph_analysis
import sptransform.graph.plan as graph_plan
from simulate import fake_group
from sptransform.runtime.rng import RankGenerators
from sptransform.capture import FakeTemplate, capture
from sptransform.options import ParallelOptions
from sptransform.passes.base import declared_meta_keys, op_counts
from sptransform.compile_graphs import MENDED_TAG, _keyed_by_rank, compile_cache_tag, rank_cache_tag
from sptransform.transform import PASSES, Build, build_parallel_graph
from tiny_models import TinyConfig, TinyLM


def test_cache_tag_names_the_rank_only_with_several_ranks():
    assert rank_cache_tag() == torch.compiler.config.cache_key_tag  # no process group: unchanged
    with fake_group(2):
        assert rank_cache_tag() == "sptransform rank 0/2"
        with torch.compiler.config.patch(cache_key_tag="mine"):
            assert rank_cache_tag() == "mine|sptransform rank 0/2"  # the user's own tag is kept
            # inductor code from before the mend of a defect it had is never loaded (test_backend)
            assert compile_cache_tag() == f"mine|sptransform rank 0/2|{MENDED_TAG}"
    assert compile_cache_tag() == MENDED_TAG


def test_each_compile_runs_under_the_rank_tag_and_leaves_the_config_as_it_was():
    seen = []
    record = lambda gm, inputs: seen.append(torch.compiler.config.cache_key_tag)  # noqa: E731
    compiler = _keyed_by_rank(record, "sptransform rank 1/2")
    compiler(None, [])
    assert seen == ["sptransform rank 1/2"]
    assert torch.compiler.config.cache_key_tag == ""


# ---------------------------------------------------------------------------
# the pass list and the build


def _tiny(**overrides):
    model = TinyLM(TinyConfig(**overrides))
    ids = torch.randint(0, 61, (2, 8))
    return model, (ids, ids.roll(1, 1))


def _build(model, inputs, options: ParallelOptions):
    with fake_group(options.tp):
        return build_parallel_graph(FakeTemplate(model, torch.device("cpu")), inputs, {}, options,
                                    dist.group.WORLD.group_name, generators=RankGenerators(0, options.tp, None))


def test_every_pass_requires_only_what_the_start_or_an_earlier_pass_provides():
    fields = {f.name for f in dataclasses.fields(Build)}
    provided = {"captured", "options", "group", "dp_group", "generators", "overlap", "entry", "experts", "val"}
    for p in PASSES:
        assert set(p.requires) <= provided, (p.name, set(p.requires) - provided)
        provided |= set(p.adds)
    assert {f for f in fields if f not in provided} == set(), "a Build field no pass adds"


def test_each_meta_key_is_added_by_exactly_one_pass():
    keys = [key for p in PASSES for key in p.adds if key not in {f.name for f in dataclasses.fields(Build)}]
    assert sorted(keys) == sorted(set(keys)) == ["sptransform_spec"]


@pytest.mark.parametrize("options", [ParallelOptions(tp=2, sp=True), ParallelOptions(tp=2, sp=False, dp=2)])
def test_the_meta_keys_a_build_writes_are_exactly_the_declared_ones(options):
    model, inputs = _tiny(dropout=0.1)
    captured = capture(FakeTemplate(model, torch.device("cpu")), inputs, {})
    torch_keys = {key for n in captured.gm.graph.nodes for key in n.meta}
    with fake_group(options.tp * options.dp):
        graph = build_parallel_graph(FakeTemplate(model, torch.device("cpu")), inputs, {}, options,
                                     dist.group.WORLD.group_name, generators=RankGenerators(0, options.tp, None),
                                     dp_group=dist.group.WORLD.group_name if options.dp > 1 else None)
    written = {key for n in graph.gm.graph.nodes for key in n.meta} - torch_keys
    assert written == declared_meta_keys(PASSES, Build)


def test_tp1_build_runs_no_pass_and_keeps_the_captured_graph():
    model, inputs = _tiny()
    captured = capture(FakeTemplate(model, torch.device("cpu")), inputs, {})
    graph = _build(model, inputs, ParallelOptions(tp=1))
    assert graph.analysis is None and graph.plan is None and graph.data_parallel is None
    assert op_counts(graph.gm) == op_counts(captured.gm)


def test_tp2_build_fills_the_plan_and_adds_collectives():
    model, inputs = _tiny()
    graph = _build(model, inputs, ParallelOptions(tp=2, sp=True))
    assert graph.plan.tp == 2 and graph.plan.seq_len == 8 and graph.analysis.regions
    ops = op_counts(graph.gm)
    assert any("scatter_seq" in op for op in ops) and any("gather_seq" in op for op in ops)
    assert sum(1 for n in graph.gm.graph.nodes if n.op == "placeholder" and n.name == "tp_rank") == 1


def test_tp2_build_logs_each_pass_op_count_change_at_debug(caplog):
    model, inputs = _tiny()
    with caplog.at_level(logging.DEBUG, logger="sptransform.passes"):
        _build(model, inputs, ParallelOptions(tp=2, sp=True))
    logged = [r.getMessage().split(":")[0] for r in caplog.records if r.name == "sptransform.passes"]
    # dp=1; shard_whole runs at every tp > 1 (parameters split in segments no DTensor placement holds)
    assert logged == [p.name for p in PASSES if p.name not in ("analyse_layers", "expert_parallel", "data_parallel", "token_weighting")]
    tensor_parallel = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("tensor_parallel"))
    assert "scatter_seq" in tensor_parallel


def test_sp_with_a_sequence_tp_does_not_divide_names_the_fix():
    model = TinyLM(TinyConfig())
    ids = torch.randint(0, 61, (2, 7))
    with pytest.raises(ValueError, match="sequence length 7 is not divisible by tp=2"):
        _build(model, (ids, ids), ParallelOptions(tp=2, sp=True))


def test_tp1_step_analyses_the_captured_graph_once_over_four_microbatches(monkeypatch):
    calls = []
    real = graph_analysis.analyze

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(graph_analysis, "analyze", counted)
    monkeypatch.setattr(graph_plan, "analyze", counted)
    model, (ids, targets) = _tiny()
    ids, targets = torch.randint(0, 61, (8, 8)), torch.randint(0, 61, (8, 8))
    pm = sptransform.parallelize(model, tp=1, n_microbatches=4, example_inputs=(ids, targets))
    pm.step(ids, targets)
    pm.step(ids, targets)
    assert calls == [1]


# ---------------------------------------------------------------------------
# entries: another forward of the module, its inputs and outputs stored split as dataflow reads them


class CachedAttention(torch.nn.Module):
    """One attention block that reads a cache of earlier keys and values and returns its own."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (torch.nn.Linear(hidden, hidden) for _ in range(3))
        self.o = torch.nn.Linear(hidden, hidden)

    def split(self, t):
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x, *cache):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).flatten(2)), k[:, :, -x.shape[1]:], v[:, :, -x.shape[1]:]


def _step(module, x, *cache):
    return type(module).forward(module, x, *cache)


@pytest.mark.parametrize("split", [True, False])
def test_an_entry_stores_its_cache_split_by_heads_where_its_readers_read_it_so(split):
    from sptransform.capture import Entry

    model, options = CachedAttention(), ParallelOptions(tp=2, sp=False)
    x, cache = torch.randn(2, 1, 32), torch.randn(2, 4, 5, 8)
    entry = Entry("step", _step, split_inputs=(1, 2) if split else (), split_outputs=(1, 2) if split else ())
    with fake_group(2):
        graph = build_parallel_graph(FakeTemplate(model, torch.device("cpu")), (x, cache, cache), {}, options,
                                     dist.group.WORLD.group_name, generators=RankGenerators(0, 2, None), entry=entry)
    gm, plan = graph.gm, graph.plan
    if split:  # heads split; the cache given as this rank's heads, returned as them: no cut, no gather
        assert plan.placements["k.weight"].spec.dim == 0 and plan.placements["o.weight"].spec.dim == 1
        assert {i: s.dim for i, s in plan.input_specs.items()} == {1: 1, 2: 1}
        assert {i: (s.dim, size) for i, (s, size) in plan.output_specs.items()} == {1: (1, 4), 2: (1, 4)}
        assert not [n for n in op_counts(gm) if "take_local" in n or "gather" in n]
    else:  # keys and values returned whole leave the block: it runs whole on every rank (correct, not split)
        assert "k.weight" not in plan.placements and "q.weight" not in plan.placements
        assert plan.input_specs == {} and set(plan.output_specs) <= {0}  # (o, left over, is taken as a head)


def test_an_entry_input_read_whole_somewhere_stays_whole():
    from sptransform.capture import Entry

    def step(module, x, *cache):
        out, k, v = type(module).forward(module, x, *cache)
        return out + cache[0].mean(), k, v  # the cache read whole as well: no single split serves it

    model, options = CachedAttention(), ParallelOptions(tp=2, sp=False)
    x, cache = torch.randn(2, 1, 32), torch.randn(2, 4, 5, 8)
    with fake_group(2):
        graph = build_parallel_graph(FakeTemplate(model, torch.device("cpu")), (x, cache, cache), {}, options,
                                     dist.group.WORLD.group_name, generators=RankGenerators(0, 2, None),
                                     entry=Entry("step", step, split_inputs=(1, 2), split_outputs=(1, 2)))
    assert list(graph.plan.input_specs) == [2]  # the values are still given split; the keys whole
