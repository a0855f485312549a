"""Models built on the meta device: their parameters stay there, their buffers get values.

A model too large for one device is built without memory, ``with torch.device("meta"):``, and
``parallelize`` allocates only each rank's shards. But everything a constructor computes lands
on the meta device too, including buffers that are not weights and that no checkpoint holds:
rotary frequencies (HF ``rotary_emb.inv_freq``), causal masks (nanoGPT's ``attn.bias``), position
ids. ``materialize_meta_buffers`` gives them their values without the user's help:

* it constructs the model again from its config (``type(model)(model.config)``: every HF
  ``PreTrainedModel``, nanoGPT-style models that keep ``self.config``) with **parameters on the
  meta device and buffers computed as usual** (``meta_parameters()``, which moves each parameter
  to meta as it is registered, so the constructor's own code computes the buffers on the CPU),
  checks that the rebuilt model has the same parameter names and shapes (the same architecture),
  and copies the buffers it lacks, cast to the dtype the meta buffer has (``model.to(dtype)``
  casts buffers too). The root is tried first, then submodules that hold a ``config``, from the
  top: rebuilding the whole model reproduces what the user's constructor did, where a submodule
  rebuilt alone may miss what its parent passed to it;
* a buffer it cannot recompute (no config to rebuild from, a constructor that needs more than
  the config, or a model changed after construction) is a ``ValueError`` naming the buffer, why,
  and the two fixes: build the model under ``sptransform.meta_parameters()``, or assign the
  buffer's value before ``parallelize``.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers computed as usual:
    ``with sptransform.meta_parameters(): model = MyModel(config)``. Each parameter is moved to
    meta as it is registered (its initialization then costs nothing); buffers, masks and rotary
    tables, are computed on the current device by the constructor's own code."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        if param is not None and param.device.type != "meta":
            kwargs = dict(param.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            param = type(param)(param.to("meta"), **kwargs)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _meta_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    found = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for buffer_name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.device.type == "meta":
                found.append((f"{module_name}.{buffer_name}" if module_name else buffer_name, module, buffer_name))
    return found


def _shapes(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in module.named_parameters(remove_duplicate=False)]


class _Rebuilder:
    """``type(m)(deepcopy(m.config))`` under ``meta_parameters()``, once per module, kept only when
    the rebuilt module has the same parameter names and shapes."""

    def __init__(self):
        self._built: dict[int, nn.Module | None] = {}
        self.reasons: list[str] = []

    def __call__(self, name: str, module: nn.Module) -> nn.Module | None:
        if id(module) in self._built:
            return self._built[id(module)]
        fresh = None
        label = f"{type(module).__name__}" + (f" ({name})" if name else "")
        config = getattr(module, "config", None)
        if config is not None:
            try:
                with meta_parameters(), torch.device("cpu"):
                    fresh = type(module)(copy.deepcopy(config))
            except Exception as err:  # noqa: BLE001 - any failure means "cannot rebuild this one"
                self.reasons.append(f"{label}(config) raised {type(err).__name__}: {err}")
                fresh = None
            if fresh is not None and _shapes(fresh) != _shapes(module):
                self.reasons.append(f"{label}(config) builds other parameters than the model has (changed after "
                                    "construction?)")
                fresh = None
        self._built[id(module)] = fresh
        return fresh


def materialize_meta_buffers(model: nn.Module, device: torch.device | str = "cpu") -> list[str]:
    """Give every buffer of ``model`` that is on the meta device its value, on ``device``
    (see the module's docstring); parameters are left where they are. Returns the names filled.
    Raises ``ValueError`` naming the buffers it cannot recompute."""
    meta = _meta_buffers(model)
    if not meta:
        return []
    # Candidates from the root down: the whole model rebuilt reproduces its constructor exactly.
    candidates = [(name, module) for name, module in model.named_modules() if getattr(module, "config", None) is not None]
    rebuild = _Rebuilder()
    filled, failed = [], []
    for qualified, owner, buffer_name in meta:
        value = None
        current = owner.get_buffer(buffer_name)
        for candidate_name, candidate in candidates:
            prefix = candidate_name + "." if candidate_name else ""
            if not qualified.startswith(prefix):
                continue
            fresh = rebuild(candidate_name, candidate)
            if fresh is None:
                continue
            try:
                got = fresh.get_buffer(qualified[len(prefix):])
            except AttributeError:
                continue
            if got is None or got.device.type == "meta" or got.shape != current.shape:
                continue
            value = got.to(device=device, dtype=current.dtype)
            break
        if value is None:
            failed.append(qualified)
        else:
            setattr(owner, buffer_name, value)  # keeps the buffer's persistence
            filled.append(qualified)
    if failed:
        why = "; ".join(dict.fromkeys(rebuild.reasons)) or (
            "no module on its path has a `config` to rebuild it from" if not candidates else
            "rebuilding from the config did not produce it")
        raise ValueError(
            f"{'buffer' if len(failed) == 1 else 'buffers'} {', '.join(repr(n) for n in failed)} "
            f"{'is' if len(failed) == 1 else 'are'} on the meta device and sptransform could not "
            f"recompute {'it' if len(failed) == 1 else 'them'} ({why}). Buffers are not weights: no checkpoint holds them. Build the model under "
            "`with sptransform.meta_parameters(): model = ...` (parameters on meta, buffers computed as usual), "
            "or assign the values before parallelize (e.g. `model.get_submodule(path).name = tensor`)"
        )
    return filled


__all__ = ["materialize_meta_buffers", "meta_parameters"]
