"""Real gloo processes: faults fail fast and clearly, ranks are checked against each other, a
pipeline follows train/eval, and a checkpoint with ``pm.rng`` resumes bit for bit.

Every spawn here runs under a hard deadline (``_spawn``): a hang fails the test instead of
blocking the suite, and leftover processes are killed."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from simulate import spawn_with_deadline as _spawn

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
VOCAB = 97


def _init(rank: int, world: int, port: int, timeout_s: float) -> None:
    torch.set_num_threads(1)  # ranks share two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _llama(seed: int = 0, layers: int = 2, dropout: float = 0.1):
    """Eager attention with attention dropout: a dropout on head-split activations, drawn from the
    per-rank generators at tp > 1 (Llama's projections are separate, so checkpoints need no
    _StridedShard)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=96, vocab_size=VOCAB,
                                      max_position_embeddings=64, attn_implementation="eager",
                                      attention_dropout=dropout)
    return transformers.LlamaForCausalLM(config).train()


def _batches(n: int, batch: int = 4, seq: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(123)
    return [dict(input_ids=torch.randint(0, VOCAB, (batch, seq), generator=g),
                 labels=torch.randint(0, VOCAB, (batch, seq), generator=g)) for _ in range(n)]


# ---------------------------------------------------------------------------
# parallelize on one rank only


def _one_rank_calls_parallelize(rank: int, world: int, port: int, timeout_s: float, out: str) -> None:
    _init(rank, world, port, timeout_s)
    try:
        if rank == 0:
            import sptransform

            start = time.monotonic()
            try:
                sptransform.parallelize(_llama(), tp=2, example_inputs=_batches(1)[0])
                result = {"raised": None}
            except Exception as err:
                result = {"raised": type(err).__name__, "message": str(err)}
            result["elapsed"] = time.monotonic() - start
            with open(out, "w") as f:
                json.dump(result, f)
            # A gloo group whose collective timed out cannot be torn down cleanly: its pending
            # work aborts the process from a destructor (std::terminate). The result is written.
            os._exit(0)
        else:  # busy elsewhere, never calling parallelize, until rank 0 has given up
            end = time.monotonic() + timeout_s + 60
            while not os.path.exists(out) and time.monotonic() < end:
                time.sleep(0.2)
    finally:
        dist.destroy_process_group()


def test_parallelize_on_one_rank_only_fails_within_the_timeout_saying_every_rank_must_call_it(tmp_path):
    timeout_s = 5.0
    out = str(tmp_path / "rank0.json")
    _spawn(_one_rank_calls_parallelize, 2, 120, timeout_s, out)
    with open(out) as f:
        result = json.load(f)
    assert result["raised"] == "RuntimeError", result
    assert "every rank of the group must call parallelize" in result["message"].lower(), result["message"]
    assert "init_process_group(..., timeout=" in result["message"]
    assert result["elapsed"] < timeout_s + 10, result  # the process group's timeout, plus slack


# ---------------------------------------------------------------------------
# ranks checked against each other; a pipeline in eval mode; to(dtype) of a pipeline


def _raises(fn, error, *patterns) -> str:
    try:
        fn()
    except error as err:
        for pattern in patterns:
            assert pattern in str(err), (pattern, str(err))
        return str(err)
    raise AssertionError(f"expected {error.__name__} containing {patterns}")


def _cross_rank_checks(rank: int, world: int, port: int) -> None:
    import sptransform

    _init(rank, world, port, 60)
    try:
        batch = _batches(1)[0]
        pm = sptransform.parallelize(_llama(), tp=2, example_inputs=batch)
        pm(**batch).loss.backward()  # in sync
        _per_call_work(pm, batch)
        other = _batches(2)[1]
        # a data-loader bug: each rank its own batch -> a clear error on both, not a loss matching neither
        mine = batch if rank == 0 else {**batch, "labels": other["labels"]}
        _raises(lambda: pm(**mine), ValueError, "ranks [rank 0] vs [rank 1] were given different values of input "
                "'labels'", "check_inputs=False")
        # different shapes per rank: a clear error, not a gloo abort inside the graph
        shaped = batch if rank == 0 else {k: v[:, :8] for k, v in batch.items()}
        _raises(lambda: pm(**shaped), ValueError, "were given input 'input_ids' with different shapes or dtypes")
        # a bad token id on rank 1 only: rank 1 raises IndexError, rank 0 is told, nobody hangs
        bad = dict(batch)
        if rank == 1:
            bad["input_ids"] = batch["input_ids"].clone()
            bad["input_ids"][0, 0] = VOCAB + 3
        if rank == 1:
            _raises(lambda: pm(**bad), IndexError, f"token id {VOCAB + 3} in input 'input_ids'")
        else:
            _raises(lambda: pm(**bad), RuntimeError, "rejected on rank 1")
        # different modes
        pm.train(rank == 0)
        _raises(lambda: pm(**batch), ValueError, "different train/eval modes")
        pm.train()
        # still in sync after all of that
        loss = pm(**batch).loss
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach())
        assert torch.equal(losses[0], losses[1])
        # parallelize with different options on the two ranks: both told, by name
        _raises(lambda: sptransform.parallelize(_llama(), tp=2, sp=rank == 0, example_inputs=batch), ValueError,
                "the ranks called parallelize with different options")
        # the same parameters and options, but a config read per rank (another activation on rank 1): the
        # graphs differ, which neither the options nor the parameters show; both told, each naming its node
        model = _llama()
        model.config.hidden_act = "silu" if rank == 0 else "gelu_pytorch_tanh"
        for layer in model.model.layers:
            layer.mlp.act_fn = transformers.activations.ACT2FN[model.config.hidden_act]
        message = _raises(lambda: sptransform.parallelize(model, tp=2, example_inputs=batch), ValueError,
                          "the ranks captured different graphs from the model: ranks [0] vs [1]",
                          f"This rank's ({rank}) graph first differs from rank {1 - rank}'s at its node")
        assert ("aten.silu" if rank == 0 else "aten.gelu") in message, message
        # a forward that reads the rank (tp=2 with sp=False would run rank 1's scaled half silently)
        _raises(lambda: sptransform.parallelize(_RankScaled(), tp=2, sp=False, example_inputs=(torch.randn(4, 16),)),
                ValueError, "the ranks captured different graphs", "h = h * 2" if rank == 1 else "torch.relu(h)")
        # ... only in eval(): the train graph agrees at parallelize; the eval graph, built at the first eval
        # call, is compared in that call's input check (its captured graph's digest): both ranks raise
        x = torch.randn(4, 16)
        pm = sptransform.parallelize(_RankScaled(eval_only=True), tp=2, sp=False, example_inputs=(x,))
        pm(x).backward()
        pm.eval()
        _raises(lambda: pm(x), ValueError, "run different graphs for the same inputs and modes")
        _pipeline_modes(rank, world)
        _unloaded_meta_parameters(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _per_call_work(pm, batch: dict) -> None:
    """What a call does in front of its graph, counted rather than timed (a loaded machine cannot
    make it flake): one collective of its own, the fingerprint's all-gather, and no reduction or
    filled buffer for the input checks (CPU ids and labels are read through numpy and hashed from
    their bytes); nothing that depends on the input signature alone worked out again (no walk
    of the submodule tree, one hash: the mode's). Before, a 1-layer GPT-2 call ran 17
    ``get_submodule``, 5 ``stable_hash`` and, in front of the graph, 6 ``fill_``, 2 ``sum``, 4
    ``arange`` and 2 ``aminmax``."""
    import cProfile
    import collections
    import pstats

    from torch.profiler import profile

    with profile() as prof:
        pm._dispatch((), {**pm._call_defaults, **batch})
    ops = collections.Counter(e.name for e in prof.events())
    assert [name for name in ops if name.startswith("gloo:")] == ["gloo:all_gather"], ops
    assert ops["gloo:all_gather"] == 1 and ops["c10d::_allgather_base_"] == 1, ops
    assert not {"aten::fill_", "aten::sum", "aten::arange", "aten::mul", "aten::aminmax", "aten::cat"} & set(ops), ops
    profiler = cProfile.Profile()
    profiler.enable()
    pm(**batch)
    profiler.disable()
    calls = collections.Counter()
    for (_, _, function), (_, total, *_) in pstats.Stats(profiler).stats.items():
        calls[function] += total
    assert calls["get_submodule"] == 0 and calls["signature_fingerprint"] == 0, calls
    assert calls["stable_hash"] == 1 and calls["_dispatch"] == 1, calls


def _pipeline_modes(rank: int, world: int) -> None:
    """A PipelinedModule (pp=2) built in train mode: eval steps give the single-device eval loss and
    gradients (no dropout), train steps drop out, and switching back works; to(dtype) is refused."""
    import copy

    import sptransform

    model = _llama(layers=2, dropout=0.3)
    ref = copy.deepcopy(model).eval()
    batch = _batches(1)[0]
    pm = sptransform.parallelize(model, tp=1, pp=2, n_microbatches=2, example_inputs=batch)
    pm.eval()
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    for attempt in range(2):  # eval twice: deterministic
        torch.manual_seed(attempt)
        loss = pm.step(**batch)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for name, p in pm.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        pm.zero_grad()
    eval_loss = loss
    pm.train()
    train_losses = [pm.step(**batch) for _ in range(2)]
    pm.zero_grad()
    assert all(not torch.equal(t, eval_loss) for t in train_losses) and not torch.equal(*train_losses)
    pm.eval()
    torch.testing.assert_close(pm.step(**batch), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    pm.zero_grad()
    pm.to(torch.float64)
    _raises(lambda: pm.step(**batch), ValueError, "convert the original model first (model.to(dtype))")


def _unloaded_meta_parameters(rank: int, world: int) -> None:
    """A model built on the meta device and never loaded: every rank refuses its first call,
    naming the parameters (their shards are NaN placeholders, not each rank's own garbage), at
    tp=2 and at pp=2; loaded from the original's state dict, it trains like the original."""
    import sptransform

    batch = _batches(1)[0]
    with sptransform.meta_parameters():
        meta = _llama(dropout=0.0)
    pm = sptransform.parallelize(meta, tp=2, example_inputs=batch)
    _raises(lambda: pm(**batch), ValueError, "were built on the meta device and never given values",
            "'lm_head.weight'", "load_hf_weights")
    ref = _llama(dropout=0.0)
    pm.load_state_dict(ref.state_dict())
    torch.testing.assert_close(pm(**batch).loss, ref(**batch).loss, rtol=1e-5, atol=1e-6)
    with sptransform.meta_parameters():
        meta = _llama(layers=2, dropout=0.0)
    piped = sptransform.parallelize(meta, tp=1, pp=2, n_microbatches=2, example_inputs=batch)
    _raises(lambda: piped.step(**batch), ValueError, "never given values")


class _RankScaled(torch.nn.Module):
    def __init__(self, eval_only: bool = False):
        super().__init__()
        self.eval_only = eval_only
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        if dist.get_rank() == 1 and not (self.eval_only and self.training):  # rank 1 traces one more op
            h = h * 2
        return self.down(torch.relu(h)).sum()


def test_ranks_are_checked_against_each_other_and_a_pipeline_follows_train_and_eval():
    _spawn(_cross_rank_checks, 2, 600)


# ---------------------------------------------------------------------------
# exact resume with pm.rng


def _make(kind: str, seed: int):
    import sptransform

    model = _llama(seed=seed)
    batch = _batches(1)[0]
    if kind == "tp":
        pm = sptransform.parallelize(model, tp=2, example_inputs=batch, seed=seed)
    else:
        pm = sptransform.parallelize(model, tp=1, pp=2, n_microbatches=2, example_inputs=batch, seed=seed)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-4)
    return pm, opt


def _step(kind: str, pm, opt, batch) -> float:
    loss = pm(**batch).loss if kind == "tp" else pm.step(**batch)
    if kind == "tp":
        loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _checkpoint(kind: str, pm, opt) -> dict:
    if kind == "tp":  # the form the issue names: plain state dicts and the Stateful rng
        return {"model": pm.state_dict(), "optim": opt.state_dict(), "rng": pm.rng}
    # pipeline ranks hold different parameters: the optimizer state keyed by name, param_groups per
    # parameter (a plain param_groups list is one object in DCP, saved from one rank only)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(pm, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": model_state, "optim": optim_state, "rng": pm.rng}


def _restore(kind: str, pm, opt, state: dict) -> None:
    if kind == "tp":
        pm.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(pm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))


