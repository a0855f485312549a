"""``sptransform plan`` and ``sptransform flops``: the worked example, the outputs, and bad input."""

import json
import subprocess
import sys

import pytest

from sptransform import cli

GPT3_ON_64_A100 = ["plan", "--model", "gpt-175b", "--gpu", "A100-80G", "--gpus", "64", "--global-batch", "64",
                   "--interleave", "1", "3"]


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_subcommands_are_registered_from_one_list():
    parser = cli.build_parser()
    names = set(parser._subparsers._group_actions[0].choices)
    assert {"plan", "flops"} <= names
    assert len(cli.SUBCOMMANDS) == len(names)


def test_worked_example_lists_fitting_layouts_by_throughput_including_the_papers(capsys):
    code, out, _ = run([*GPT3_ON_64_A100, "--json", "--top", "1000"], capsys)
    assert code == 0
    result = json.loads(out)
    layouts = result["layouts"]
    assert result["fitting_layouts"] == len(layouts) > 0
    speeds = [entry["utilization"]["tokens_per_s"] for entry in layouts]
    assert speeds == sorted(speeds, reverse=True)
    limit = result["assumptions"]["memory_limit_bytes"]
    assert all(max(stage["total"] for stage in entry["memory_bytes"].values()) <= limit for entry in layouts)
    paper = [entry for entry in layouts if entry["label"] == "tp8 pp8 dp1 sp z0 sel mb1 m3"]
    assert paper, "the paper's own GPT-3 layout (Table 3) must fit"
    assert 0.40 < paper[0]["utilization"]["mfu"] < 0.60


def test_table_output_names_buckets_and_says_what_eq8_overcounts(capsys, tmp_path):
    plot = tmp_path / "budget.png"
    code, out, _ = run([*GPT3_ON_64_A100, "--top", "5", "--plot", str(plot)], capsys)
    assert code == 0
    for word in ("weights", "grads", "optim", "EMA", "activ.", "emb+head", "MFU", "HFU eq.8", "three times"):
        assert word in out
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_measured_iteration_time_reproduces_table5_for_gpt3(capsys):
    code, out, _ = run(["plan", "--model", "gpt-175b", "--gpus", "64", "--global-batch", "64",
                        "--recompute", "selective", "--iteration-time", "13.75"], capsys)
    assert code == 0
    assert "51.39%" in out and "52.77%" in out and "51.85%" in out
    assert "three times" in out


def test_deepseek_chapter_scenario_prints_33_6_and_26_1(capsys, tmp_path):
    code, out, _ = run(["plan", "--scenario", "deepseek-v3-chapter", "--json"], capsys)
    assert code == 0
    ours = json.loads(out)["ours"]
    assert (ours["before"]["total"], ours["after"]["total"]) == (33.6, 26.1)
    code, out, _ = run(["plan", "--scenario", "deepseek-v3-chapter", "--plot", str(tmp_path / "ds.png")], capsys)
    assert "33.6" in out and "26.1" in out and (tmp_path / "ds.png").exists()


def test_flops_prints_the_tutorial_numbers(capsys):
    code, out, _ = run(["flops", "--model", "gpt-13b", "--seq-len", "4096", "--heads-as-one"], capsys)
    assert code == 0
    assert "2753.1842" in out and "0.6722" in out and "compute" in out and "memory" in out
    code, out, _ = run(["flops", "--model", "gpt-1.3b", "--seq-len", "4096", "--mode", "decode", "--json"], capsys)
    rows = json.loads(out)["decode"]
    assert {row["bound"] for row in rows} == {"memory"}


@pytest.mark.parametrize("argv,message", [
    (["--tp", "3"], "world size num_gpus=64 is not divisible by tp x pp = 3 x 1 = 3"),
    (["--tp", "8", "--pp", "7"], "num_gpus=64 is not divisible by tp x pp = 8 x 7 = 56"),
    (["--pp", "64"], "pp x interleave = 64 x 1 = 64 does not divide num_layers=96"),
    (["--micro-batch", "3", "--pp", "8", "--tp", "8"], "global_batch=64 is not divisible by dp x micro_batch"),
])
def test_bad_layouts_fail_with_value_rule_and_fix(capsys, argv, message):
    code, _, err = run([*GPT3_ON_64_A100[:-3], *argv], capsys)
    assert code == 2
    assert message in err and "use" in err


