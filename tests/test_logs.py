"""INFO lines per phase (issue 19 item 6): one per capture, transform and parallelize, each with
what was done and how long it took; records of ranks other than 0 are dropped by default."""

from __future__ import annotations

import io
import logging
import re
import sys

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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_show_on_rank_zero_at_a_terminal_only(monkeypatch):
    from sptransform import logs

    pytest.importorskip("tqdm")
    for rank, terminal, shown in ((0, True, True), (0, False, False), (1, True, False)):
        err = _Terminal() if terminal else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        monkeypatch.setattr(logs, "_rank", lambda: rank)
        assert list(logs.progress(range(3), desc="counting")) == [0, 1, 2]
        with logs.phases(("first", "second"), desc="phasing") as begin:
            begin("first")
            begin("second")
        text = err.getvalue()
        assert ("counting" in text and "/3 [" in text and "phasing" in text and "second]" in text) == shown, text


def test_load_hf_weights_shows_its_progress(monkeypatch, tmp_path):
    from sptransform.runtime import checkpoint

    pytest.importorskip("tqdm")
    source = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                  n_positions=8))
    source.save_pretrained(tmp_path)
    target = transformers.GPT2LMHeadModel(source.config)
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(checkpoint, "LOAD_PIECE", 4)
    sptransform.load_hf_weights(target, tmp_path)
    pieces = re.search(r"load_hf_weights:.*? 0/(\d+) \[", err.getvalue())
    assert pieces and int(pieces.group(1)) > 1, err.getvalue()  # several dcp.load calls, each a step
    for name, p in source.state_dict().items():
        assert torch.equal(p, target.state_dict()[name]), name


def test_verify_shows_its_phases(monkeypatch):
    pytest.importorskip("tqdm")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                 n_positions=16)).eval()
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    report = sptransform.verify(model, tp=2, processes=False)
    assert report.ok, report
    assert "verify:" in err.getvalue() and "comparison]" in err.getvalue(), err.getvalue()
