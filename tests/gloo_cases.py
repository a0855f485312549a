"""Models by name for the gloo tests that train several of them in one spawn: a zoo entry
(float64) or a transformers family shrunk as ``tools/sweep_transformers.py`` shrinks it (float32),
and the worker that parallelizes each, checks the share of parameter bytes a rank holds and trains
it beside the original."""

from __future__ import annotations

import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist

from simulate import train_like_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from models import zoo  # noqa: E402


def model_for(name: str):
    """``(model, batch, (loss and gradient tolerance, parameter tolerance))`` for ``name``."""
    if name in zoo.ZOO:
        model, (idx, targets) = zoo.build(name)
        return model.double(), {"idx": idx, "targets": targets}, (1e-9, 1e-11)
    import sweep_transformers as sweep  # each family shrunk as the sweep shrinks it

    classes = {entry["model_type"]: entry["class"] for entry in sweep.families([name])}
    model, _, _ = sweep.build(name, classes[name], sweep.Target())
    torch.manual_seed(1)
    batch = dict(input_ids=torch.randint(0, 128, (2, 16)), labels=torch.randint(0, 128, (2, 16)))
    return model, batch, (1e-4, 1e-5)


def train_cases(rank: int, world: int, port: int, cases) -> None:
    """Each case of ``cases`` (``(name, sp, bound)``, or ``(name, sp, bound, "eval")`` for a model
    whose dropout the ranks cannot draw as one device does: trained in eval() mode) parallelized at tp=``world``, its
    held share checked against its bound, then trained 3 AdamW steps beside the original (also
    run by other gloo tests)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        import sptransform

        for name, sp, bound, *mode in cases:  # mode: ("eval",) for a model with dropout
            if name not in zoo.ZOO and not has_transformers():
                continue
            model, batch, close = model_for(name)
            if mode == ["eval"]:
                model.eval()
            ref = copy.deepcopy(model)
            pm = sptransform.parallelize(model, tp=world, sp=sp, example_inputs=batch)
            what = f"{name} sp={sp} "
            if rank == 0:  # the figure the README quotes (pytest -s shows it)
                print(f"{what}: each rank holds {pm.held_share():.3f} of the parameter bytes at tp={world}")
            assert pm.held_share() <= bound, f"{what}: each rank holds {pm.held_share():.3f}\n{pm.explain()}"
            # float32: AdamW's step of 1e-3 normalizes a near-zero gradient's float32 noise, so a
            # parameter may move up to a few percent of one step apart (1.3e-5 seen on OLMo-2);
            # a wrong gradient moves it by the whole step
            params_tol = close if close[1] < 1e-9 else (close[0], 5e-5)
            train_like_reference(pm, ref, [batch] * 3, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                                 loss_tol=close, grad_tol=close, params_tol=params_tol, step_after_last=False,
                                 what=what)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def split_on_simulated_ranks(name: str, held: float, linears: tuple[int, int]) -> None:
    """The fast lane's check of a zoo model: float64 equal at tp=2 + SP on simulated ranks, each
    rank holding at most ``held`` of the parameter bytes, ``linears`` (split, all) as given."""
    import sptransform

    model, batch, _ = model_for(name)
    report = sptransform.verify(model, tp=2, sp=True, example_inputs=batch, processes=False, rtol=1e-9)
    assert report.status == "equal", report
    assert report.held_share <= held, report
    assert report.linears == linears, report
