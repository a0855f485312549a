"""Checkpoint recipes round-trip exactly, or raise (issue 20, items 1-3), on real gloo processes.

Three recipes, each saved by a run after 2 AdamW steps and loaded by another that then takes the
next 3 steps, dropout on; the 3 losses must equal (``==``) those of the uninterrupted run:

    plain           {"model": pm.state_dict(), "optim": opt.state_dict(), "rng": pm.rng}
                    -> dcp.load, pm.load_state_dict, opt.load_state_dict
    torch           get_state_dict(pm, opt) -> {"model", "optim", "rng"} -> dcp.load, set_state_dict
    checkpointable  as plain, with sptransform.checkpointable(opt) for the optimizer's entry

for HF GPT-2 (fused ``[q|k|v]`` stored ``_StridedShard``) and HF Llama, from tp=2 into tp=2, from
tp=2 into one device (a plain HF model and AdamW, ``no_dist``) and from dp=2 x tp=2 into tp=2,
into a fresh optimizer and into one that has stepped. Across layouts the generators are not
carried (their number differs): the uninterrupted run is then the destination layout given the
source's state (parameters and moments as whole tensors, ``full_tensor()``, cut with
``distribute_tensor``) and the same generator states. Mixed recipes (GPT-2, saved with one,
loaded with another) either continue exactly or raise. All continue exactly except (``_expected``)
the plain recipe into a fresh optimizer, which cannot restore its state (``opt.state_dict()`` is
empty before the first step): a parallel module warns; and torch's recipe mixed with another
(names vs indices as keys): DCP raises.

One spawn of 4 ranks runs every distributed case (tp=2 runs as two replicas on a 2 x 2 mesh; the
tp=2 source is then the destination of every case, which loads all of its state); each rank
writes what every case gave, and the test reads it.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from simulate import spawn_with_deadline as _spawn

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 128, 16, 4
KINDS = ("gpt2", "llama")
RECIPES = ("plain", "torch", "checkpointable")
TARGETS = ("fresh", "stepped")
MIXED = (("checkpointable", "plain"), ("plain", "checkpointable"), ("torch", "plain"), ("plain", "torch"))
LR = 1e-2


def _errors() -> tuple:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    return (Exception, CheckpointException)


_ERRORS = _errors()


def _model(kind: str, seed: int):
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                         attn_implementation="eager", resid_pdrop=0.1, embd_pdrop=0.1,
                                         attn_pdrop=0.1)
        return transformers.GPT2LMHeadModel(config).train()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                                      max_position_embeddings=64, attention_dropout=0.1,
                                      attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).train()


def _batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append(dict(input_ids=ids, labels=ids))
    return out


def _dp_slice(batch: dict, dp_rank: int, dp: int) -> dict:
    size = BATCH // dp
    return {k: v[dp_rank * size:(dp_rank + 1) * size] for k, v in batch.items()}


def _optimizer(module):
    return torch.optim.AdamW(module.parameters(), lr=LR, foreach=True)  # fewer DTensor dispatches


def _step(module, opt, batch: dict) -> float:
    loss = module(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


# ---------------------------------------------------------------------------
# the recipes, as a user writes them


def _state(recipe: str, module, opt, *, rng: bool) -> dict:
    """What a user hands to ``dcp.save`` / ``dcp.load`` (the same dict for both)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import sptransform

    if recipe == "torch":
        model_state, optim_state = get_state_dict(module, opt)
        state = {"model": model_state, "optim": optim_state}
    elif recipe == "checkpointable":
        state = {"model": module.state_dict(), "optim": sptransform.checkpointable(opt)}
    else:
        state = {"model": module.state_dict(), "optim": opt.state_dict()}
    if rng:
        state["rng"] = module.rng
    return state


def _save(recipe: str, module, opt, path: str, *, rng: bool) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(recipe, module, opt, rng=rng), checkpoint_id=path)


def _load(recipe: str, module, opt, path: str, *, rng: bool, no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(recipe, module, opt, rng=rng)
    dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    if recipe == "torch":
        set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])


# ---------------------------------------------------------------------------
# the trusted path: whole tensors


def _whole_state(module, opt) -> dict:
    """Parameters and AdamW state as whole tensors, by name (collective: ``full_tensor()``)."""
    # clone: full_tensor() of a replicated DTensor is its local tensor, which the next steps change
    whole = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()  # noqa: E731
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        "params": {n: whole(p.detach()) for n, p in module.named_parameters()},
        "optim": {names[id(p)]: {k: whole(v) for k, v in s.items()} for p, s in opt.state.items()},
    }