def _local_params(pm) -> dict:
    return {n: p.to_local().detach().clone() for n, p in pm.named_parameters()}


def _resume_phase(rank: int, world: int, port: int, phase: str, folder: str) -> None:
    """``first``: 3 steps, save, 2 more steps (recorded). ``second`` (new processes, new process
    group, other initial weights and seed): load, the same 2 steps; losses and parameters bit-equal."""
    import torch.distributed.checkpoint as dcp

    _init(rank, world, port, 120)
    try:
        batches = _batches(5)
        for kind in ("tp", "pp"):
            path = os.path.join(folder, f"{kind}-ckpt")
            record = os.path.join(folder, f"{kind}-rank{rank}.pt")
            if phase == "first":
                torch.manual_seed(1000 + rank)
                pm, opt = _make(kind, seed=5)
                for batch in batches[:3]:
                    _step(kind, pm, opt, batch)
                dcp.save(_checkpoint(kind, pm, opt), checkpoint_id=path)
                losses = [_step(kind, pm, opt, batch) for batch in batches[3:]]
                torch.save({"losses": losses, "params": _local_params(pm)}, record)
            else:
                torch.manual_seed(77)  # another torch RNG state: the checkpoint's must replace it
                pm, opt = _make(kind, seed=99)
                for batch in batches[:1]:  # the optimizer has state to load into
                    _step(kind, pm, opt, batch)
                state = _checkpoint(kind, pm, opt)
                dcp.load(state, checkpoint_id=path)
                _restore(kind, pm, opt, state)
                losses = [_step(kind, pm, opt, batch) for batch in batches[3:]]
                expected = torch.load(record)
                assert losses == expected["losses"], (kind, losses, expected["losses"])
                params = _local_params(pm)
                assert params.keys() == expected["params"].keys()
                for name, value in params.items():
                    assert torch.equal(value, expected["params"][name]), (kind, name)
                # control: the same without pm.rng does not continue the run
                pm, opt = _make(kind, seed=99)
                _step(kind, pm, opt, batches[0])
                state = _checkpoint(kind, pm, opt)
                del state["rng"]
                dcp.load(state, checkpoint_id=path)
                _restore(kind, pm, opt, state)
                assert [_step(kind, pm, opt, batch) for batch in batches[3:]] != expected["losses"], kind
                with open(os.path.join(folder, f"{kind}-rank{rank}.ok"), "w") as f:
                    f.write(json.dumps(losses))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_checkpoint_with_rng_resumes_bit_for_bit(tmp_path):
    """tp=2 (ParallelModule, per-rank dropout generators) and pp=2 (PipelinedModule, the default
    generator under tp=1): train 3, save {model, optim, rng}, train 2; fresh processes, a module
    with other weights and another seed, load, train 2: identical losses and parameters."""
    _spawn(_resume_phase, 2, 600, "first", str(tmp_path))
    _spawn(_resume_phase, 2, 600, "second", str(tmp_path))
    for kind in ("tp", "pp"):
        for rank in range(2):
            assert (tmp_path / f"{kind}-rank{rank}.ok").exists(), (kind, rank)


