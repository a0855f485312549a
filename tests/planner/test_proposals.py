"""The planner proposes only what ``parallelize`` runs (issue: it ranked ZeRO-1 first, which
``parallelize`` refused)."""

from __future__ import annotations

import pytest

from sptransform.options import ParallelOptions, PipelineOptions
from sptransform.planner import SearchSpace, plan
from sptransform.planner.cluster import Cluster, get_gpu
from sptransform.planner.layout import Layout
from sptransform.planner.presets import get_preset
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


def test_stages_1_and_2_are_searched_only_when_asked_and_say_they_cannot_run():
    shape = get_preset("llama3-8b")
    cluster, workload = Cluster(gpu=get_gpu("H100"), num_gpus=8), Workload(global_batch=32, seq_len=2048)
    default = {c.layout.zero_stage for c in plan(shape, cluster=cluster, workload=workload).candidates}
    assert default <= {0, 3}
    asked = plan(shape, cluster=cluster, workload=workload, space=SearchSpace(zero_stages=(1,))).candidates
    assert {c.layout.zero_stage for c in asked} == {0, 1}  # 0 where dp=1: nothing to shard over
    stage_1 = next(c.layout for c in asked if c.layout.zero_stage == 1)
    with pytest.raises(ValueError, match=r"zero_stage=1: parallelize runs ZeRO stages \(0, 3\)"):
        stage_1.parallelize_options()


def test_a_layout_maps_to_parallelize_keywords():
    layout = Layout(tp=4, pp=2, dp=2, sequence_parallel=True, zero_stage=3, recompute="selective", micro_batch=2,
                    interleave=2)
    assert layout.parallelize_options() == dict(tp=4, sp=True, pp=2, dp=2, zero=3, recompute="selective",
                                                stages_per_rank=2)