def _set_whole_state(module, opt, whole: dict) -> None:
    """Give ``module`` and ``opt`` the whole tensors of ``_whole_state``, each rank cutting its shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    module.load_state_dict(whole["params"], strict=False)
    opt.state.clear()
    for name, p in module.named_parameters():
        entry = {}
        for key, value in whole["optim"][name].items():
            if isinstance(p, DTensor) and key != "step":
                value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
            entry[key] = value.clone() if not isinstance(value, DTensor) else value
        opt.state[p] = entry


# ---------------------------------------------------------------------------
# the ranks


class _Outcomes:
    """What each case gave: ``"exact"``, ``"raised: ..."`` or how the losses differ."""

    def __init__(self):
        self.results: dict[str, str] = {}

    def run(self, case: str, expected: list[float], resume) -> None:
        self.results[case] = _outcome(resume, expected)


def _outcome(resume, expected: list[float]) -> str:
    """``"exact"``, ``"raised: ..."``, or how the losses differ, after ``"warned: "`` when
    sptransform warned that the optimizer's state was not restored."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            losses = resume()
        except _ERRORS as err:  # recorded: a recipe that raises is an outcome
            return f"raised: {type(err).__name__}: {err}"[:600]
    warned = any("no state for them" in str(w.message) for w in caught)
    return ("warned: " if warned else "") + _compare(losses, expected)


def _compare(losses: list[float], expected: list[float]) -> str:
    if losses == expected:
        return "exact"
    return f"differs: max |diff| {max(abs(a - b) for a, b in zip(losses, expected)):.3g} ({losses} vs {expected})"


def _checkpoints_generators() -> None:
    """Same layout: the generators are the checkpoint's (``pm.rng`` is in the recipe)."""


