"""``sptransform.verify`` and ``sptransform verify``: equal models say equal, a model the
parallel transform gets wrong says different (and which row), a refused model says refused,
and nothing (process group, LocalTensorMode, RNG state) is left behind."""

from __future__ import annotations

import importlib.util
import math
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import local_tensor_mode

import sptransform
from sptransform.cli import main

transformers = pytest.importorskip("transformers")

# A self-contained decoder whose norm is chosen by name. Written to a file for the CLI's
# module:factory and imported from there by the API tests too.
MODULE = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class RMSNorm(nn.Module):  # Llama's
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


    class GemmaNorm(nn.Module):  # Gemma's: scaled by (1 + weight), weight starting at 0
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(0.1 * torch.randn(dim))

        def forward(self, x):
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + self.weight)


    class Block(nn.Module):
        def __init__(self, norm, h, heads):
            super().__init__()
            self.heads = heads
            self.n1, self.n2 = norm(h), norm(h)
            self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(self.n1(x)).split(h, -1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(y.transpose(1, 2).reshape(b, s, h))
            return x + self.down(F.gelu(self.up(self.n2(x))))


    class LM(nn.Module):
        def __init__(self, norm, vocab=67, h=32, heads=4, layers=2):
            super().__init__()
            self.tok = nn.Embedding(vocab, h)
            self.blocks = nn.ModuleList(Block(norm, h, heads) for _ in range(layers))
            self.norm = norm(h)
            self.head = nn.Linear(h, vocab, bias=False)

        def forward(self, ids, targets):
            x = self.tok(ids)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


    def _inputs():
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 67, (2, 8), generator=g)
        return ids, torch.roll(ids, -1, 1)


    def rms():
        torch.manual_seed(0)
        return LM(RMSNorm), _inputs()


    def gemma():
        torch.manual_seed(0)
        return LM(GemmaNorm), _inputs()


    class AbortsOnRank1(nn.Module):
        """A process that dies by a signal (as a crash in torch or gloo would) on rank 1."""

        def __init__(self):
            super().__init__()
            self.lm = LM(RMSNorm)

        def forward(self, ids, targets):
            import os

            import torch.distributed as dist

            if dist.is_initialized() and dist.get_rank() == 1:
                os.abort()
            return self.lm(ids, targets)


    def aborting():
        torch.manual_seed(0)
        return AbortsOnRank1(), _inputs()