def test_heads_that_tp_cannot_split_are_named(capsys):
    code, _, err = run(["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--tp", "8"], capsys)
    assert code == 2
    assert "tp=8 does not divide num_heads=12" in err and "use tp in [1, 2, 4]" in err


@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "gpt-9000", "--global-batch", "8"], "unknown model 'gpt-9000'"),
    (["plan", "--model", "gpt2", "--gpu", "V100", "--global-batch", "8"], "unknown GPU 'V100'"),
    (["flops", "--model", "gpt2", "--gpu", "TPU"], "unknown GPU 'TPU'"),
    (["plan", "--model", "gpt2"], "plan needs --global-batch"),
    (["plan", "--model", "gpt2", "--gpus", "12", "--global-batch", "8"], "--gpus 12 is not a whole number of nodes"),
])
def test_unknown_names_and_missing_values_fail_clearly(capsys, argv, message):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err


def test_config_without_a_needed_field_names_the_field(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}))
    code, _, err = run(["plan", "--model", str(config), "--global-batch", "8"], capsys)
    assert code == 2
    assert "hidden_size" in err and "add one of them" in err


def test_hf_config_plans_like_a_preset(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
        "intermediate_size": 688, "vocab_size": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": False}))
    code, out, _ = run(["plan", "--model", str(config), "--gpus", "2", "--global-batch", "4", "--json"], capsys)
    assert code == 0 and json.loads(out)["fitting_layouts"] > 0


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "sptransform", "flops", "--model", "gpt2", "--mode", "decode"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "fc1" in done.stdout


def test_tables_print_as_plain_text_without_rich(monkeypatch, capsys):
    import builtins

    from sptransform.planner.tables import TextTable, print_table

    real_import = builtins.__import__

    def no_rich(name, *args, **kwargs):
        if name.startswith("rich"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_rich)
    print_table(TextTable(title="t", columns=("op", "FLOPs"), rows=(("fc1", "12"), ("fc2", "3")), notes=("n",)))
    assert capsys.readouterr().out.splitlines() == ["t", "op   FLOPs", "fc1     12", "fc2      3", "n"]


def test_plot_into_a_missing_folder_says_so(capsys, tmp_path):
    code, _, err = run(["plan", "--scenario", "deepseek-v3-chapter", "--plot", str(tmp_path / "no" / "x.png")], capsys)
    assert code == 2 and "existing, writable folder" in err


@pytest.mark.parametrize("top", [5, 20])
def test_plot_labels_do_not_overlap(top, monkeypatch, capsys):
    """``plan --plot``'s figure: every layout's label, the title, the axis label and the legend
    entries are drawn inside the figure and no two text boxes intersect (issue 19 item 7: slanted
    labels under vertical bars ran into each other)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from sptransform.planner import report
    from sptransform.planner.tables import stacked_bars_figure

    seen = {}
    monkeypatch.setattr(report, "plot_stacked_bars", lambda bars, **kw: seen.update(bars=bars, **kw))
    assert cli.main([*GPT3_ON_64_A100, "--top", str(top), "--plot", "unused.png"]) == 0
    bars = seen.pop("bars")
    assert len(bars) == top
    seen.pop("path")
    figure = stacked_bars_figure(bars, **seen)
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        axes = figure.axes[0]
        texts = [t for t in axes.get_yticklabels() if t.get_text()]
        assert sorted(t.get_text() for t in texts) == sorted(label for label, _ in bars)
        texts += [axes.title, axes.xaxis.label, *figure.legends[0].get_texts()]
        boxes = [t.get_window_extent(renderer) for t in texts]
        whole = figure.bbox
        for text, box in zip(texts, boxes):
            assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, \
                f"{text.get_text()!r} is drawn outside the figure"
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                assert not boxes[i].overlaps(boxes[j]), f"{texts[i].get_text()!r} overlaps {texts[j].get_text()!r}"
    finally:
        plt.close(figure)
