"""``tools/sweep_tasks.py``: transformers' masked-LM, seq2seq, image-classification and speech
classes and torch's ``nn.Transformer*`` through ``sptransform.verify`` (docs/supported_models.md,
"Beyond causal LMs").

Fast: the family list and the sample rule, the task shrink (image, backbone stages, encoder
sizes), the inputs found by trying on two tiny built models, and the document's table from
synthetic results.

Slow: the script itself on real gloo ranks for torch's encoder and ViT, each column against
what is true today (the encoder equal at both layouts; ViT's 17 tokens refused under SP, equal
without).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "sweep_tasks.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import sweep_tasks as tasks  # noqa: E402

transformers = pytest.importorskip("transformers")


def test_families_list_each_class_once_and_the_sample_is_fixed():
    entries = tasks.families()
    runnable = [e for e in entries if e["run"]]
    classes = [e["class"] for e in runnable]
    assert len(classes) == len(set(classes))  # a class shared by two mappings runs once
    assert {e["model_type"].split(":")[0] for e in runnable} == {*tasks.TASKS, "torch"}
    assert all(e["why"] for e in entries if not e["run"])
    picked = tasks.sample(entries, 2)
    assert picked == tasks.sample(entries, 2)  # seeded: a rerun picks the same families
    for task in tasks.TASKS:
        assert sum(e["model_type"].startswith(task + ":") for e in picked) == 2
    assert {e["model_type"] for e in picked} >= {f"torch:{n}" for n in tasks.TORCH}
    assert {e["model_type"] for e in picked} <= {e["model_type"] for e in tasks.sample(entries, 3)}


def test_task_shrink_images_stages_and_encoders():
    notes: list[str] = []
    vit = tasks.shrink_task_config(transformers.ViTConfig().to_dict(), notes)
    assert (vit["image_size"], vit["patch_size"], vit["encoder_stride"]) == (32, 8, 8)
    swin = tasks.shrink_task_config(transformers.SwinConfig().to_dict(), notes)
    assert swin["depths"] == [1, 1, 1, 1] and swin["window_size"] == 4
    assert "out_features" not in swin  # rederived from the stages by the config
    pvt = tasks.shrink_task_config(transformers.PvtConfig().to_dict(), notes)
    assert all(w % h == 0 for w, h in zip(pvt["hidden_sizes"], pvt["num_attention_heads"]))
    whisper = tasks.shrink_task_config(transformers.WhisperConfig().to_dict(), notes)
    assert (whisper["encoder_attention_heads"], whisper["max_source_positions"], whisper["num_mel_bins"]) == (8, 32, 16)


@pytest.mark.parametrize("key,expected", [("image:vit", "pixel_values"), ("masked:bert", "input_ids, labels")])
def test_inputs_are_found_by_trying_on_one_device(key, expected):
    task, model_type = key.split(":")
    entry = tasks.families([key])[0]
    model, _, _ = tasks.build(task, model_type, entry["class"], tasks.sweep.Target())
    what, inputs = tasks.candidates(task, model)[0]
    assert what.startswith(expected)
    result = tasks.one_device(model, inputs)
    assert result["status"] == "ok" and result["params"] > 0


def _result(key, cls, tp2_sp, tp2, held=0.5):
    def col(status):
        out = {"status": status, "held_share": held if status == "equal" else None, "linears": [3, 4]}
        if status == "refused":
            out["reason"] = "sequence length 17 is not divisible by tp=2; use a multiple"
        return out

    return {"model_type": key, "class": cls, "build": {"status": "ok", "attn": "sdpa"}, "inputs": "x",
            "single": {"status": "ok"}, "tp2_sp": col(tp2_sp), "tp2": col(tp2), "stage": "done"}


def test_table_counts_words_and_held_share_per_task_and_layout(tmp_path):
    results = [_result("image:vit", "ViT", "refused", "equal", 0.6), _result("image:deit", "DeiT", "equal", "equal"),
               _result("masked:bert", "Bert", "equal", "different"),
               {"model_type": "speech:x", "class": "X", "not_run": "same class as seq2seq:x"}]
    t = tasks.totals(results)
    assert t["image"]["tp2_sp"] == {"refused": 1, "equal": 1} and t["image"]["tp2_held"] == [0.5, 0.6]
    assert t["masked"]["tp2"] == {"wrong": 1} and t["speech"]["not_run"] == 1
    meta = {"command": "python tools/sweep_tasks.py", "when": "today", "transformers": "5", "torch": "2",
            "seconds": None, "jobs": 1, "engine": "simulated ranks, float64"}
    text = tasks.render(results, meta)
    assert "| image classification | 2 | 2 | tp=2+SP | **1 / 1 / 0 / 0** | – | 0.50 (0.50–0.50) |" in text
    assert "| | | | tp=2, no SP | **2 / 0 / 0 / 0** | – | 0.55 (0.50–0.60) |" in text
    assert "### Wrong (verify: different)" in text and "| masked:bert | tp=2, no SP |" in text
    assert "stopped before the end" in text and "| speech:x | X | same class as seq2seq:x |" in text
    # --render-from a jsonl: the last line of a model type wins, the last meta is used
    path = tmp_path / "r.jsonl"
    lines = [{"meta": meta}, results[0], {**results[0], "tp2_sp": results[1]["tp2_sp"]}, {"meta": {**meta, "seconds": 9}}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    loaded, loaded_meta = tasks.load(str(path))
    assert [r["tp2_sp"]["status"] for r in loaded] == ["equal"] and loaded_meta["seconds"] == 9


@pytest.mark.slow
def test_script_on_real_ranks(tmp_path):
    jsonl = tmp_path / "r.jsonl"
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, SCRIPT, "--only", "torch:torch_encoder", "image:vit", "--processes",
                    "--jsonl", str(jsonl), "--out", str(tmp_path / "doc.md")], check=True, env=env, timeout=1200)
    results, _ = tasks.load(str(jsonl))
    by = {r["model_type"]: r for r in results}
    enc, vit = by["torch:torch_encoder"], by["image:vit"]
    assert enc["tp2_sp"]["status"] == enc["tp2"]["status"] == "equal"
    assert enc["tp2_sp"]["held_share"] < 0.6 and enc["tp2_sp"]["ranks"] == "processes"
    assert vit["tp2_sp"]["status"] == "refused" and "not divisible" in vit["tp2_sp"]["reason"]
    assert vit["tp2"]["status"] == "equal"
    assert "## Beyond causal LMs" in (tmp_path / "doc.md").read_text()