''')


@pytest.fixture
def models(tmp_path, monkeypatch):
    """The module above, importable by name (pp > 1 pickles the model to spawned processes)."""
    path = tmp_path / "verify_models.py"
    path.write_text(MODULE)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    spec = importlib.util.spec_from_file_location("verify_models", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "verify_models", module)
    spec.loader.exec_module(module)
    return module, path


def _no_state_left():
    assert not dist.is_initialized()
    assert local_tensor_mode() is None


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=64,
                                     attn_implementation="eager", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                     bos_token_id=100, eos_token_id=100)
    return transformers.GPT2LMHeadModel(config).train()


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                                      intermediate_size=96, vocab_size=101, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).train()


@pytest.mark.parametrize("make", [gpt2, llama])
@pytest.mark.parametrize("sp", [True, False])
def test_hf_models_verify_equal(make, sp):
    model = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    report = sptransform.verify(model, tp=2, sp=sp, processes=False)
    assert report.status == "equal" and report.ok, str(report)
    assert report.ranks == "simulated" and "simulated ranks (LocalTensorMode)" in str(report).splitlines()[0]
    assert report.error is None and report.worst < 1e-4 and all(row.ok for row in report.rows)
    names = {n for n, _ in model.named_parameters()}
    kinds = {row.kind for row in report.rows}
    assert kinds == {"output", "grad", "param after 1 step"}
    assert {row.name for row in report.rows if row.kind == "grad"} == names
    outputs = {row.name: row.placement for row in report.rows if row.kind == "output"}
    assert outputs == {"loss": "plain", "logits": "Shard(2)"}  # labels were passed: HF computed its loss
    placements = {row.name: row.placement for row in report.rows if row.kind == "grad"}
    if make is gpt2:
        assert placements["transformer.h.0.attn.c_attn.weight"] == "_StridedShard(1, split_factor=3)"
        assert placements["transformer.h.0.ln_1.weight"] == "Replicate()"
    else:
        assert placements["model.layers.0.self_attn.k_proj.weight"] == "Shard(0)"
    assert "verdict: EQUAL" in str(report)
    # the model itself, the global RNG and the process state are untouched
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    _no_state_left()


def test_fused_attention_dropout_is_compared_in_eval_mode_with_a_note():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=61, n_positions=32,
                                     attn_implementation="sdpa", attn_pdrop=0.1, bos_token_id=60, eos_token_id=60)
    report = sptransform.verify(transformers.GPT2LMHeadModel(config).train(), tp=2, steps=2, processes=False)
    assert report.ok, str(report)
    assert any("eval() mode" in note and "fused attention kernel" in note for note in report.notes)
    assert {row.kind for row in report.rows} == {"output", "grad", "param after 2 steps"}


def test_logits_only_model_backpropagates_the_sum_of_its_vocab_sharded_logits():
    """No labels: no loss; the sum of the logits (a DTensor sharded on the vocab, padded for
    101 % 2) is back-propagated on both sides."""
    model = gpt2()
    ids = torch.randint(0, 101, (2, 16))
    report = sptransform.verify(model, tp=2, example_inputs=(ids,), processes=False)
    assert report.ok, str(report)
    assert any("sum(logits)" in note for note in report.notes)
    assert [row.name for row in report.rows if row.kind == "output"] == ["logits"]


def test_gemma_style_norm_weight_gradient_under_sp(models):
    """Gemma's ``x * (1 + weight)`` norm: the weight's gradient under SP is (at the time of
    writing) only this rank's share, not summed over ranks. verify must say so and point at the
    norm weights; once the bug is fixed it says equal, and this test still holds."""
    module, _ = models
    model, inputs = module.gemma()
    report = sptransform.verify(model, tp=2, sp=True, example_inputs=inputs, processes=False)
    failing = [row for row in report.rows if not row.ok]
    assert (report.status == "different") == bool(failing), str(report)
    assert report.status in ("equal", "different")
    if failing:
        assert all(row.name.endswith(("n1.weight", "n2.weight", "norm.weight")) for row in failing), str(report)
        assert any(row.name == "blocks.0.n1.weight" and row.kind == "grad" for row in failing), str(report)
        assert report.worst == max(row.rel_error for row in failing) > 1e-4
        assert "verdict: DIFFERENT" in str(report)
    # Llama's RMSNorm, the same model otherwise: equal
    model, inputs = module.rms()
    assert sptransform.verify(model, tp=2, sp=True, example_inputs=inputs, processes=False).ok


def _drop_parameter_gradient_sums(monkeypatch):
    """Break the transform on purpose: no parameter gradient is summed over the ranks."""
    import sptransform.transform

    real = sptransform.transform.gradient_plan

    def broken(*args, **kwargs):
        plan = real(*args, **kwargs)
        plan.partial_params.clear()
        return plan

    monkeypatch.setattr(sptransform.transform, "gradient_plan", broken)


def test_missing_gradient_sync_is_reported_different(models, monkeypatch):
    """A deliberately broken transform (no gradient all-reduce for replicated parameters that read
    sequence-split activations): the norm weights' gradients are each rank's share only."""
    _drop_parameter_gradient_sums(monkeypatch)
    module, _ = models
    model, inputs = module.rms()
    report = sptransform.verify(model, tp=2, sp=True, example_inputs=inputs, processes=False)  # the patch is here
    assert report.status == "different" and not report.ok
    failing = {(row.name, row.kind) for row in report.rows if not row.ok}
    assert ("blocks.0.n1.weight", "grad") in failing and ("norm.weight", "grad") in failing
    assert all(name.endswith(("n1.weight", "n2.weight", "norm.weight", ".o.bias", ".down.bias"))
               for name, _ in failing), failing
    assert {row.name for row in report.rows if row.kind == "output"} == {"output"}  # the loss itself is right
    assert all(row.ok for row in report.rows if row.kind == "output")
    _no_state_left()


def test_refused_model_is_reported_not_raised():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=48, n_head=3, vocab_size=61, n_positions=32,
                                     bos_token_id=60, eos_token_id=60)
    report = sptransform.verify(transformers.GPT2LMHeadModel(config), tp=2, processes=False)
    assert report.status == "refused" and not report.ok
    assert "does not divide the 3 attention heads" in report.error
    assert report.rows == [] and math.isnan(report.worst)
    assert "REFUSED" in str(report)
    _no_state_left()


def test_state_is_restored_when_parallelize_crashes(models, monkeypatch):
    import sptransform.verify_ranks

    def crash(*args, **kwargs):
        assert dist.is_initialized() and local_tensor_mode() is not None
        raise RuntimeError("boom")

    monkeypatch.setattr(sptransform.verify_ranks, "parallelize", crash)
    module, _ = models
    model, inputs = module.rms()
    with pytest.raises(RuntimeError, match="boom"):
        sptransform.verify(model, tp=2, example_inputs=inputs, processes=False)
    _no_state_left()


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp=2, processes=False), "processes=False simulates"),  # the fake group would clash with the job's
    (dict(tp=1), "world size 2 is not dp x pp x tp = 1 x 1 x 1"),  # the job's ranks must be the layout's
    (dict(tp=1, dp=4), "world size 2 is not dp x pp x tp = 4 x 1 x 1"),
])
def test_inside_a_job_runs_only_on_the_jobs_ranks(models, kwargs, message):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    module, _ = models
    model, inputs = module.rms()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.raises(ValueError, match=message):
            sptransform.verify(model, example_inputs=inputs, **kwargs)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(tp=0), ValueError, "tp=0"), (dict(tp=2.0), TypeError, "tp must be an int"),
    (dict(tp=2, steps=0), ValueError, "steps=0"), (dict(tp=2, rtol=float("nan")), ValueError, "rtol=nan"),
    (dict(tp=2, pp=0), ValueError, "pp=0"), (dict(tp=2, sp=1), TypeError, "sp must be"),
    (dict(tp=2, dp=0), ValueError, "dp=0 must be at least 1"), (dict(tp=2, dp=True), TypeError, "dp must be an int"),
    (dict(tp=2, dp=2.0), TypeError, "dp must be an int"),
    (dict(tp=2, processes="yes"), TypeError, "processes must be None .* True .* or False"),
    (dict(tp=2, processes=1), TypeError, "processes must be None"),
    (dict(tp=2, pp=2, processes=False), ValueError, "pp=2 needs real processes.*processes=None or True"),
    (dict(tp=2, dp=2, processes=False), ValueError, "dp=2 needs real processes"),
    (dict(tp=2, dp=3, processes=True), ValueError, "batch of 2 does not split into 3"),  # before any spawn
    (dict(tp=2, recompute="sometimes"), ValueError, "recompute='sometimes' is not a policy"),
    (dict(tp=2, recompute=1.5), ValueError, "a float budget"), (dict(tp=2, recompute=True), TypeError, "neither"),
    (dict(tp=2, recompute="selective", compile="tvm"), ValueError, "compile='tvm' must be one of"),
    (dict(tp=2, recompute="selective", processes=False), ValueError, "recompute='selective' needs real processes"),
])
def test_bad_arguments_raise(models, kwargs, error, message):
    module, _ = models
    model, inputs = module.rms()
    with pytest.raises(error, match=message):
        sptransform.verify(model, example_inputs=inputs, **kwargs)
    _no_state_left()


def test_report_first_line_names_the_engine():
    simulated = sptransform.VerifyReport(status="equal", worst=0.0, tp=2)
    spawned = sptransform.VerifyReport(status="equal", worst=0.0, tp=2, dp=2, ranks="processes", processes=4,
                                       backend="gloo")
    assert str(simulated).splitlines()[0] == (
        "sptransform.verify: tp=2 sp=True, simulated ranks (LocalTensorMode), 1 SGD step, rtol 0.0001")
    assert str(spawned).splitlines()[0] == (
        "sptransform.verify: tp=2 dp=2 sp=True, real gloo processes (4), 1 SGD step, rtol 0.0001")


class _LambdaHead(torch.nn.Module):
    """A tied head stored as a lambda (as x-transformers does): pickle refuses it."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = lambda x: x @ self.emb.weight.t()

    def forward(self, ids):
        return self.head(self.mix(self.emb(ids))).logsumexp(-1).mean()


def test_unpicklable_model_is_simulated_by_default_with_a_note():
    torch.manual_seed(0)
    model = _LambdaHead()
    report = sptransform.verify(model, tp=2, sp=False)  # nothing spawned: pickle refuses it first
    assert report.ok and report.ranks == "simulated", str(report)
    assert any(note.startswith("simulated ranks, not real processes") and "lambda" in note for note in report.notes)
    with pytest.raises(ValueError, match="must be picklable.*or pass processes=False"):
        sptransform.verify(model, tp=2, sp=False, processes=True)
    with pytest.raises(ValueError, match="must be picklable"):  # pp > 1 has no simulated fallback
        sptransform.verify(model, tp=1, pp=2)
    _no_state_left()


def test_model_of_main_module_is_not_sent_to_spawned_processes():
    from sptransform.verify_ranks import NotPortable, ParallelCase, portable

    in_main = type("Model", (torch.nn.Linear,), {"__module__": "__main__"})(4, 4)
    with pytest.raises(NotPortable, match="defined in __main__"):
        portable([ParallelCase(in_main, (torch.ones(2, 4),), {}, tp=2)])
    portable([ParallelCase(torch.nn.Linear(4, 4), (torch.ones(2, 4),), {}, tp=2)])  # importable: fine


def test_fake_tensor_meta_failure_logs_are_dropped_inside_the_scope_only():
    import logging

    from sptransform.torch_internals import quiet_fake_tensor_meta_failures

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    handler = Keep()
    logger.addHandler(handler)
    try:
        with quiet_fake_tensor_meta_failures():
            logger.error("failed while attempting to run meta for %s", "aten._grouped_mm.default")
            logger.error("something else")
        logger.error("failed while attempting to run meta for %s", "aten.mm.default")
    finally:
        logger.removeHandler(handler)
    assert seen == ["something else", "failed while attempting to run meta for aten.mm.default"]


def test_pipeline_processes_are_killed_at_the_timeout(models):
    import multiprocessing

    module, _ = models
    model, inputs = module.rms()
    with pytest.raises(TimeoutError, match="timeout_s"):
        sptransform.verify(model, tp=1, pp=2, example_inputs=inputs, timeout_s=0.5)
    assert not multiprocessing.active_children()
    _no_state_left()


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_a_clear_error_not_torchs_exception(models):
    module, _ = models
    model, inputs = module.aborting()
    with pytest.raises(RuntimeError, match=r"a verification rank died before saving its result .*SIGABRT.*not a verdict"):
        sptransform.verify(model, tp=2, example_inputs=inputs, processes=True, timeout_s=300)
    _no_state_left()


@pytest.mark.slow
def test_pipeline_gpt2_verifies_equal_on_gloo_processes():
    report = sptransform.verify(gpt2(), tp=1, pp=2, steps=2, timeout_s=300)
    assert report.ok, str(report)
    assert any("eval() mode" in note for note in report.notes)  # pipeline dropout masks differ per microbatch
    assert {row.name for row in report.rows if row.kind == "grad"} == {n for n, _ in gpt2().named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", 0.5])
def test_recompute_compiled_by_inductor_verifies_equal_on_gloo_processes(models, recompute):
    module, _ = models
    model, inputs = module.rms()
    report = sptransform.verify(model, tp=2, example_inputs=inputs, recompute=recompute, compile="inductor",
                                processes=True, timeout_s=300)
    assert report.ok, str(report)
    assert (report.recompute, report.compile, report.ranks) == (recompute, "inductor", "processes")
    assert f"recompute={recompute!r} compile='inductor'" in str(report).splitlines()[0]


# -- the command line -------------------------------------------------------------


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["verify", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_preset_equal_and_refused(capsys):
    rc, out, _ = _cli(capsys, "--model", "gpt2-tiny", "--tp", "2", "--layers", "1", "--simulated")
    assert rc == 0 and "verdict: EQUAL" in out and "simulated ranks (LocalTensorMode)" in out
    rc, out, _ = _cli(capsys, "--model", "gpt2-xl", "--tp", "2", "--layers", "1", "--simulated")  # 25 heads
    assert rc == 2 and "REFUSED" in out and "25 attention heads" in out


def test_cli_shard_whole_stores_what_tp_keeps_whole_in_pieces(capsys):
    rc, out, _ = _cli(capsys, "--model", "gpt2-tiny", "--tp", "2", "--layers", "1", "--simulated")
    held = float(out.split("held per rank: ")[1].split()[0])
    rc_whole, out_whole, _ = _cli(capsys, "--model", "gpt2-tiny", "--tp", "2", "--layers", "1", "--simulated",
                                  "--shard-whole")
    assert rc == rc_whole == 0 and "verdict: EQUAL" in out_whole and "shard_whole=True" in out_whole, out_whole
    # GPT-2's positions table, norms and biases in pieces too: every weight split
    assert held > 0.51 and "held per rank: 0.500 " in out_whole, (held, out_whole)


def test_cli_different(capsys, monkeypatch):
    _drop_parameter_gradient_sums(monkeypatch)
    rc, out, _ = _cli(capsys, "--model", "gpt2-tiny", "--tp", "2", "--layers", "1", "--seq", "8", "--simulated")
    assert rc == 1 and "verdict: DIFFERENT" in out and "FAIL" in out


def test_cli_config_json(capsys, tmp_path):
    config = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=97,
                                      max_position_embeddings=64)
    config.to_json_file(tmp_path / "config.json")
    rc, out, _ = _cli(capsys, "--model", tmp_path / "config.json", "--tp", "2", "--no-sp", "--steps", "2",
                      "--simulated")
    assert rc == 0, out
    assert "model.layers.1.mlp.up_proj.weight" in out and "model.layers.2." not in out  # --layers 2 by default
    assert "sp=False" in out and "param after 2 steps" in out


def test_cli_module_factory(capsys, models):
    _, path = models
    rc, out, _ = _cli(capsys, "--model", f"{path}:rms", "--tp", "2", "--simulated")
    assert rc == 0 and "verdict: EQUAL" in out


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt2"], "--tp is required"),
    (["--tp", "2"], "--model is required"),
    (["--model", "gpt2", "--tp", "0"], "positive integer"),
    (["--model", "gpt2", "--tp", "-2"], "positive integer"),
    (["--model", "gpt2", "--tp", "2.5"], "positive integer"),
    (["--model", "gpt2", "--tp", "two"], "positive integer"),
    (["--model", "gpt2", "--tp", "2", "--steps", "0"], "--steps"),
    (["--model", "gpt2", "--tp", "2", "--layers", "-1"], "--layers"),
    (["--model", "gpt2", "--tp", "2", "--seq", "1e3"], "--seq"),
    (["--model", "gpt2", "--tp", "2", "--batch", "0"], "--batch"),
    (["--model", "gpt2", "--tp", "2", "--pp", "x"], "--pp"),
    (["--model", "gpt2", "--tp", "2", "--rtol", "nan"], "finite"),
    (["--model", "gpt2", "--tp", "2", "--rtol", "inf"], "finite"),
    (["--model", "gpt2", "--tp", "2", "--rtol=-1e-4"], "finite"),
    (["--model", "gpt2", "--tp", "2", "--rtol", "tight"], "number"),
    (["--model", "gpt2", "--tp", "2", "--timeout", "0"], "--timeout"),
    (["--model", "gpt2", "--tp", "2", "--dp", "0"], "--dp"),
    (["--model", "gpt2", "--tp", "2", "--pp", "2", "--simulated"], "needs real processes"),
    (["--model", "gpt2", "--tp", "8", "--pp", "4", "--dp", "4"], "128 processes is above the limit of 64"),
    (["--model", "gpt-3", "--tp", "2"], "not a preset"),
    (["--model", "missing/config.json", "--tp", "2"], "no such file"),
    (["--model", "no_such_module_xyz:build", "--tp", "2"], "No module named"),
    (["--model", "os:no_such_factory", "--tp", "2"], "no callable"),
    (["--model", "os:getcwd", "--tp", "2"], "not an nn.Module"),
    (["--model", "os.path:join", "--tp", "2"], "raised TypeError"),
])
def test_cli_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2
    assert err.startswith("sptransform verify: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_argparse_errors_exit_2_without_traceback(capsys):
    assert main(["verify", "--model", "gpt2", "--tp"]) == 2  # returned, not raised as SystemExit
    err = capsys.readouterr().err
    assert err.startswith("sptransform verify: error: argument --tp") and err.count("\n") == 1
    assert "Traceback" not in err


# -- real processes -----------------------------------------------------------------------


@pytest.mark.slow
def test_default_runs_real_gloo_processes_and_says_so():
    model = gpt2()
    report = sptransform.verify(model, tp=2)
    assert report.ok and report.ranks == "processes" and (report.processes, report.backend) == (2, "gloo"), str(report)
    assert str(report).splitlines()[0].startswith("sptransform.verify: tp=2 sp=True, real gloo processes (2), ")
    assert {row.name for row in report.rows if row.kind == "grad"} == {n for n, _ in model.named_parameters()}
    assert any("train() mode" in note for note in report.notes)  # dropout compared with reference masks
    _no_state_left()


@pytest.mark.slow
def test_data_parallel_groups_train_on_their_pieces_of_the_batch(models):
    module, _ = models
    model, (ids, targets) = module.rms()
    inputs = (torch.cat([ids, ids.flip(0)]), torch.cat([targets, targets.flip(0)]))  # 4 rows: 2 per group
    report = sptransform.verify(model, tp=1, dp=2, example_inputs=inputs)
    assert report.ok and report.processes == 2, str(report)
    assert "tp=1 dp=2 sp=True, real gloo processes (2)" in str(report).splitlines()[0]


@pytest.mark.slow
def test_cli_inside_torchrun_runs_on_the_jobs_ranks():
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "sptransform", "verify", "--model", "gpt2-tiny", "--tp", "2", "--layers", "1", "--processes"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # rank 0 prints the one report; the ranks are the job's own (nothing spawned inside)
    assert done.stdout.count("sptransform.verify: tp=2 sp=True, real gloo processes (2)") == 1, done.stdout
    assert "note: ran on the caller's process group (2 ranks)" in done.stdout
    assert "verdict: EQUAL" in done.stdout


@pytest.mark.slow
def test_moe_fake_tensor_meta_errors_are_not_printed(capfd):
    """Qwen3-MoE's experts run torch._grouped_mm, whose meta kernel refuses float32 ("Expected inputs
    of BF16 type"); fake-tensor propagation logs that with a traceback, then falls back. verify's
    output is its report."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tools"))
    import sweep_transformers

    target = sweep_transformers.Target(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=96)
    model, _, _ = sweep_transformers.build("qwen3_moe", "Qwen3MoeForCausalLM", target)
    capfd.readouterr()
    report = sptransform.verify(model, tp=2, example_inputs=sweep_transformers.token_inputs(model), processes=False)
    out, err = capfd.readouterr()
    assert report.status in ("equal", "different", "refused")
    assert "failed while attempting to run meta" not in out + err and "BF16" not in out + err, err[-2000:]
