"""INFO lines per phase (issue 19 item 6): one per capture, transform and parallelize, each with
what was done and how long it took; records of ranks other than 0 are dropped by default."""

from __future__ import annotations

import logging

import pytest
import torch

import sptransform
from simulate import simulated_ranks

transformers = pytest.importorskip("transformers")


def test_parallelize_logs_each_phase(caplog):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                                                 n_positions=16))
    ids = torch.randint(0, 64, (2, 8))
    with caplog.at_level(logging.INFO, logger="sptransform"), simulated_ranks(2):
        sptransform.parallelize(model, tp=2, example_inputs=(ids,))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("sptransform")]
    assert any(line.startswith("captured GPT2LMHeadModel: ") and " s" in line for line in lines), lines
    transformed = [line for line in lines if line.startswith("transformed for tp=2 sp=True dp=1")]
    assert transformed and "5 of 5 linears split" in transformed[0] and "all-reduce" in transformed[0], lines
    done = [line for line in lines if line.startswith("parallelize(GPT2LMHeadModel): tp=2")]
    assert done and "holds 0.5" in done[0], lines  # about half the bytes at tp=2


def test_only_rank_zero_logs_by_default(monkeypatch):
    from sptransform import logs

    record = logging.LogRecord("sptransform.x", logging.INFO, __file__, 1, "m", (), None)
    log = logs.logger("sptransform.test_logs")
    assert logs._FILTER in log.filters
    monkeypatch.setattr(logs, "_rank", lambda: 1)
    assert not logs._FILTER.filter(record)
    monkeypatch.setenv("SPTRANSFORM_LOG_ALL_RANKS", "1")
    assert logs._FILTER.filter(record)
    monkeypatch.setattr(logs, "_rank", lambda: 0)
    monkeypatch.delenv("SPTRANSFORM_LOG_ALL_RANKS")
    assert logs._FILTER.filter(record)