# ---------------------------------------------------------------------------
# data-parallel replicas: grad modes compared, a skipped backward and a killed peer named


def _timed(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
        result = {"raised": None}
    except Exception as err:
        result = {"raised": type(err).__name__, "message": str(err)}
    result["elapsed"] = time.monotonic() - start
    return result


def _replica_faults(rank: int, world: int, port: int, scenario: str, folder: str) -> None:
    """dp=2, tp=1, ``peer_timeout_s=5``. ``skip``: replicas with unequal token counts train like one
    device; a no_grad forward on one replica raises on both; then rank 1 skips a backward and
    calls again, and each rank records what it raised and when. ``kill``: rank 1 dies between its
    forward and backward, and rank 0 records what its backward raised."""
    import signal

    import sys

    import sptransform

    sys.path.insert(0, os.path.dirname(__file__))  # a spawned rank does not have pytest's path
    from test_data_parallel_gloo import _unequal_tokens

    _init(rank, world, port, 120)
    results = {}
    if scenario == "skip":
        results["unequal error"] = _unequal_tokens("llama", tp=1, zero=0, dp_loss="tokens")
    batch = _batches(1)[0]
    pm = sptransform.parallelize(_llama(dropout=0.0), tp=1, dp=2, peer_timeout_s=5, example_inputs=batch)
    pm(**batch).loss.backward()  # in sync
    if scenario == "skip":
        with torch.no_grad() if rank == 1 else contextlib.nullcontext():
            results["no_grad"] = _timed(lambda: pm(**batch))
        pm(**batch).loss.backward()  # still in sync after it
        loss = pm(**batch).loss
        results["skip"] = _timed(loss.backward if rank == 0 else lambda: pm(**batch))
    else:
        loss = pm(**batch).loss
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        results["kill"] = _timed(loss.backward)
    path = os.path.join(folder, f"{scenario}-rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)  # whole when it appears: the test reads it as soon as it does
    end = time.monotonic() + 30  # rank 0's process holds the store: it stays until rank 1 is done
    while rank == 0 and scenario == "skip" and not os.path.exists(os.path.join(folder, "skip-rank1.json")) \
            and time.monotonic() < end:
        time.sleep(0.2)
    os._exit(0)  # a group whose collective failed cannot be torn down cleanly (see above)


def _spawn_until(path, fn, world: int, deadline_s: float, *args) -> None:
    """Spawn ``fn`` (a rank of which is SIGKILLed, which ``_spawn`` reports as a failure at once) and
    wait until ``path`` is written or the deadline passes; then kill what is left."""
    import torch.multiprocessing as mp

    from simulate import free_port

    context = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not path.exists() and time.monotonic() < end:
            time.sleep(0.5)
        assert path.exists(), f"{fn.__name__} wrote no {path.name} within {deadline_s} s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def test_data_parallel_faults_fail_within_the_peer_timeout_naming_the_rank(tmp_path):
    """A skipped backward raises on both replicas within peer_timeout_s (5 s) plus the 5 s grace,
    each naming the other; a killed replica is named by the survivor; a no_grad forward on one
    replica is a ValueError on both at once. Unequal token counts: one device's gradients."""
    _spawn(_replica_faults, 2, 600, "skip", str(tmp_path))  # a hang fails; the machine may be loaded
    _spawn_until(tmp_path / "kill-rank0.json", _replica_faults, 2, 600, "kill", str(tmp_path))
    skip = [json.loads((tmp_path / f"skip-rank{r}.json").read_text()) for r in range(2)]
    assert skip[0]["unequal error"] < 1e-5
    for r in range(2):
        assert skip[r]["no_grad"]["raised"] == "ValueError", skip[r]
        assert "data-parallel ranks [rank 0] vs [rank 1] differ in gradients enabled" in skip[r]["no_grad"]["message"]
        assert skip[r]["skip"]["raised"] == "PeerFailure", skip[r]
        assert skip[r]["skip"]["elapsed"] < 5 + 5 + 10, skip[r]  # the timeout, the grace, slack
    assert "the data-parallel gradient all-reduce" in skip[0]["skip"]["message"]
    assert "rank 1 failed too" in skip[0]["skip"]["message"]
    assert "the previous call's backward did not run" in skip[0]["skip"]["message"]
    assert "waiting for rank 0, which did not arrive" in skip[1]["skip"]["message"]
    kill = json.loads((tmp_path / "kill-rank0.json").read_text())["kill"]
    assert kill["raised"] == "PeerFailure", kill
    assert "rank 1 reported nothing" in kill["message"] and kill["elapsed"] < 5 + 5 + 10, kill
