"""Tensor parallelism of experts that run on the rows the routing picks for them: Mixtral's
reference loop, each expert its own ``nn.Linear`` modules, ``torch.where`` for its rows (a count
known only at run time, ``u0``), ``index_add`` back (``tests/models/routed.py``,
``dispatch="loop"``), or the same loop over 3-D parameters, expert ``e``'s weight their slice
``W[e]`` (``"loop_stacked"``, JetMoE-style storage). What decides the routing runs whole on every rank; each expert's linears
are split like a dense MLP (up column-wise, down row-wise) along their features, never the rows.

Drawn by hypothesis (router, gating, biases, where the routing weight is applied, in- or
out-of-place ``index_add``, a shared expert, top-1 or top-2 of 2 to 4 experts), checked with
``sptransform.verify`` at tp=2 in float64: the loss, every gradient and the parameters after 2
steps. The fast lane runs them on simulated ranks; real gloo processes run a seeded sample of
the same draws (slow lane), since simulated ranks are not the program users run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.routed import RoutedConfig, RoutedLM

BATCH, SEQ = 2, 8

CONFIGS = st.builds(
    RoutedConfig,
    dispatch=st.sampled_from(["loop", "loop_stacked", "split"]),
    layout=st.sampled_from(["out_in", "in_out"]),
    experts=st.sampled_from([2, 3, 4]),
    top_k=st.sampled_from([1, 2]),
    inner=st.sampled_from([8, 24]),
    router=st.sampled_from(["softmax_topk", "topk_softmax", "sigmoid"]),
    gated=st.booleans(),
    bias=st.booleans(),
    weights_before=st.booleans(),
    combine=st.sampled_from(["index_add", "index_add_"]),
    shared=st.booleans(),
)


def _check(config: RoutedConfig, *, processes: bool) -> None:
    import sptransform

    torch.manual_seed(0)
    model = RoutedLM(config).double()
    ids = torch.randint(0, config.vocab, (BATCH, SEQ))
    report = sptransform.verify(model, tp=2, sp=False, example_inputs=(ids, ids), steps=2, rtol=1e-9,
                                processes=processes, timeout_s=300)  # (no attention: no SP)
    assert report.status == "equal", f"{config}\n{report}"
    experts = [r for r in report.rows if r.kind.startswith("param")
               and (".experts." in r.name and r.name.endswith("weight") or r.name.endswith((".up", ".down")))]
    assert experts and all("Shard" in r.placement for r in experts), f"{config}\n{report}"
    # every expert weight split: what stays whole is the router, the norms, the row biases
    assert report.held_share < 0.56, f"{config}: held {report.held_share}\n{report}"


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(config=CONFIGS)
def test_experts_on_routed_rows_are_split_and_equal_on_simulated_ranks(config):
    _check(config, processes=False)


@pytest.mark.slow
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(config=CONFIGS)
def test_experts_on_routed_rows_are_split_and_equal_on_gloo(config):
    _check(config, processes=True)
