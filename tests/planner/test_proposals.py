"""The planner proposes only what ``parallelize`` runs (issue 19: it ranked ZeRO-1 first, which
``parallelize`` refused; now every stage runs), and its top proposals build."""

from __future__ import annotations

import pytest
import torch

import sptransform
from simulate import fake_group
from sptransform.options import ParallelOptions, PipelineOptions
from sptransform.planner import SearchSpace, plan
from sptransform.planner.cluster import Cluster, get_gpu
from sptransform.planner.layout import RUNNABLE_ZERO_STAGES, Layout
from sptransform.planner.presets import ModelShape, get_preset
from sptransform.planner.workload import Workload


@pytest.mark.parametrize("preset, gpus, batch", [("gpt-175b", 64, 64), ("llama3-8b", 8, 32), ("gpt2-medium", 4, 16)])
def test_every_default_proposal_is_accepted_by_parallelize_options(preset, gpus, batch):
    cluster, workload = Cluster(gpu=get_gpu("H100"), num_gpus=gpus), Workload(global_batch=batch, seq_len=1024)
    candidates = plan(get_preset(preset), cluster=cluster, workload=workload).candidates
    assert candidates
    for candidate in candidates:
        options = candidate.layout.parallelize_options()
        ParallelOptions(tp=options["tp"], sp=options["sp"], recompute=options["recompute"], dp=options["dp"],
                        zero=options["zero"])  # validates, as parallelize does
        if options["pp"] > 1:
            PipelineOptions(pp=options["pp"], stages_per_rank=options.get("stages_per_rank"))


def test_every_zero_stage_is_searched_and_runnable():
    assert RUNNABLE_ZERO_STAGES == (0, 1, 2, 3)
    assert SearchSpace().zero_stages == (0, 1, 2, 3)
    for zero in (1, 2):
        layout = Layout(tp=2, pp=1, dp=4, sequence_parallel=True, zero_stage=zero, recompute="none", micro_batch=1)
        assert layout.parallelize_options()["zero"] == zero


def _top_proposals(count: int) -> tuple[ModelShape, list[dict]]:
    """Llama-3-8B on 8 A100-40G, 32 x 2048 tokens: memory-bound, so ZeRO-1 and 2 lead. The first
    ``count`` distinct ``parallelize`` keyword sets (the micro-batch is the training loop's)."""
    shape = get_preset("llama3-8b")
    cluster, workload = Cluster(gpu=get_gpu("A100-40G"), num_gpus=8), Workload(global_batch=32, seq_len=2048)
    proposals: list[dict] = []
    for candidate in plan(shape, cluster=cluster, workload=workload).candidates:
        options = candidate.layout.parallelize_options()
        if options not in proposals:
            proposals.append(options)
    return shape, proposals[:count]


@pytest.mark.slow
@pytest.mark.in_process  # no spawned ranks: runs beside the process tests
def test_the_top_proposals_build_with_parallelize_on_meta_tensors():
    """Each of the planner's top 4 proposals (ZeRO-1 and 2 among them) through ``parallelize``:
    rank 0 of a fake process group of 8, the model built on meta with the preset's shape (its
    layers cut to 2: depth changes no rule for ``pp=1``), parameters DTensors on the
    ``("dp", "tp")`` mesh, ZeRO's 1/dp pieces along their ZeRO dim."""
    transformers = pytest.importorskip("transformers")
    shape, proposals = _top_proposals(4)
    assert {p["zero"] for p in proposals} >= {1, 2}
    assert all(p["pp"] == 1 for p in proposals)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=shape.hidden, num_attention_heads=shape.num_heads,
                                      num_key_value_heads=shape.kv_heads, intermediate_size=shape.ffn,
                                      vocab_size=shape.vocab_size, max_position_embeddings=64)
    ids = torch.zeros(1, 16, dtype=torch.long)
    for options in proposals:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        with fake_group(8):
            pm = sptransform.parallelize(model, **options, example_inputs=dict(input_ids=ids, labels=ids))
            weight = pm.get_parameter("model.layers.0.mlp.up_proj.weight")
            assert weight.shape == (shape.ffn, shape.hidden)
            tp_dims = options["tp"] * (1 if options["zero"] == 0 else options["dp"])
            assert weight.to_local().numel() == shape.ffn * shape.hidden // tp_dims, options


def test_a_layout_maps_to_parallelize_keywords():
    layout = Layout(tp=4, pp=2, dp=2, sequence_parallel=True, zero_stage=3, recompute="selective", micro_batch=2,
                    interleave=2)
    assert layout.parallelize_options() == dict(tp=4, sp=True, pp=2, dp=2, zero=3, recompute="selective",
                                                stages_per_rank=2)
