"""Scripts that parallelize on 2 gloo ranks and end with ``dist.destroy_process_group()`` exit
with code 0, every time: the README job (``examples/train_gpt2.py``, shortened), a Llama built
on the meta device and filled by ``sptransform.load_hf_weights``, and a tied-head model trained
one step. Each runs ``RUNS`` times; one abort fails the test.

The abort this guards against (``terminate called without an active exception``, SIGABRT, on
one rank now and then): a gloo process group that outlived ``destroy_process_group`` (its
device mesh held it, and DTensor's caches hold every mesh until the interpreter ends) kept its
worker threads; a worker that releases a finished collective's tensors takes the GIL, and if it
does so while the interpreter finalizes, Python ends the thread inside a C++ destructor. That
is a race, so besides the exit codes each rank checks the cause directly: once its job has
called ``destroy_process_group``, no gloo thread may be left in the process (exit code 3).

Each run is a real pair of processes that ends the way a script does, through interpreter
finalization. Starting Python and importing torch, sptransform and transformers costs seconds
per process, so one driver process (``python this_file.py FOLDER REPORT``) imports them once
and forks both ranks of every run; a rank runs its job and then falls off the end of the
driver's main module, so its interpreter finalizes exactly as a script's does. The driver
freezes what it imported (``gc.freeze()``), so the ranks' garbage collections skip it.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

KINDS = ("train_gpt2", "meta_llama", "tied_head")
RUNS = 3  # the cause is checked directly on every rank (no gloo thread left), not only the symptom
RUN_DEADLINE_S = 60.0
TOTAL_DEADLINE_S = 600.0  # a hang guard: the whole test took about 210 CPU-seconds with 10 runs per job
ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------
# the test (pytest process)


@pytest.mark.slow
def test_parallel_scripts_exit_cleanly_every_time(tmp_path):
    """Each script runs RUNS times on 2 gloo ranks; every rank of every run exits with code 0."""
    pytest.importorskip("transformers")
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    driver = subprocess.Popen([sys.executable, __file__, str(tmp_path), str(report)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = driver.communicate(timeout=TOTAL_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and every rank it forked
        output, _ = driver.communicate()
        pytest.fail(f"the runs did not finish within {TOTAL_DEADLINE_S} s:\n{output[-3000:]}")
    assert driver.returncode == 0, f"driver failed ({driver.returncode}):\n{output[-3000:]}"
    results = json.loads(report.read_text())
    failed = [r for r in results if r["codes"] != [0, 0]]
    detail = "\n".join(f"{r['kind']} run {r['run']}: exit codes {r['codes']}\n{r['tail']}" for r in failed[:3])
    assert not failed, f"{len(failed)} of {len(results)} runs did not exit cleanly:\n{detail}"
    assert sorted({r["kind"] for r in results}) == sorted(KINDS) and len(results) == RUNS * len(KINDS)
    print(f"{len(results)} runs in {time.monotonic() - start:.0f} s: "
          + ", ".join(f"{k} {sum(r['seconds'] for r in results if r['kind'] == k):.0f} s" for k in KINDS))


# ---------------------------------------------------------------------------
# the driver (its own process): runs every job RUNS times, two forked ranks each


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_code(status: int) -> int:
    """As subprocess reports it: the exit status, or minus the signal that ended the process."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _fork_runs(folder: pathlib.Path, report: pathlib.Path, kinds=KINDS, runs=RUNS):
    """In the driver: fork both ranks of each run, wait for them (killing them past the
    deadline), write the report, return None. In a forked rank: return its job."""
    results = []
    for kind in kinds:
        for run in range(runs):
            port, pids, logs = _free_port(), [], []
            begin = time.monotonic()
            for rank in range(2):
                log = folder / f"{kind}.{run}.rank{rank}.log"
                pid = os.fork()
                if pid == 0:
                    return kind, rank, port, log
                pids.append(pid)
                logs.append(log)
            codes = [_wait(pid, begin + RUN_DEADLINE_S) for pid in pids]
            tail = "" if codes == [0, 0] else "\n".join(log.read_text()[-1500:] for log in logs if log.exists())
            results.append({"kind": kind, "run": run, "codes": codes, "seconds": time.monotonic() - begin,
                            "tail": tail})
    report.write_text(json.dumps(results))
    return None


