"""``generate`` with a KV cache on a parallel module: each rank keeps its heads' keys and values.

Two more forwards of the same module (``capture.Entry``), run by ``ParallelModule._run_entry``
on the shards it holds, captured once per shape:

* **prefill** ``(ids, position_ids, attention_mask) -> (logits, k0, v0, k1, v1, ...)``: the
  prompt, with sequence parallelism where the module has it and tp divides the prompt;
* **decode** ``(ids, position_ids, attention_mask, k0, v0, ...) -> (logits, k0, v0, ...)``: one
  token against a cache of ``slots`` positions, returning the token's own keys and values.

Both are HF's forward with a ``DynamicCache`` built from tensors inside the traced function, so
the graph sees no cache object and no mutation. The keys and values are *split inputs and
outputs* of these graphs: the propagation reads them split by heads (the column-parallel key
and value projections make them so), so each rank stores and is given only its heads, and no
collective ever moves the cache. A model whose K/V heads tp cannot split (one K/V head) reads
its cache whole: each rank then holds all of it (``held_cache_share`` says which).

The cache has a fixed number of slots for a whole call (prompt + new tokens - 1, rounded up to a
multiple of 16 so that calls of about the same lengths share a decode graph): a decode step
appends the new token after the slots (HF concatenates), and the attention mask hides the
slots not yet written; the runtime writes the returned keys and values into their slot. So
one decode graph serves every step, and positions come from ``position_ids``, not from the
cache's length. A model that takes its positions from the cache length instead (rotary
embeddings from ``cache_position``) would decode wrong tokens this way; every call therefore
checks first that a decode step reproduces the prefill's logits at the prompt's last token
(the same token decoded against the cache of the tokens before it), and falls back to
generating without a cache, with a warning, where it does not.
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable, Container

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from sptransform.capture import Entry
from sptransform.logs import logger

log = logger("sptransform.generate")

Run = Callable[[Entry, list, list, Container[int]], list]
"""``ParallelModule._run_entry``: (entry, this rank's flat inputs, the same at whole shapes, outputs
to keep as this rank's part) -> outputs."""


class CacheUnsupported(Exception):
    """This model cannot decode against a cache here; generate without one (the reason is the message)."""


def cache_unsupported_reason(source: nn.Module) -> str | None:
    """Why ``source`` cannot use the KV-cache path (None: it can): an HF causal LM whose forward
    takes ``past_key_values`` and ``position_ids`` and whose ``DynamicCache`` has plain full-attention
    layers only (sliding windows crop the cache, linear attention keeps states instead)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(source, transformers.GenerationMixin):
        return "not an HF GenerationMixin model"
    parameters = inspect.signature(type(source).forward).parameters
    missing = [p for p in ("position_ids", "attention_mask", "use_cache") if p not in parameters]
    if cache_argument(type(source)) is None:
        missing.insert(0, "cache (or past_key_values)")
    if missing:
        return f"its forward takes no {', '.join(missing)}"
    try:
        layers = transformers.DynamicCache(config=source.config).layers
    except Exception as err:  # a config DynamicCache cannot read: no cache path
        return f"DynamicCache(config=...) fails: {type(err).__name__}: {err}"
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not transformers.cache_utils.DynamicLayer})
    if kinds:
        return f"its cache has {', '.join(kinds)} layers (only full-attention DynamicLayer caches are split here)"
    return None


CACHE_ARGUMENTS = ("cache", "past_key_values")
"""What HF forwards call their cache argument (and output field): ``cache`` from transformers 5.2x."""


def cache_argument(cls: type) -> str | None:
    """The name of ``cls.forward``'s cache argument, or None."""
    parameters = inspect.signature(cls.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), None)


