"""Mamba-2 mixers split over real gloo ranks.

A Mamba-2 mixer makes its gate, the convolution's input (x, B and C) and the step sizes in one
``in_proj``, takes the output apart, convolves x, B and C together per channel, and takes that
apart again; B and C have one group for all heads. The walk back from ``out_proj`` also met the
gated RMSNorm's mean square over all the mixer's channels and stopped there, so the mixer ran
whole (HF granitemoehybrid held 0.60 of the parameter bytes per rank at tp=2 + SP, nemotron_h 0.65,
bamba 0.73). Now the projection becomes one linear per piece, through the convolution (its filters
sliced per piece: ``passes.unfuse``): the gate, x and step-size pieces are column-parallel, B and C
read whole; the norm's statistic is a partial sum (``graph.walk``). ``in_proj``'s step-size rows
(one per head) and its x rows (a head's channels) admit no equal segments that DTensor could
store split (``graph.strided_storage``): it is stored in 1/tp contiguous pieces, all-gathered
where the mixer reads it, its gradient reduce-scattered (``passes.shard_whole``; before, stored
whole on every rank: ssd_mixer 0.630, nemotron_h 0.608, bamba 0.663).

Cases: the zoo's ``ssd_mixer`` (float64), HF granitemoehybrid, nemotron_h and bamba (float32, as
the sweep shrinks them), tp=2 with SP: loss and every gradient at 3 AdamW steps, and the
parameters after two. One spawn of 2 ranks."""

from __future__ import annotations

import pytest

from torch.distributed.tensor import DTensor, Shard

from gloo_cases import model_for, split_on_simulated_ranks, train_cases
from simulate import simulated_ranks, spawn_with_deadline

CASES = (  # (model, sp, the share of the parameter bytes a rank may hold at tp=2)
    ("ssd_mixer", True, 0.51),  # 0.508 (0.683 with the mixer whole, 0.630 with in_proj stored whole)
    ("granitemoehybrid", False, 0.51),  # 0.504 (0.601 with the mixer whole, 0.571 with in_proj stored whole)
    ("nemotron_h", True, 0.51),  # 0.507 (0.652, then 0.608)
    ("bamba", True, 0.51),  # 0.508 (0.731, then 0.663)
)


@pytest.mark.slow
def test_mamba2_mixers_train_like_the_original_on_gloo():
    spawn_with_deadline(train_cases, 2, 600.0, CASES)


def test_mamba2_mixer_is_one_block_with_its_in_proj_pieces_as_columns_on_simulated_ranks():
    """Every linear split (17 of 17: in_proj counts as its five pieces), float64 equal at tp=2 +
    SP; the mixer's block has the gate, x and step-size pieces as columns, and the head stays the
    vocabulary-parallel head (the walk from it through the final norm loses to the layers' blocks)."""
    split_on_simulated_ranks("ssd_mixer", 0.51, (17, 17))
    import sptransform

    model, batch, _ = model_for("ssd_mixer")
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, sp=True, example_inputs=batch)
        text = pm.explain()
        placements = {name: p.placements[0] for name, p in pm.named_parameters() if isinstance(p, DTensor)}
    mixer = next(line for line in text.splitlines() if "-> row mixers.0.out_proj.weight" in line)
    assert mixer.count("mixers.0.in_proj.weight[") == 3, mixer  # gate, x, step sizes
    assert "head lm_head.weight (vocab-parallel)" in text, text
    assert placements["lm_head.weight"] == Shard(0) and placements["mixers.0.out_proj.weight"] == Shard(1), placements
