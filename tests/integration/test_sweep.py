"""``tools/sweep_transformers.py``: every causal LM of ``transformers``, shrunk from its own config,
through ``sptransform.verify`` (docs/supported_models.md).

Fast: the generic shrink (by field name), the family list, the refusal classes and the
document's format, on configs and synthetic results (no model runs).

Slow: the script itself, one subprocess per family as in the full sweep, on a subset chosen to
cover distinct architectures, compared with ``EXPECTED`` (the current truth; same rules as
``tests/integration/test_zoo.py``: equal must stay equal, refused may become equal, a known-wrong
family must stay wrong in the same rows until it is fixed and flipped to ``equal`` here, and a
family that is wrong without an entry fails).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "sweep_transformers.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import sweep_transformers as sweep  # noqa: E402

transformers = pytest.importorskip("transformers")


def shrink(config_cls, **kwargs):
    notes: list[str] = []
    return sweep.shrink_config(config_cls(**kwargs).to_dict(), sweep.Target(), notes), notes


# -- fast: the shrink ------------------------------------------------------------------------------


def test_shrink_llama_by_field_name():
    d, _ = shrink(transformers.LlamaConfig)
    t = sweep.Target()
    assert (d["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"]) == (2, 64, 8)
    assert d["num_key_value_heads"] == 8  # the default has as many K/V heads as heads: stays multi-head
    assert d["head_dim"] == t.head_dim == 8
    assert (d["intermediate_size"], d["vocab_size"], d["max_position_embeddings"]) == (128, 128, 64)
    assert all(d[k] is None or d[k] < 128 for k in ("bos_token_id", "eos_token_id", "pad_token_id"))


def test_shrink_grouped_kv_heads_and_aliases():
    d, _ = shrink(transformers.MistralConfig)  # 32 heads, 8 K/V heads
    assert (d["num_attention_heads"], d["num_key_value_heads"]) == (8, 4)
    d, _ = shrink(transformers.GPT2Config)
    assert (d["n_layer"], d["n_embd"], d["n_head"], d["n_positions"], d["vocab_size"]) == (2, 64, 8, 64, 128)
    assert d["bos_token_id"] < 128 and d["eos_token_id"] < 128  # 50256 remapped into the vocabulary


def test_shrink_keeps_one_kv_head_multi_query():
    d, notes = shrink(transformers.DbrxConfig)
    assert d["attn_config"]["kv_n_heads"] == 1
    assert any("kv_n_heads=1 kept" in n for n in notes)
    assert d["ffn_config"]["moe_num_experts"] == 4 and d["ffn_config"]["ffn_hidden_size"] == 128


def test_shrink_per_layer_lists_keep_their_variety():
    d, notes = shrink(transformers.Gemma3TextConfig)  # 5 sliding layers, then a full one
    assert d["layer_types"] == ["sliding_attention", "full_attention"]
    assert d["sliding_window"] == 8 < sweep.SEQ  # the window matters at 16 tokens
    assert any("keep layers [0, 5]" in n for n in notes), notes
    d, _ = shrink(transformers.MllamaTextConfig)  # a layer-index list: cross-attention layers 3, 8, ...
    assert d["num_hidden_layers"] == 2 and d["cross_attention_layers"] == [1]


def test_shrink_mixture_of_experts_and_mla():
    d, _ = shrink(transformers.MixtralConfig)
    assert (d["num_local_experts"], d["num_experts_per_tok"]) == (4, 2)
    d, _ = shrink(transformers.DeepseekV3Config)
    assert (d["n_routed_experts"], d["num_experts_per_tok"], d["n_group"], d["topk_group"]) == (4, 2, 2, 1)
    assert d["first_k_dense_replace"] == 1  # layer 0 dense, layer 1 MoE
    assert (d["q_lora_rank"], d["kv_lora_rank"], d["qk_rope_head_dim"], d["qk_nope_head_dim"]) == (32, 32, 8, 8)
    d, notes = shrink(transformers.DeepseekV2Config)  # num_experts_per_tok None by default, needed by the gate
    assert d["num_experts_per_tok"] == 2 and any("num_experts_per_tok None" in n for n in notes)


def test_shrink_ssm_heads_times_head_dim_is_the_inner_width():
    d, _ = shrink(transformers.Mamba2Config)
    assert d["num_heads"] * d["head_dim"] == d["expand"] * d["hidden_size"]
    d, _ = shrink(transformers.BambaConfig)
    assert d["mamba_n_heads"] * d["mamba_d_head"] == d["mamba_expand"] * d["hidden_size"]


def test_every_override_names_a_reason_and_a_real_model_type():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as mapping

    for table in (sweep.FAMILY_OVERRIDES, sweep.FAMILY_SETUP, sweep.NOT_RUN):
        for model_type, value in table.items():
            assert model_type in mapping, model_type
            why = value if isinstance(value, str) else value[1]
            assert isinstance(why, str) and len(why) > 20, model_type


def test_families_cover_the_mapping_once_per_class():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as mapping

    entries = sweep.families()
    assert [e["model_type"] for e in entries] == list(mapping)
    run = [e for e in entries if e["run"]]
    assert len({e["class"] for e in run}) == len(run)  # each class once
    by_type = {e["model_type"]: e for e in entries}
    assert by_type["gpt2"]["run"] and by_type["gpt-sw3"]["why"] == "same class as gpt2"
    assert by_type["llama"]["run"] and not by_type["internlm3"]["run"]
    assert all(e["why"] for e in entries if not e["run"])
    with pytest.raises(SystemExit, match="not a causal-LM model type"):
        sweep.families(["no_such_model"])


def test_reason_class_drops_the_specifics():
    a = ("the linear aten.linear.default (node linear_3) at transformers/models/x/modeling_x.py, line 108, in "
         "forward: return self.wo(output) (parameter 'layers.0.wo.weight') was not recognized as column- or "
         "row-parallel: as a row-parallel linear, aten.stack.default (node stack_1) at transformers/models/x/"
         "modeling_x.py, line 99, in forward: q, k = rope(q, k) cannot run on a split input (no sharding rule for it)")
    b = a.replace("108", "12").replace("wo", "o_proj").replace("stack_1", "stack_7")
    assert sweep.reason_class(a) == sweep.reason_class(b) == (
        "the linear aten.linear.default was not recognized as column- or row-parallel: as a row-parallel linear, "
        "aten.stack.default cannot run on a split input (no sharding rule for it)")
    heads = ("tp=4 does not divide the 4 attention heads / 4 K/V heads of the attention block whose output "
             "projection is 'model.layers.0.self_attn.o_proj.weight' (aten.reshape.default (node reshape_1) at "
             "transformers/models/llama/modeling_llama.py, line 257, in forward: a = f(: reshape (2, 4, 16, 16) "
             "cannot keep dim 1 split over tp=4); use tp in {1, 2}")
    assert sweep.reason_class(heads) == ("tp=N does not divide the N attention heads / N K/V heads of the attention "
                                         "block whose output projection is '…'")


# -- fast: the document --------------------------------------------------------------------------

def _synthetic_results() -> list[dict]:
    ok = {"status": "ok", "loss": 4.8, "params": 10, "numel": 1000, "no_grad": []}
    refused = {"status": "refused", "reason": "sp=True needs an attention to find the sequence dim; none was "
                                              "found: pass sp=False"}
    wrong = {"status": "different", "rows": 40, "worst": 0.96, "failing": [
        {"name": "model.layers.0.input_layernorm.weight", "kind": "grad", "placement": "Replicate()", "rel_error": 0.96},
        {"name": "model.layers.1.input_layernorm.weight", "kind": "grad", "placement": "Replicate()", "rel_error": 0.9}]}
    return [
        {"model_type": "a", "class": "ACausalLM", "build": {"status": "ok", "attn": "sdpa"}, "notes": [],
         "single": ok, "tp2_sp": {"status": "equal", "worst": 1e-7}, "tp4": {"status": "equal", "worst": 1e-7}},
        {"model_type": "b", "class": "BCausalLM", "build": {"status": "ok", "attn": "eager"}, "notes": ["x"],
         "single": ok, "tp2_sp": wrong, "tp4": refused},
        {"model_type": "c", "class": "CCausalLM", "build": {"status": "ok", "attn": "sdpa"}, "notes": [],
         "single": ok, "tp2_sp": refused, "stage": "tp4", "ended": "timeout: still in tp4 after 180 s"},
        {"model_type": "d", "class": "DCausalLM", "build": {"status": "ok", "attn": "sdpa"}, "notes": [],
         "single": {"status": "fail", "reason": "ValueError: needs pixel_values"}},
        {"model_type": "e", "class": "ACausalLM", "not_run": "same class as a"},
    ]


def test_totals_and_table_format(tmp_path):
    results = _synthetic_results()
    t = sweep.totals(results)
    assert (t["model_types"], t["not_run"], t["tried"], t["trains"]) == (5, 1, 4, 3)
    assert t["tp2_sp"] == {"equal": 1, "wrong": 1, "refused": 1}
    assert t["tp4"] == {"equal": 1, "refused": 1, "timeout": 1}
    assert t["tp4_reasons"] == {"sp=True needs an attention to find the sequence dim": 1}
    meta = {"when": "2026-01-01", "transformers": "5", "torch": "2", "seconds": 3.0, "jobs": 1, "target": "tiny"}
    text = sweep.render(results, meta)
    assert "* **tried: 4**; built from the shrunk config: 4; **train on one device: 3**" in text
    assert "* **tp=2+SP**: equal 1, refused 1, wrong 1, error 0, timeout 0, crashed 0" in text
    assert "* **tp=4**: equal 1, refused 1, wrong 0, error 0, timeout 1, crashed 0" in text
    assert "| sp=True needs an attention to find the sequence dim | 1 | 1 |" in text
    assert ("| b | tp=2+SP | 2 of 40 rows off; worst grad of model.layers.0.input_layernorm.weight (Replicate()) "
            "rel error 9.6e-01; grads off: model.layers.N.input_layernorm.weight |") in text
    family_rows = [line for line in text.splitlines() if re.match(r"\| [a-d] \| [A-D]CausalLM \|", line)]
    assert len(family_rows) == 4 and all(line.count(" | ") == 7 for line in family_rows)
    assert "| c | CCausalLM | sdpa |  | trains | refused | timeout |" in text
    assert "| d | DCausalLM | sdpa |  | fails |  |  | ValueError: needs pixel_values |" in text
    assert "| e | ACausalLM | same class as a |" in text
    # the document: each script replaces its own section and keeps the other
    doc = tmp_path / "supported.md"
    sweep.write_section(str(doc), "transformers-sweep", text)
    sweep.write_section(str(doc), "zoo", "## zoo\n")
    sweep.write_section(str(doc), "transformers-sweep", "## again\n")
    body = doc.read_text()
    assert body.startswith("# Supported models") and "## zoo" in body and "## again" in body
    assert "Causal LMs in transformers" not in body and body.count("<!-- BEGIN") == 2


def test_update_rows_replaces_the_families_a_later_sweep_ran_and_recounts_the_totals(tmp_path):
    results = [r for r in _synthetic_results() if r["model_type"] != "b"]  # wrong rows do not read back
    results[0]["tp2_sp"].update(linears=[7, 9], held_share=0.66)
    meta = {"when": "2026-01-01", "transformers": "5", "torch": "2", "seconds": 3.0, "jobs": 1, "target": "tiny"}
    doc = tmp_path / "supported.md"
    sweep.write_section(str(doc), "transformers-sweep", sweep.render(results, meta))
    section = doc.read_text().split("(generated) -->\n", 1)[1].split("<!-- END", 1)[0]
    assert sweep.render(*sweep.results_from_section(section)) == section  # what the rows say reads back whole
    # a later sweep of c (now equal on both) and of a model type the first sweep did not know
    later = [dict(results[1], tp4={"status": "equal", "held_share": 0.5}, stage=None, ended=None),
             dict(results[0], model_type="f", **{"class": "FCausalLM"})]
    later[0]["tp2_sp"] = {"status": "equal", "linears": [3, 4], "held_share": 0.57}
    (tmp_path / "later.json").write_text(json.dumps({"results": later, "meta": dict(meta, when="2026-02-02")}))
    sweep.main(["--update-rows", str(tmp_path / "later.json"), "--out", str(doc)])
    text = doc.read_text()
    assert "| c | CCausalLM | sdpa |  | trains | equal (3/4 linears split, held 0.57) | equal (held 0.50) |  |" in text
    assert "| a | ACausalLM | sdpa |  | trains | equal (7/9 linears split, held 0.66) | equal |  |" in text
    assert "| f | FCausalLM |" in text and "| d | DCausalLM | sdpa |  | fails |  |  | ValueError: needs pixel_values |" in text
    assert "* **tried: 4**" in text and "* **tp=2+SP**: equal 3, refused 0, wrong 0" in text
    assert "Rows of 2 families (c, f) are from a later run" in text and "2026-02-02" in text
    # a second update keeps the first one's sentence beside its own (and its rows)
    again = [dict(results[0], model_type="g", **{"class": "GCausalLM"})]
    (tmp_path / "again.json").write_text(json.dumps({"results": again, "meta": dict(
        meta, when="2026-03-03", engine="real gloo processes, float32")}))
    sweep.main(["--update-rows", str(tmp_path / "again.json"), "--out", str(doc)])
    text = doc.read_text()
    assert "Rows of 2 families (c, f) are from a later run" in text and "2026-02-02" in text
    assert "Rows of 1 families (g) are from a later run" in text and "on real gloo processes, float32" in text
    assert "| f | FCausalLM |" in text and "| g | GCausalLM |" in text and "* **tried: 5**" in text


def test_pipeline_and_recompute_columns_run_on_real_ranks_and_render(monkeypatch, tmp_path):
    # the worker asks verify for the layout of each column, on real processes for pp2/recompute/budget
    # whatever --processes says (simulated ranks run neither pipelining nor AOTAutograd)
    calls = []

    def fake_verify(model, **kwargs):
        calls.append(kwargs)
        import sptransform

        return sptransform.VerifyReport(status="equal", worst=0.0, tp=kwargs["tp"], pp=kwargs["pp"])

    import sptransform

    monkeypatch.setattr(sptransform, "verify", fake_verify)
    result = tmp_path / "r.json"
    engine = sweep.Engine(processes=False, columns=("tp2_sp", "pp2", "recompute", "budget"))
    target = sweep.Target(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=96)
    sweep.worker("llama", "LlamaForCausalLM", target, str(result), engine)
    got = [(c["tp"], c["sp"], c["pp"], c["processes"], c["recompute"], c["compile"]) for c in calls]
    assert got == [(2, True, 1, False, "none", "inductor"), (1, False, 2, True, "none", "inductor"),
                   (2, True, 1, True, "selective", "inductor"), (2, True, 1, True, 0.5, "inductor")]
    saved = json.loads(result.read_text())
    assert [saved[k]["status"] for k in ("tp2_sp", "pp2", "recompute", "budget")] == ["equal"] * 4
    assert sweep.Engine(columns=("pp2", "recompute")).describe() == "real gloo processes, float32"
    assert sweep.Engine(columns=("tp2_sp", "pp2")).describe() == "simulated ranks, float32"

    # one table column per (sweep, column); a family one device could not train shows why
    results = _synthetic_results()
    results[0]["pp2"] = {"status": "equal", "worst": 0.0, "held_share": 0.55}
    results[1]["pp2"] = {"status": "refused", "reason": "pp=2 needs at least 2 transformer layers; the model has 1"}
    results[2]["pp2"] = {"status": "error", "reason": "RuntimeError: boom (x.py:1)"}
    f64 = [dict(r, pp2={"status": "equal", "worst": 0.0}) if "single" in r and r["single"]["status"] == "ok"
           else r for r in results]
    meta32 = {"when": "2026-01-01", "transformers": "5", "torch": "2", "seconds": 9.0, "jobs": 1,
              "engine": "real gloo processes, float32", "columns": ["pp2"]}
    runs = [{"key": "pp2", "results": results, "meta": meta32},
            {"key": "pp2", "results": f64, "meta": dict(meta32, engine="real gloo processes, float64")}]
    text = sweep.render_layouts(runs)
    assert "* **pp=2, float32**: equal 1, refused 1, wrong 0, error 1, timeout 0, crashed 0 (of 4 tried, 3 train" in text
    assert "* **pp=2, float64**: equal 3, refused 0, wrong 0, error 0" in text
    assert "| family | pp=2, float32 | pp=2, float64 | reason |" in text
    assert "| a | equal (held 0.55) | equal |  |" in text
    assert ("| b | refused | equal | pp=2, float32: pp=2 needs at least 2 transformer layers; the model has 1 |"
            in text)
    assert "| d | – | – | pp=2, float32: one device: ValueError: needs pixel_values |" in text
    assert "| e |" not in text  # not run: listed in the section below, not here
    doc = tmp_path / "supported.md"
    for path, run in (("a.json", runs[0]), ("b.json", runs[1])):
        (tmp_path / path).write_text(json.dumps({"results": run["results"], "meta": run["meta"]}))
    sweep.main(["--render-layouts", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(doc)])
    assert "<!-- BEGIN transformers-layouts (generated) -->\n## Pipeline stages and recompute" in doc.read_text()
    # verify's own time limit on its processes is a timeout, not an error of sptransform
    def slow_verify(model, **kwargs):
        raise TimeoutError("the verification did not finish within timeout_s=600 s")

    monkeypatch.setattr(sptransform, "verify", slow_verify)
    got = sweep.run_verify(None, {}, tp=2, sp=True, processes=True, recompute="selective")
    assert got["status"] == "timeout" and "timeout_s=600" in got["reason"]
    assert sweep.outcome({"recompute": got}, "recompute")[0] == "timeout"
    # one family a sweep, merged into one run
    for r in results[:2]:
        (tmp_path / f"{r['model_type']}.json").write_text(json.dumps({"results": [r], "meta": meta32}))
    merged = tmp_path / "merged.json"
    sweep.main(["--merge-json", str(merged), str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    saved = json.loads(merged.read_text())
    assert [r["model_type"] for r in saved["results"]] == ["a", "b"] and saved["meta"]["seconds"] == 18.0
    assert saved["totals"]["pp2"] == {"equal": 1, "refused": 1}
    with pytest.raises(SystemExit, match="a in several"):
        sweep.main(["--merge-json", str(merged), str(tmp_path / "a.json"), str(tmp_path / "a.json")])


# -- slow: the script on a subset --------------------------------------------------------------------

EQUAL = "equal"
SUBSET: dict[str, tuple] = {
    # model type: (tp=2 with SP, tp=4 without SP); a str is the status, a (status, regex) pair is
    # "wrong in exactly the rows whose names match"
    "gpt2": (EQUAL, EQUAL),                          # fused Conv1D QKV, learned positions, tied head
    "llama": (EQUAL, EQUAL),                         # RoPE, GQA, SwiGLU
    "gemma": (EQUAL, EQUAL),                         # x * (1 + weight) norm (was wrong: gradient unsummed under SP)
    "opt": (EQUAL, EQUAL),                           # MLP on [b*s, h] (was refused), padding_idx embedding
    "bart": (EQUAL, EQUAL),                          # decoder of an encoder-decoder (cross-attention unused)
    "gpt_neox": (EQUAL, EQUAL),                      # partial rotary, parallel residual, per-head fused QKV
    "bloom": ("refused", "refused"),                 # ALiBi built from an attention mask
    "mixtral": (EQUAL, EQUAL),                       # MoE: grouped_mm experts split per expert (was refused:
    #   data-dependent routing, before transformers' grouped_mm path)
    "falcon": (EQUAL, EQUAL),                        # multi-query fused QKV: attention replicated, MLP split
    "mamba": ("refused", "refused"),                 # SSM, no attention
    "qwen3": (EQUAL, EQUAL),                         # per-head q/k norms (weight * x)
    "gemma3_text": (EQUAL, EQUAL),                   # per-head q/k norms written x * (1 + weight) over
    #   head-split activations (was wrong: their weight gradients were each rank's share)
}


@pytest.mark.slow
def test_sweep_script_on_a_subset_matches_expectations(tmp_path):
    out_json, out_md = tmp_path / "results.json", tmp_path / "supported.md"
    proc = subprocess.run([sys.executable, SCRIPT, "--only", *SUBSET, "--json", str(out_json), "--out", str(out_md),
                           "--timeout", "150", "--jobs", "2"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(out_json.read_text())
    results = {r["model_type"]: r for r in saved["results"]}
    assert set(results) == set(SUBSET)
    problems = []
    for model_type, expected in SUBSET.items():
        r = results[model_type]
        if sweep.single_outcome(r)[0] != "trains":
            problems.append(f"{model_type}: does not train on one device: {sweep.single_outcome(r)}")
            continue
        for (key, title), want in zip(sweep.COLUMNS, expected):
            word, reason = sweep.outcome(r, key)
            want_word, rows = (want, None) if isinstance(want, str) else want
            if word == "wrong" and want_word != "wrong":
                problems.append(f"{model_type} {title}: WRONG, not in the expectation table: {reason}")
            elif want_word == "wrong":
                off = [row["name"] for row in r[key].get("failing", [])] if word == "wrong" else []
                if word == "equal":
                    problems.append(f"{model_type} {title}: known wrong is now equal: flip SUBSET to equal")
                elif word != "wrong" or not off or not all(re.fullmatch(rows, n) for n in off):
                    problems.append(f"{model_type} {title}: expected wrong in {rows}, got {word}: {reason}")
            elif want_word == EQUAL and word != "equal":
                problems.append(f"{model_type} {title}: expected equal, got {word}: {reason}")
            elif want_word == "refused" and word not in ("refused", "equal"):
                problems.append(f"{model_type} {title}: expected refused or better, got {word}: {reason}")
    table = "\n".join(line for line in out_md.read_text().splitlines() if line.startswith(("* ", "| ")))
    assert not problems, "\n".join(problems) + "\n\n" + table
    # the generated section: totals that add up to the table below them
    t = sweep.totals(saved["results"])
    text = out_md.read_text()
    assert f"* **tried: {len(SUBSET)}**" in text and f"**train on one device: {t['trains']}**" in text
    for key, title in [(k, title) for k, title in sweep.COLUMNS if k in sweep.Engine().columns]:  # the default run's
        counts = t[key]
        assert sum(counts.values()) == len(SUBSET)
        assert f"* **{title}**: equal {counts.get('equal', 0)}, refused {counts.get('refused', 0)}, " \
               f"wrong {counts.get('wrong', 0)}" in text
    assert text.count("\n| ") >= len(SUBSET) + 2