def _step_forward(module: nn.Module, ids, position_ids, attention_mask, *cache):
    """The traced function of both entries: HF's forward against ``cache`` (keys and values per
    layer, empty for the prefill), returning the logits and the new tokens' keys and values."""
    from transformers import DynamicCache

    past = DynamicCache(config=module.config)
    for layer in range(len(cache) // 2):
        keys, values = cache[2 * layer], cache[2 * layer + 1]
        past.update(keys[:, :, :0], values[:, :, :0], layer)  # makes the layer (HF's first write, dead after)
        # the given tensors themselves, so that the model's own concatenation is what reads them
        past.layers[layer].keys, past.layers[layer].values = keys, values
    name = cache_argument(type(module))
    out = type(module).forward(module, ids, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=True, **{name: past})
    new = ids.shape[1]
    kv = [t[:, :, -new:] for layer in getattr(out, name).layers for t in (layer.keys, layer.values)]
    return (out.logits, *kv)


KEYS_AND_VALUES = range(1, 1 << 30)
"""The entries' outputs after the logits: every layer's keys and values, however many layers."""


def entries(layers: int, sp: bool) -> tuple[Entry, Entry]:
    """(prefill, decode) for a model of ``layers`` cached layers (``cache_layout``); the decode is given
    each rank's part of the cache, the prefill the empty cache whole (nothing to cut)."""
    outputs = KEYS_AND_VALUES
    prefill = Entry("kv-prefill", _step_forward, split_outputs=outputs, sp=sp)
    decode = Entry("kv-decode", _step_forward, split_inputs=tuple(range(3, 3 + 2 * layers)), split_outputs=outputs,
                   sp=False)
    return prefill, decode


def cache_layout(module: nn.Module, fake_mode, device: torch.device, batch: int) -> list[torch.Tensor]:
    """An empty cache (no positions) at whole shapes, as meta tensors: one key and one value per
    layer, their heads and head size read from a one-token forward of ``module`` (the fake
    template) under ``fake_mode``. The prefill is captured with it, so that its first write is
    a concatenation to a [batch, heads, 0, head size] tensor like every later one."""
    from sptransform.torch_internals import maybe_disable_local_tensor_mode

    name = cache_argument(type(module))
    with maybe_disable_local_tensor_mode(), fake_mode, torch.no_grad():
        out = type(module).forward(module, torch.zeros(batch, 1, dtype=torch.long, device=device), use_cache=True)
        shapes = [(tuple(t.shape), t.dtype) for layer in getattr(out, name).layers for t in (layer.keys, layer.values)]
    return [torch.empty((s[0], s[1], 0, *s[3:]), dtype=dtype, device="meta") for s, dtype in shapes]


SLOTS_MULTIPLE = 16
"""The cache's positions are rounded up to a multiple of this: calls whose prompt and new tokens
differ a little reuse one decode graph (the mask hides the slots never written)."""


def cache_slots(prompt: int, new_tokens: int) -> int:
    """Positions the cache holds for a call: every token but the last generated one, rounded up."""
    needed = prompt + new_tokens - 1
    return -(-needed // SLOTS_MULTIPLE) * SLOTS_MULTIPLE


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


class CachedSteps:
    """Prefill, then one decode step per token, against this rank's part of the cache."""

    def __init__(self, run: Run, empty: list[torch.Tensor], *, sp_multiple: int, mask: torch.Tensor, slots: int,
                 check_rtol: float):
        """``empty``: ``cache_layout``'s empty cache; ``mask``: the prompt's attention mask;
        ``slots``: positions the cache holds (``cache_slots``)."""
        self.run, self.empty, self.mask, self.slots, self.check_rtol = run, empty, mask, slots, check_rtol
        self.layers = len(empty) // 2
        self._prefill, self._decode_entry = entries(self.layers, sp_multiple > 1 and mask.shape[1] % sp_multiple == 0)
        self.cache: list[torch.Tensor] = []  # this rank's keys and values, layer by layer
        self.whole: list[torch.Tensor] = []  # the same at whole shapes (meta)
        self.written = 0  # slots holding keys and values

    def _split_empty(self, device: torch.device) -> list[torch.Tensor]:
        """The empty cache, whole (the parallel module cuts each to the heads this rank reads)."""
        return [torch.empty(t.shape, dtype=t.dtype, device=device) for t in self.empty]

    def held_cache_share(self) -> float:
        """The share of the whole cache's bytes this rank holds."""
        held = sum(t.numel() * t.element_size() for t in self.cache)
        whole = sum(t.numel() * t.element_size() for t in self.whole)
        return held / whole if whole else 1.0

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, vocab] of the prompt's last token; fills the first ``prompt`` slots."""
        mask = self.mask
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        split = self._split_empty(ids.device)
        try:
            out = self.run(self._prefill, [ids, positions, mask, *split],
                           [_meta(ids), _meta(positions), _meta(mask), *self.empty], KEYS_AND_VALUES)
        except ValueError as err:  # not capturable, or needs other splits than the module holds
            raise CacheUnsupported(f"its prefill graph could not be built: {err}") from err
        for local, whole_empty in zip(out[1:], self.empty):
            shape = list(local.shape)
            shape[2] = self.slots
            slot = local.new_zeros(shape)
            slot[:, :, : local.shape[2]] = local
            self.cache.append(slot)
            whole = list(whole_empty.shape)
            whole[2] = self.slots
            self.whole.append(torch.empty(whole, dtype=local.dtype, device="meta"))
        self.written = ids.shape[1]
        log.info("generate: a KV cache of %d layers, %d positions; this rank holds %.3f of its %d bytes", self.layers,
                 self.slots, self.held_cache_share(), sum(t.numel() * t.element_size() for t in self.whole))
        self._prefill_logits = _last(out[0])
        self._last_prompt = ids[:, -1:]
        return self._prefill_logits

    def check(self) -> None:
        """Decode the prompt's last token again against the slots before it and compare with the
        prefill's logits there: a model whose positions do not follow ``position_ids`` (or whose
        cache is not a plain concatenation) differs. Raises ``CacheUnsupported``."""
        try:
            logits = self._decode(self._last_prompt, self.written - 1, write=False)
        except ValueError as err:
            raise CacheUnsupported(f"its decode graph could not be built: {err}") from err
        reference = self._prefill_logits
        error = ((logits - reference).norm() / reference.norm().clamp_min(torch.finfo(reference.dtype).tiny)).item()
        if not error <= self.check_rtol:
            raise CacheUnsupported(
                f"a decode step against the cache gives other logits than the full forward (relative error "
                f"{error:.3g} > {self.check_rtol:g}) at the prompt's last token")

    def decode(self, chosen: torch.Tensor) -> torch.Tensor:
        """Logits [batch, vocab] after ``chosen`` [batch, 1], written into the next slot."""
        return self._decode(chosen, self.written, write=True)

    def _decode(self, ids: torch.Tensor, slot: int, *, write: bool) -> torch.Tensor:
        batch = ids.shape[0]
        user = self.mask
        seen = torch.cat([user, user.new_ones((batch, max(0, slot - user.shape[1])))], dim=1)[:, :slot]
        mask = torch.cat([seen, user.new_zeros((batch, self.slots - slot)), user.new_ones((batch, 1))], dim=1)
        positions = seen.long().sum(-1, keepdim=True)
        whole_ids = [_meta(ids), _meta(positions), _meta(mask)]
        out = self.run(self._decode_entry, [ids, positions, mask, *self.cache], [*whole_ids, *self.whole], KEYS_AND_VALUES)
        if write:
            for cache, new in zip(self.cache, out[1:]):
                cache[:, :, slot] = new[:, :, 0]
            self.written = slot + 1
        return _last(out[0])


def _last(logits) -> torch.Tensor:
    """float32 logits [batch, vocab] of the last position, whole on every rank."""
    last = logits[:, -1]
    if isinstance(last, DTensor):
        last = last.full_tensor()
    return last.to(torch.float32)


def check_tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed between a decode step and the full forward: rounding differs (other
    kernel shapes); a wrong position or mask gives errors of order one."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
