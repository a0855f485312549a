"""Bad calls of every subcommand: one ``sptransform <command>: error:`` line naming the flag or
config field at fault, exit code 2, never a traceback, never exit 0; and the largest accepted
enumerations answer in seconds.

Each row of ``BAD_CALLS`` is (argv, what the error line must name). ``@name`` in an argv is the
path of the config file ``CONFIGS[name]`` (written to a temporary folder); ``@folder`` is a folder
without a config.json, ``@missing`` a config.json that does not exist.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from sptransform import cli

GPT2 = ["--model", "gpt2", "--global-batch", "8"]
PLAN = ["plan", *GPT2]

VALID = {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
CONFIGS = {
    "n_head_zero": {**VALID, "n_head": 0},
    "n_layer_null": {**VALID, "n_layer": None},
    "hidden_negative": {**VALID, "n_embd": -64},
    "layers_negative": {**VALID, "n_layer": -4},
    "hidden_string": {**VALID, "n_embd": "64"},
    "hidden_float": {**VALID, "n_embd": 64.5},
    "layers_bool": {**VALID, "n_layer": True},
    "hidden_missing": {k: v for k, v in VALID.items() if k != "n_embd"},
    "heads_missing": {k: v for k, v in VALID.items() if k != "n_head"},
    "heads_5_of_64": {**VALID, "n_head": 5},
    "kv_3_of_4": {**VALID, "num_key_value_heads": 3},
    "kv_zero": {**VALID, "num_key_value_heads": 0},
    "kv_above_heads": {**VALID, "num_key_value_heads": 8},
    "ffn_negative": {**VALID, "n_inner": -1},
    "vocab_zero": {**VALID, "vocab_size": 0},
    "vocab_null": {**VALID, "vocab_size": "many"},
    "positions_string": {**VALID, "n_positions": "128"},
    "dropout_2": {**VALID, "attn_pdrop": 2.0},
    "tied_string": {**VALID, "tie_word_embeddings": "yes"},
    "hidden_huge": {**VALID, "n_embd": 2**40, "n_head": 2**20},
    "rope_odd_head": {"num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 32,
                      "intermediate_size": 256, "rope_theta": 10000.0},
    "llama_heads_0": {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 0,
                      "intermediate_size": 688, "rope_theta": 10000.0},
    # models a dense ModelShape would count wrong: refused, not planned as if dense
    "routed_experts": {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                       "intermediate_size": 688, "rope_theta": 10000.0, "num_local_experts": 8},
    "latent_attention": {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                         "intermediate_size": 688, "rope_theta": 10000.0, "kv_lora_rank": 64},
}
RAW_FILES = {
    "malformed": '{"n_layer": 4, "n_embd": 64,',
    "empty": "",
    "a_list": "[1, 2, 3]",
    "a_number": "42",
}
CONFIG_FIELDS = {  # what the error about each config names
    "n_head_zero": "n_head", "n_layer_null": "n_layer", "hidden_negative": "n_embd", "layers_negative": "n_layer",
    "hidden_string": "n_embd", "hidden_float": "n_embd", "layers_bool": "n_layer", "hidden_missing": "n_embd",
    "heads_missing": "n_head", "heads_5_of_64": "n_head", "kv_3_of_4": "num_key_value_heads",
    "kv_zero": "num_key_value_heads", "kv_above_heads": "num_key_value_heads", "ffn_negative": "n_inner",
    "vocab_zero": "vocab_size", "vocab_null": "vocab_size", "positions_string": "n_positions",
    "dropout_2": "attn_pdrop", "tied_string": "tie_word_embeddings", "hidden_huge": "n_embd",
    "rope_odd_head": "num_attention_heads", "llama_heads_0": "num_attention_heads",
    "routed_experts": "num_local_experts", "latent_attention": "kv_lora_rank",
    "malformed": "not valid JSON", "empty": "not valid JSON", "a_list": "not an object", "a_number": "not an object",
}

BAD_CALLS = [
    # -- plan: counts ------------------------------------------------------------------------
    (["plan", *GPT2, "--tp", "0"], "--tp"),
    (["plan", *GPT2, "--tp", "-2"], "--tp"),
    (["plan", *GPT2, "--tp", "2.5"], "--tp"),
    (["plan", *GPT2, "--tp", "two"], "--tp"),
    (["plan", *GPT2, "--tp", "2", "0"], "--tp"),
    (["plan", *GPT2, "--pp", "0"], "--pp"),
    (["plan", *GPT2, "--pp", "-1"], "--pp"),
    (["plan", *GPT2, "--gpus", "0"], "--gpus"),
    (["plan", *GPT2, "--gpus", "-8"], "--gpus"),
    (["plan", *GPT2, "--gpus", "1000000000000"], "--gpus"),
    (["plan", *GPT2, "--gpus", "1e12"], "--gpus"),
    (["plan", *GPT2, "--gpus", "1" + "0" * 5000], "--gpus"),
    (["plan", *GPT2, "--gpus", "12"], "--gpus"),
    (["plan", *GPT2, "--gpus-per-node", "0"], "--gpus-per-node"),
    (["plan", "--model", "gpt2", "--global-batch", "0"], "--global-batch"),
    (["plan", "--model", "gpt2", "--global-batch", "-4"], "--global-batch"),
    (["plan", "--model", "gpt2", "--global-batch", "100000000"], "--global-batch"),
    (["plan", *GPT2, "--seq-len", "0"], "--seq-len"),
    (["plan", *GPT2, "--seq-len", "-16"], "--seq-len"),
    (["plan", *GPT2, "--micro-batch", "0"], "--micro-batch"),
    (["plan", *GPT2, "--interleave", "0"], "--interleave"),
    (["plan", *GPT2, "--zero", "5"], "--zero"),
    (["plan", *GPT2, "--top", "0"], "--top"),
    (["plan", *GPT2, "--top", "-1"], "--top"),
    # -- plan: floats and ranges -------------------------------------------------------------
    (["plan", *GPT2, "--reserve-gib", "-5"], "--reserve-gib"),
    (["plan", *GPT2, "--reserve-gib", "nan"], "--reserve-gib"),
    (["plan", *GPT2, "--reserve-gib", "80"], "--reserve-gib"),
    (["plan", *GPT2, "--achieved", "0"], "--achieved"),
    (["plan", *GPT2, "--achieved", "1.5"], "--achieved"),
    (["plan", *GPT2, "--achieved", "55"], "--achieved"),
    (["plan", *GPT2, "--achieved", "nan"], "--achieved"),
    (["plan", *GPT2, "--achieved", "inf"], "--achieved"),
    (["plan", *GPT2, "--grad-bytes", "-1"], "--grad-bytes"),
    (["plan", *GPT2, "--optimizer-bytes", "nan"], "--optimizer-bytes"),
    (["plan", *GPT2, "--gpu-memory-gib", "0"], "--gpu-memory-gib"),
    (["plan", *GPT2, "--gpu-memory-gib", "-80"], "--gpu-memory-gib"),
    (["plan", *GPT2, "--gpu-memory-gib", "1e300"], "--gpu-memory-gib"),
    (["plan", *GPT2, "--peak-tflops", "inf"], "--peak-tflops"),
    (["plan", *GPT2, "--iteration-time", "0", "--recompute", "selective"], "--iteration-time"),
    (["plan", *GPT2, "--iteration-time", "-1", "--recompute", "selective"], "--iteration-time"),
    (["plan", *GPT2, "--iteration-time", "nan", "--recompute", "selective"], "--iteration-time"),
    (["plan", *GPT2, "--iteration-time", "1e-9", "--recompute", "selective"], "--iteration-time"),
    (["plan", *GPT2, "--iteration-time", "10"], "--iteration-time"),
    # -- plan: names, flags, search size -----------------------------------------------------
    (["plan", *GPT2, "--recompute", "everything"], "--recompute"),
    (["plan", *GPT2, "--sp", "maybe"], "--sp"),
    (["plan", *GPT2, "--gpu", "V100"], "V100"),
    (["plan", *GPT2, "--bogus"], "--bogus"),
    (["plan", "--model", "gpt2", "--global-batch"], "--global-batch"),
    (["plan", "--model", "gpt2"], "--global-batch"),
    (["plan", "--global-batch", "8"], "--model"),
    (["plan", "--model", "gpt-9000", "--global-batch", "8"], "--model"),
    (["plan", "--model", "gpt-175b", "--gpus", "1048576", "--global-batch", "16777216", "--micro-batch",
      *map(str, range(1, 41)), "--interleave", *map(str, range(1, 13))], "--micro-batch"),
    # -- flops -------------------------------------------------------------------------------
    (["flops", "--model", "gpt2", "--seq-len", "0"], "--seq-len"),
    (["flops", "--model", "gpt2", "--seq-len", "-16"], "--seq-len"),
    (["flops", "--model", "gpt2", "--seq-len", "1.5"], "--seq-len"),
    (["flops", "--model", "gpt2", "--seq-len", "99999999999"], "--seq-len"),
    (["flops", "--model", "gpt2", "--batch", "0"], "--batch"),
    (["flops", "--model", "gpt2", "--batch", "-1"], "--batch"),
    (["flops", "--model", "gpt2", "--batch", "nan"], "--batch"),
    (["flops", "--model", "gpt2", "--gpu", "TPU"], "TPU"),
    (["flops", "--model", "gpt2", "--mode", "inference"], "--mode"),
    (["flops"], "--model"),
    (["flops", "--model", "gpt-9000"], "--model"),
    # -- memory ------------------------------------------------------------------------------
    (["memory", "--model", "gpt2-tiny", "--tp", "0"], "--tp"),
    (["memory", "--model", "gpt2-tiny", "--tp", "-2"], "--tp"),
    (["memory", "--model", "gpt2-tiny", "--tp", "3"], "--tp"),
    (["memory", "--model", "gpt2-tiny", "--tp", "1000000"], "--tp"),
    (["memory", "--model", "gpt2-tiny", "--seq", "0"], "--seq"),
    (["memory", "--model", "gpt2-tiny", "--seq", "-16"], "--seq"),
    (["memory", "--model", "gpt2-tiny", "--seq", "100000"], "--seq"),
    (["memory", "--model", "gpt2-tiny", "--batch", "0"], "--batch"),
    (["memory", "--model", "llama-7b", "--seq", "16000000", "--batch", "16000000"], "--seq"),
    (["memory", "--model", "gpt2-tiny", "--sp"], "--sp"),
    (["memory", "--model", "gpt2-tiny", "--sp", "--tp", "2", "--seq", "7"], "--seq"),
    (["memory", "--model", "gpt2-tiny", "--pp", "0"], "--pp"),
    (["memory", "--model", "gpt2-tiny", "--pp", "3"], "--pp"),
    (["memory", "--model", "gpt2-tiny", "--pp", "2000"], "--pp"),
    (["memory", "--model", "gpt2-tiny", "--pp", "2", "--microbatches", "0"], "--microbatches"),
    (["memory", "--model", "gpt2-tiny", "--pp", "2", "--microbatches", "5000"], "--microbatches"),
    (["memory", "--model", "gpt2-tiny", "--pp", "2", "--stages-per-rank", "0"], "--stages-per-rank"),
    (["memory", "--model", "gpt2", "--pp", "4", "--microbatches", "1024", "--schedule", "zbv"], "--microbatches"),
    (["memory", "--model", "gpt2-tiny", "--pp", "2", "--schedule", "foo"], "--schedule"),
    (["memory", "--model", "gpt2-tiny", "--pp", "2", "--schedule", "zbv", "--stages-per-rank", "3"],
     "--stages-per-rank"),
    (["memory", "--model", "gpt2-tiny", "--stored-microbatches", "-1"], "--stored-microbatches"),
    (["memory", "--model", "gpt2-tiny", "--stored-microbatches", "1"], "--stored-microbatches"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "everything"], "--recompute"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "budget"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--budget", "0.5"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "budget", "--budget", "1.5"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "budget", "--budget", "0"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "budget", "--budget=-5"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "budget", "--budget", "nan"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "budget", "--budget", "1e400"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "budget", "--budget", "e"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "budget", "--budget", "12XB"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--recompute", "budget", "--budget", "1.5b"], "--budget"),
    (["memory", "--model", "gpt2-tiny", "--dtype", "fp8"], "--dtype"),
    (["memory", "--model", "gpt2-tiny", "--tp"], "--tp"),
    (["memory"], "--model"),
    # -- schedule ----------------------------------------------------------------------------
    (["schedule", "--pp", "0", "--microbatches", "4"], "--pp"),
    (["schedule", "--pp", "-1", "--microbatches", "4"], "--pp"),
    (["schedule", "--pp", "4", "--microbatches", "0"], "--microbatches"),
    (["schedule", "--pp", "4", "--microbatches", "-8"], "--microbatches"),
    (["schedule", "--pp", "2000", "--microbatches", "2000"], "--pp"),
    (["schedule", "--pp", "257", "--microbatches", "1"], "--pp"),
    (["schedule", "--pp", "4", "--microbatches", "1025"], "--microbatches"),
    (["schedule", "--pp", "256", "--microbatches", "256"], "--microbatches"),
    (["schedule", "--pp", "64", "--microbatches", "64", "--schedule", "zbv"], "--microbatches"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--stages-per-rank", "0"], "--stages-per-rank"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--stages-per-rank", "65"], "--stages-per-rank"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--stages-per-rank", "2"], "--stages-per-rank"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--schedule", "zbv", "--stages-per-rank", "3"],
     "--stages-per-rank"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--schedule", "foo"], "--schedule"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--backward-ratio", "nan"], "--backward-ratio"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--backward-ratio", "inf"], "--backward-ratio"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--backward-ratio", "0"], "--backward-ratio"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--backward-ratio=-1"], "--backward-ratio"),
    (["schedule", "--pp", "4", "--microbatches", "4", "--backward-ratio", "slow"], "--backward-ratio"),
    (["schedule", "--pp", "64", "--microbatches", "4", "-o", "x.png"], "-o"),
    (["schedule", "--pp", "8", "--microbatches", "256", "-o", "x.png"], "-o"),
    (["schedule", "--microbatches", "4"], "--pp"),
    (["schedule", "--pp", "4"], "--microbatches"),
    (["schedule", "--pp"], "--pp"),
    # -- verify ------------------------------------------------------------------------------
    (["verify", "--model", "gpt2", "--tp", "0"], "--tp"),
    (["verify", "--model", "gpt2", "--tp", "-2"], "--tp"),
    (["verify", "--model", "gpt2", "--tp", "2.5"], "--tp"),
    (["verify", "--model", "gpt2", "--tp", "1000"], "--tp"),
    (["verify", "--model", "gpt2", "--tp"], "--tp"),
    (["verify", "--model", "gpt2"], "--tp"),
    (["verify", "--tp", "2"], "--model"),
    (["verify", "--model", "gpt2", "--tp", "2", "--pp", "0"], "--pp"),
    (["verify", "--model", "gpt2", "--tp", "2", "--pp", "40"], "--pp"),
    (["verify", "--model", "gpt2", "--tp", "2", "--steps", "0"], "--steps"),
    (["verify", "--model", "gpt2", "--tp", "2", "--layers", "-1"], "--layers"),
    (["verify", "--model", "gpt2", "--tp", "2", "--layers", "100000"], "--layers"),
    (["verify", "--model", "gpt2", "--tp", "2", "--seq", "1e3"], "--seq"),
    (["verify", "--model", "gpt2", "--tp", "2", "--batch", "0"], "--batch"),
    (["verify", "--model", "gpt2", "--tp", "2", "--batch", "1000", "--seq", "100000"], "--batch"),
    (["verify", "--model", "gpt2", "--tp", "2", "--rtol", "nan"], "--rtol"),
    (["verify", "--model", "gpt2", "--tp", "2", "--rtol=-1e-4"], "--rtol"),
    (["verify", "--model", "gpt2", "--tp", "2", "--timeout", "0"], "--timeout"),
    (["verify", "--model", "gpt2", "--tp", "2", "--timeout", "inf"], "--timeout"),
    (["verify", "--model", "gpt2", "--tp", "2", "--bogus"], "--bogus"),
    (["verify", "--model", "gpt2", "--tp", "2", "--dp", "0"], "--dp"),
    (["verify", "--model", "gpt2", "--tp", "2", "--dp", "40"], "--dp"),
    (["verify", "--model", "gpt2", "--tp", "1", "--dp", "2", "--ep", "0"], "--ep"),
    (["verify", "--model", "gpt2", "--tp", "1", "--dp", "2", "--ep", "3"], "ep=3 must divide dp=2"),
    (["verify", "--model", "gpt2", "--tp", "2", "--processes", "--simulated"], "--simulated"),
    # -- the command itself ------------------------------------------------------------------
    ([], "COMMAND"),
    (["frobnicate"], "frobnicate"),
]

# every config problem through every subcommand that reads a model shape
for _name in [*CONFIGS, *RAW_FILES]:
    BAD_CALLS.append((["plan", "--model", f"@{_name}", "--global-batch", "8"], CONFIG_FIELDS[_name]))
for _name in ("n_head_zero", "n_layer_null", "heads_5_of_64", "hidden_negative", "malformed"):
    BAD_CALLS.append((["flops", "--model", f"@{_name}"], CONFIG_FIELDS[_name]))
    BAD_CALLS.append((["memory", "--model", f"@{_name}"], CONFIG_FIELDS[_name]))
for _command in (["plan", "--global-batch", "8"], ["flops"], ["memory"]):
    BAD_CALLS.append(([_command[0], "--model", "@folder", *_command[1:]], "--model"))
    BAD_CALLS.append(([_command[0], "--model", "@missing", *_command[1:]], "--model"))
BAD_CALLS.append((["plan", "--model", "@dir.json", "--global-batch", "8"], "--model"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("configs")
    paths = {}
    for name, config in CONFIGS.items():
        (folder / f"{name}.json").write_text(json.dumps(config))
        paths[name] = str(folder / f"{name}.json")
    for name, text in RAW_FILES.items():
        (folder / f"{name}.json").write_text(text)
        paths[name] = str(folder / f"{name}.json")
    (folder / "empty_folder").mkdir()
    (folder / "dir.json").mkdir()
    paths.update(folder=str(folder / "empty_folder"), missing=str(folder / "nowhere" / "config.json"),
                 **{"dir.json": str(folder / "dir.json")})
    return paths


def _argv(argv: list[str], files: dict[str, str]) -> list[str]:
    return [files[a[1:]] if a.startswith("@") else a for a in argv]


def _check(code: int, out: str, err: str, argv: list[str], names: str) -> None:
    command = argv[0] if argv and argv[0] in {"plan", "flops", "memory", "schedule", "verify"} else None
    assert code == 2, f"exit {code} for {argv}: {err or out[:300]}"
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr: {err}"
    prefix = f"sptransform {command}: error: " if command else "sptransform: error: "
    assert lines[0].startswith(prefix), lines[0]
    assert names in lines[0], f"{names!r} not named in: {lines[0]}"


def test_the_table_covers_every_subcommand_and_at_least_120_calls():
    commands = {argv[0] for argv, _ in BAD_CALLS if argv}
    assert commands >= {"plan", "flops", "memory", "schedule", "verify"}
    assert len(BAD_CALLS) >= 120


@pytest.mark.parametrize("argv,names", BAD_CALLS, ids=[" ".join(a)[:80] for a, _ in BAD_CALLS])
def test_bad_call_is_one_error_line_and_exit_2(argv, names, files, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # -o x.png lands here if a check were missing
    start = time.perf_counter()
    code = cli.main(_argv(argv, files))
    out, err = capsys.readouterr()
    _check(code, out, err, argv, names)
    assert time.perf_counter() - start < 20, "a refused call must answer at once"


def test_bad_calls_through_python_dash_m(files):
    """The same through ``python -m sptransform``: a value refused by its type and an argparse error
    (two only: each process spends seconds importing torch)."""
    calls = [
        (["schedule", "--pp", "2000", "--microbatches", "2000"], "--pp"),
        (["verify", "--model", "gpt2", "--tp"], "--tp"),
    ]
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(cli.__file__).parents[2])}
    processes = [subprocess.Popen([sys.executable, "-m", "sptransform", *_argv(argv, files)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for argv, _ in calls]
    for process, (argv, names) in zip(processes, calls):
        out, err = process.communicate(timeout=180)
        _check(process.returncode, out, err, argv, names)


def test_help_returns_0_without_raising(capsys):
    assert cli.main(["schedule", "--help"]) == 0
    out = capsys.readouterr().out
    assert "32,768" in out and "2,048" in out  # the limits are documented where the flags are


# -- the largest accepted enumerations -------------------------------------------------------


def _timed(argv: list[str], capsys) -> float:
    start = time.perf_counter()
    code = cli.main(argv)
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == 0, err
    return elapsed


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "gpt-175b", "--gpus", "1048576", "--global-batch", "16777216", "--json"],
    ["plan", "--model", "gpt-175b", "--gpus", "720720", "--global-batch", "720720", "--json"],  # most divisors
    ["schedule", "--pp", "256", "--microbatches", "128", "--schedule", "1f1b"],
    ["schedule", "--pp", "32", "--microbatches", "1024", "--schedule", "gpipe"],
    ["schedule", "--pp", "16", "--microbatches", "64", "--schedule", "zbv"],
    ["schedule", "--pp", "16", "--microbatches", "64", "--schedule", "interleaved1f1b"],
], ids=lambda argv: " ".join(argv[:7]))
def test_largest_accepted_enumerations_answer_in_seconds(argv, capsys):
    assert _timed(argv, capsys) < 15


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    # about 40,000 valid layouts, near the 50,000 the search evaluates at most
    ["plan", "--model", "@deep", "--gpus", "720720", "--global-batch", "5765760", "--zero", "0", "1", "2", "--json"],
    ["schedule", "--pp", "1", "--microbatches", "1024", "--schedule", "zbv"],
    ["schedule", "--pp", "256", "--microbatches", "4", "--schedule", "zbv"],
    ["schedule", "--pp", "8", "--microbatches", "128", "--schedule", "looped_bfs"],
], ids=lambda argv: " ".join(argv[:7]))
def test_slowest_accepted_enumerations_answer_in_seconds(argv, capsys, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps({"n_layer": 720720, "n_embd": 1024, "n_head": 16, "vocab_size": 50000,
                                "n_positions": 2048}))
    assert _timed([str(deep) if a == "@deep" else a for a in argv], capsys) < 30


# -- the library gets the same checks ----------------------------------------------------------


def test_library_shape_and_search_checks():
    from sptransform.planner import Cluster, SearchSpace, Workload, get_gpu, plan
    from sptransform.planner.presets import PRESETS, ModelShape, shape_from_hf_dict

    with pytest.raises(ValueError, match="hidden=64 is not divisible by num_heads=5"):
        ModelShape(name="x", num_layers=2, hidden=64, num_heads=5)
    with pytest.raises(ValueError, match="num_layers=0"):
        PRESETS["gpt2"].with_(num_layers=0)
    with pytest.raises(ValueError, match="field 'n_head' is 0"):
        shape_from_hf_dict({**VALID, "n_head": 0})
    with pytest.raises(ValueError, match=r"SearchSpace.tp=\(0,\)"):
        SearchSpace(tp=(0,))
    cluster = Cluster(gpu=get_gpu("A100-80G"), num_gpus=2**21)
    with pytest.raises(ValueError, match="num_gpus=2097152 is above the planner's limit"):
        plan(PRESETS["gpt2"], cluster=cluster, workload=Workload(global_batch=8, seq_len=1024))
