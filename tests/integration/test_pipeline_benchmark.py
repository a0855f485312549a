"""The pipeline benchmark runs end to end at a tiny size and prints the common table: both sides
start at the single-device loss, sptransform ends at it too and keeps its tied copies equal;
torch's untied copies drift."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE_COLUMNS = ("side", "first loss", "last loss", "median s", "min s", "max s", "/ anchor", "collectives", "waits",
                 "fill_", "peak MiB")


@pytest.mark.slow
def test_sptransform_vs_torch_pipeline(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "pp_vs_torch_pipeline.py"), "--layers", "2", "--hidden", "64",
         "--heads", "4", "--vocab", "512", "--seq", "32", "--batch", "4", "--microbatches", "2", "--steps", "2",
         "--warmup", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["side"]: r for r in result["results"]}
    assert set(rows) == {"sptransform", "torch pipeline()"}, rows
    header = next(line for line in proc.stdout.splitlines() if line.startswith("side "))
    assert header.split("  ") and all(column in header for column in TABLE_COLUMNS), header
    for row in rows.values():
        assert "error" not in row, row
        assert row["first_loss"] == pytest.approx(result["single_device_loss"], rel=1e-5)
        assert row["step_s_min"] <= row["step_s"] <= row["step_s_max"] and len(row["step_s_all"]) == 2
        assert all(b > 0 for b in row["peak_activation_bytes"])
        assert row["profiled"]["collectives"] > 0  # the stages' sends and receives
    assert rows["sptransform"]["last_loss"] == pytest.approx(result["single_device_last_loss"], rel=1e-5)
    assert rows["sptransform"]["tied_max_difference"] == 0
    assert rows["torch pipeline()"]["tied_max_difference"] > 0
    assert "tied copies after 4 steps" in proc.stdout