def _resume(module, target: str, recipe: str, path: str, batches: list[dict], *, rng: bool, reseed,
            whole=None, no_dist: bool = False) -> list[float]:
    """Resume on ``module``: a fresh optimizer, or one that has stepped (on other weights and
    another batch), loaded by ``recipe`` (or given ``whole``); ``reseed()`` (generators not carried
    across layouts); then the 3 steps."""
    opt = _optimizer(module)
    if target == "stepped":
        _step(module, opt, batches[-1])
    if whole is not None:
        _set_whole_state(module, opt, whole)
    else:
        _load(recipe, module, opt, path, rng=rng, no_dist=no_dist)
    reseed()
    return [_step(module, opt, b) for b in batches[2:5]]


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import sptransform

    torch.set_num_threads(1)  # ranks share two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    outcomes, timings = _Outcomes(), {}
    try:
        replicas = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # tp=2, twice
        batches = _batches(6)
        dp_rank = rank // 2
        for kind in KINDS:
            start = time.monotonic()
            example = _batches(1)[0]
            tp2 = lambda seed: sptransform.parallelize(  # noqa: E731
                _model(kind, seed), tp=2, mesh=replicas["tp"], example_inputs=example, seed=7)
            # sources: 2 steps, save by every recipe, 3 more steps (the uninterrupted run); the tp=2
            # one is then every case's destination (each case loads all of its state)
            expected = {}
            for source in ("dp2tp2", "tp2"):
                if source == "tp2":
                    pm, batch_of = tp2(0), (lambda b: b)
                    snapshot = pm.rng.state_dict()  # its fresh generators' states (copies)
                else:
                    pm = sptransform.parallelize(_model(kind, 0), tp=2, dp=2, example_inputs=_dp_slice(example, 0, 2),
                                                 seed=7)
                    batch_of = lambda b: _dp_slice(b, dp_rank, 2)  # noqa: E731
                torch.manual_seed(5)
                opt = _optimizer(pm)
                for b in batches[:2]:
                    _step(pm, opt, batch_of(b))
                for recipe in RECIPES:
                    _save(recipe, pm, opt, os.path.join(folder, kind, source, recipe), rng=source == "tp2")
                whole = _whole_state(pm, opt)
                if rank == 0 and source == "tp2":
                    torch.save(whole, os.path.join(folder, f"{kind}-{source}-whole.pt"))
                expected[source] = [_step(pm, opt, batch_of(b)) for b in batches[2:5]]
                if source == "dp2tp2":
                    expected_whole = whole
                    del pm, opt
            for target in TARGETS:
                for recipe in RECIPES:
                    path = os.path.join(folder, kind, "tp2", recipe)
                    outcomes.run(f"{kind}: {recipe}, tp2 -> tp2, {target} optimizer", expected["tp2"],
                                 lambda: _resume(pm, target, recipe, path, batches, rng=True, reseed=_checkpoints_generators))
                for saved_by, loaded_by in MIXED if (kind, target) == ("gpt2", "stepped") else ():
                    path = os.path.join(folder, kind, "tp2", saved_by)
                    outcomes.run(f"{kind}: saved {saved_by}, loaded {loaded_by}, tp2 -> tp2, {target} optimizer",
                                 expected["tp2"],
                                 lambda: _resume(pm, target, loaded_by, path, batches, rng=True, reseed=_checkpoints_generators))
            # dp2 x tp2 -> tp2: the uninterrupted run is tp2 given the whole state
            reseed = lambda: pm.rng.load_state_dict(snapshot)  # noqa: E731
            reference = _resume(pm, "fresh", "", "", batches, rng=False, reseed=reseed, whole=expected_whole)
            outcomes.results[f"{kind}: reference dp2tp2 -> tp2 losses"] = json.dumps(reference)
            for target in TARGETS:
                for recipe in RECIPES:
                    path = os.path.join(folder, kind, "dp2tp2", recipe)
                    outcomes.run(f"{kind}: {recipe}, dp2tp2 -> tp2, {target} optimizer", reference,
                                 lambda: _resume(pm, target, recipe, path, batches, rng=False, reseed=reseed))
            outcomes.results[f"{kind}: expected tp2 losses"] = json.dumps(expected["tp2"])
            timings[kind] = time.monotonic() - start
        dist.barrier()  # rank 0 has written the whole states
        start = time.monotonic()
        outcomes.results.update(_single_device_cases(folder, KINDS[rank // 2], TARGETS[rank % 2]))
        timings["one device"] = time.monotonic() - start
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump({"results": outcomes.results, "timings": timings}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# into one device


def _single_device_cases(folder: str, kind: str, target: str) -> dict[str, str]:
    """tp=2 -> one device: a plain HF model and AdamW (no generators carried: the same seed),
    loaded without the process group (``no_dist``); each rank runs one (kind, target)."""
    batches, results = _batches(6), {}
    reseed = lambda: torch.manual_seed(9)  # noqa: E731
    whole = torch.load(os.path.join(folder, f"{kind}-tp2-whole.pt"))
    reference = _resume(_model(kind, 3), "fresh", "", "", batches, rng=False, reseed=reseed, whole=whole)
    for recipe in RECIPES:
        path = os.path.join(folder, kind, "tp2", recipe)
        results[f"{kind}: {recipe}, tp2 -> one device, {target} optimizer"] = _outcome(
            lambda: _resume(_model(kind, 3), target, recipe, path, batches, rng=False, reseed=reseed,
                            no_dist=True), reference)
    return results


def _collect(folder) -> tuple[dict[str, str], dict]:
    results, timings = {}, {}
    for rank in range(4):
        with open(os.path.join(folder, f"rank{rank}.json")) as f:
            report = json.load(f)
        timings[rank] = report["timings"]
        for case, outcome in report["results"].items():
            if results.setdefault(case, outcome) != outcome and "losses" not in case:
                results[f"{case} (rank {rank})"] = outcome
    return results, timings


def test_checkpoint_recipes_round_trip_exactly_or_raise(tmp_path):
    start = time.monotonic()
    _spawn(_worker, 4, 300, str(tmp_path))
    spawned = time.monotonic() - start
    results, timings = _collect(tmp_path)
    print(json.dumps(timings), f"spawn {spawned:.1f} s")
    for case, outcome in results.items():
        print(f"{case}: {outcome}")
    cases = {c: o for c, o in results.items() if "losses" not in c}
    assert len(cases) == len(KINDS) * 3 * len(RECIPES) * len(TARGETS) + len(MIXED), sorted(cases)
    bad = {c: o for c, o in cases.items() if not o.startswith(_expected(c))}
    assert not bad, "\n".join(f"{c}: {o} (expected {_expected(c)})" for c, o in bad.items())


def _expected(case: str) -> str:
    """Every recipe continues exactly, except:
    - the plain recipe into a fresh optimizer: its ``opt.state_dict()`` is empty, so nothing of the
      optimizer is restored; a parallel module warns at the first step (on one device this is
      torch's own behaviour, nothing of sptransform's runs);
    - torch's recipe mixed with another: its keys are names, theirs are indices; DCP raises."""
    if ("saved torch" in case) != ("loaded torch" in case):
        return "raised: CheckpointException"
    if case.startswith(tuple(f"{k}: plain," for k in KINDS)) and "fresh" in case:
        return "differs" if "one device" in case else "warned: differs"
    return "exact"