def _wait(pid: int, deadline: float) -> int:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return _exit_code(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.05)


def _run_rank(kind: str, rank: int, port: int, log: pathlib.Path, folder: pathlib.Path) -> None:
    """One rank of one run, its output in ``log``. An exception ends the rank as it ends a script
    (traceback, exit code 1); a gloo thread left after the job is exit code 3."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    import torch

    torch.set_num_threads(1)  # the ranks share two cores
    JOBS[kind](folder)
    left = _gloo_threads()
    if left:
        print(f"gloo threads still running after destroy_process_group: {left}", flush=True)
        os._exit(3)


def _gloo_threads() -> list[str]:
    """The names of this process's gloo threads (worker loops ``pt_gloo_runloop``, the transport's
    ``gloo_tcp_loop``); none where /proc is missing."""
    tasks = pathlib.Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()] if tasks.exists() else []
    return [name for name in names if "gloo" in name]


def _init():
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RUN_DEADLINE_S))


def _train_gpt2(folder: pathlib.Path) -> None:
    """The README job as torchrun runs it (RANK set), shortened: 2 steps of a 1-layer, 32-wide GPT-2."""
    from examples import train_gpt2

    train_gpt2.main(["--steps", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16",
                     "--batch", "2"])


def _llama_config():
    import transformers

    return transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=64, vocab_size=64, max_position_embeddings=32)


def _meta_llama(folder: pathlib.Path) -> None:
    """A Llama built on the meta device, parallelized, filled by load_hf_weights, one loss."""
    import torch
    import torch.distributed as dist
    import transformers

    import sptransform

    _init()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_llama_config())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    pm = sptransform.parallelize(model.eval(), tp=2, example_inputs={"input_ids": ids, "labels": ids})
    sptransform.load_hf_weights(pm, folder / "llama")
    loss = pm(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss), loss
    dist.destroy_process_group()


def _tied_head(folder: pathlib.Path) -> None:
    """A tied-head model (hand-written: the reported script used x-transformers, which CI does not
    install) trained one step on 2 ranks; the unmodified copy's gradients are taken with
    ``torch.autograd.grad(..., retain_graph=True)``, as that script did."""
    import copy

    import torch
    import torch.distributed as dist
    from tiny_models import TinyConfig, TinyLM

    import sptransform

    _init()
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(vocab=61, hidden=32, heads=4, layers=1, ffn=64, tied=True))
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 61, (2, 16), generator=g), torch.randint(0, 61, (2, 16), generator=g)
    pm = sptransform.parallelize(copy.deepcopy(model), tp=2, example_inputs=(ids, labels))
    reference = model(ids, labels)
    torch.autograd.grad(reference, list(model.parameters()), retain_graph=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    loss = pm(ids, labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert torch.isfinite(loss.detach()), loss
    dist.destroy_process_group()


JOBS = {"train_gpt2": _train_gpt2, "meta_llama": _meta_llama, "tied_head": _tied_head}


def _save_llama(folder: pathlib.Path) -> None:
    """The checkpoint meta_llama loads, written by a child so the driver itself runs no torch op
    (its forks then inherit no thread pool)."""
    pid = os.fork()
    if pid == 0:
        import torch
        import transformers

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(_llama_config()).save_pretrained(str(folder / "llama"))
        os._exit(0)
    assert _wait(pid, time.monotonic() + RUN_DEADLINE_S) == 0, "writing the Llama checkpoint failed"


if __name__ == "__main__":
    import gc

    sys.path.insert(0, str(ROOT / "tests"))  # tiny_models
    import tiny_models  # noqa: F401  (everything imported once, before the forks)
    import torch  # noqa: F401
    import tqdm  # noqa: F401
    from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401

    import sptransform  # noqa: F401
    from examples import train_gpt2  # noqa: F401

    folder, report = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    gc.freeze()  # as pre-fork servers do: the ranks' collections skip everything imported (2.5x less CPU)
    _save_llama(folder)
    # optional: a subset of the jobs and fewer runs (for investigating), e.g. `tied_head 3`
    kinds = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else KINDS
    job = _fork_runs(folder, report, kinds, int(sys.argv[4]) if len(sys.argv) > 4 else RUNS)
    if job is not None:  # a forked rank: run the job, then finalize like any script's interpreter
        _run_rank(*job, folder)
