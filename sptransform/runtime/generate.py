"""Token generation from a causal language model: ``pm.generate`` and ``sptransform.generate``.

Two ways to run the steps, the same token choice:

* **with a KV cache** (a parallel module of an HF causal LM, ``use_cache=True``, the default):
  ``runtime.kv_cache``: a prefill graph on the prompt, then one decode graph per token against
  each rank's part of the cache (split by heads, never gathered). Every call first checks that a
  decode step reproduces the prefill's logits; a model for which it does not, or that the cache
  path does not apply to (no ``past_key_values``, sliding-window or linear-attention caches),
  generates the second way, with a warning where the check failed;
* **without a cache**: every step runs the model on the whole sequence so far, padded at its
  end to one length for the whole call (prompt + ``max_new_tokens``, rounded up to a multiple of
  ``multiple``: tp under sequence parallelism), so every step has the same input signature and a
  parallel module captures one graph per call shape, not one per length. A causal model's
  logits at a position do not read the positions after it, so the padding changes nothing; the
  first step checks that (it runs twice with two different padding tokens, and the two logits
  must be equal bit for bit): a model that reads later positions, or draws dropout masks,
  raises instead of generating tokens the single-device model would not.

Token choice follows HF ``GenerationMixin.generate`` (transformers 5): the last position's
logits cast to float32, then for sampling temperature, top-k and top-p as its warpers apply
them, ``torch.multinomial`` from the default generator; ended rows get ``pad_token_id``.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from sptransform.logs import logger
from sptransform.options import GenerateOptions
from sptransform.runtime.kv_cache import (
    CachedSteps, CacheUnsupported, Run, cache_slots, cache_unsupported_reason, check_tolerance,
)

log = logger("sptransform.generate")

GENERATE_KWARGS = ("attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
                   "eos_token_id", "pad_token_id", "use_cache", "generation_config")
"""The keywords ``generate`` takes besides the token ids."""

HF_DEFAULTS = (("max_length", 20), ("do_sample", False), ("temperature", 1.0), ("top_k", 50), ("top_p", 1.0))
"""HF's global defaults (``GenerationConfig._get_default_generation_params``) for what a model's
``generation_config`` leaves unset."""

UNSUPPORTED_WHEN = (
    ("num_beams", 1), ("num_return_sequences", 1), ("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0),
    ("min_length", 0), ("min_new_tokens", None), ("bad_words_ids", None), ("suppress_tokens", None),
    ("begin_suppress_tokens", None), ("forced_bos_token_id", None), ("forced_eos_token_id", None), ("min_p", None),
    ("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0), ("top_h", None), ("sequence_bias", None),
    ("exponential_decay_length_penalty", None), ("guidance_scale", None), ("watermarking_config", None),
    ("stop_strings", None), ("max_time", None), ("penalty_alpha", None), ("return_dict_in_generate", False),
    ("renormalize_logits", False), ("assistant_model", None), ("prompt_lookup_num_tokens", None),
)
"""HF generation settings this path does not implement, each with the value (or HF's unset
value) that turns it off; any other value raises instead of being ignored. Pairs, not a dict:
``runtime/`` keeps no module-level mutable state (tests/runtime/test_isolation.py)."""

Agree = Callable[[torch.Tensor], torch.Tensor]
"""Makes every tensor-parallel rank hold rank 0's tokens (the identity on one device)."""


class OriginalClassMethodError(AttributeError, TypeError):
    """An HF ``GenerationMixin`` attribute asked of a parallel module: ``GPT2LMHeadModel.generate(pm, ...)``
    runs HF's generate with a ``self`` that is not an instance of the class. An ``AttributeError``
    so that ``hasattr`` stays False, a ``TypeError`` for what it means (the wrong ``self``)."""


GENERATION_INSTANCE_ATTRIBUTES = ("config", "generation_config", "device", "dtype", "main_input_name")
"""What HF's generate reads of a model's instance besides ``GenerationMixin``'s own methods."""


def original_class_error(original: type, holder: str, name: str) -> AttributeError | None:
    """The error for ``name`` missing on a ``holder`` standing in for an ``original`` HF model,
    when ``name`` is something HF's ``GenerationMixin.generate`` reads of its ``self``; None otherwise.

    HF's generate called through the original class does not run on a parallel module: it
    drives the model through its own cache objects and many mixin methods, whose use differs
    between transformers versions and models. Rather than imitate a moving subset of them (and
    risk tokens that are not the model's), the call stops at the first one, naming the path that
    works."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not issubclass(original, transformers.GenerationMixin):
        return None
    if not hasattr(transformers.GenerationMixin, name) and name not in GENERATION_INSTANCE_ATTRIBUTES:
        return None
    return OriginalClassMethodError(
        f"{holder!r} has no attribute {name!r}: it stands in for {original.__name__} but is not an instance of "
        f"it, so HF's generate called through the original class ({original.__name__}.generate(pm, ...) or "
        "GenerationMixin.generate(pm, ...)) cannot run on it; generate with pm.generate(ids, ...) or "
        "sptransform.generate(pm, ids, ...)"
    )


def hf_generation_config(source: nn.Module):
    """The model's HF ``GenerationConfig``, or None for a module without HF's mixin."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(source, transformers.GenerationMixin):
        return None
    return source.generation_config


def resolve_options(source: nn.Module, kwargs: Mapping[str, Any], prompt_length: int) -> GenerateOptions:
    """The call's keywords, then the model's ``generation_config``, then HF's defaults (a module
    without HF's mixin: the call's keywords, then ``GenerateOptions``' defaults)."""
    unknown = sorted(set(kwargs) - set(GENERATE_KWARGS) - {"attention_mask"})
    if unknown:
        raise TypeError(
            f"generate() got unsupported keyword(s) {unknown}: sptransform's generate takes {list(GENERATE_KWARGS)} "
            "(greedy or sampled decoding of a causal LM); beams, penalties and streamers are not implemented"
        )
    config = kwargs.get("generation_config") or hf_generation_config(source)
    given = {k: v for k, v in kwargs.items() if k not in ("generation_config", "attention_mask") and v is not None}
    if config is None:
        if "max_new_tokens" not in given:
            raise TypeError("generate() needs max_new_tokens= for a model without HF's generation_config")
        fields = given
    else:
        settings = config.to_dict()
        for name, off in UNSUPPORTED_WHEN:
            if settings.get(name) is not None and settings.get(name) != off:
                raise ValueError(
                    f"generation_config.{name}={settings[name]!r} is not supported by sptransform's generate (greedy "
                    f"and sampled decoding only): set it to {off!r} (e.g. generation_config=GenerationConfig(...))"
                )
        defaults = dict(HF_DEFAULTS)
        fields = {k: settings[k] if settings.get(k) is not None else defaults[k]
                  for k in ("do_sample", "temperature", "top_k", "top_p")}
        for k in ("eos_token_id", "pad_token_id", "max_new_tokens", "use_cache"):
            if settings.get(k) is not None:
                fields[k] = settings[k]
        fields.update(given)
        if "max_new_tokens" not in fields:  # HF: max_length counts the prompt
            fields["max_new_tokens"] = (settings.get("max_length") or defaults["max_length"]) - prompt_length
    eos = fields.get("eos_token_id")
    fields["eos_token_id"] = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    if fields.get("pad_token_id") is None and fields["eos_token_id"]:
        fields["pad_token_id"] = fields["eos_token_id"][0]  # as HF does, with its warning
    return GenerateOptions(**fields)


def _check_tokens(input_ids, attention_mask) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"generate() takes token ids as an integer tensor [batch, length], got {shape}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
        raise ValueError(f"attention_mask {shape} must be a tensor shaped like input_ids {tuple(input_ids.shape)}: "
                         "1 for tokens, 0 for (left) padding")


def _logits(output) -> torch.Tensor:
    """The logits among a forward's outputs: the tensor itself, HF's ``.logits``, or the first
    element of a tuple; each [batch, length, vocab]."""
    if isinstance(output, Mapping) and "logits" in output:
        output = output["logits"]
    elif isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor) or output.dim() != 3:
        raise TypeError(
            "generate() needs a forward that returns logits [batch, length, vocab] (a tensor, HF's output with "
            f".logits, or a tuple that starts with them), got {type(output).__name__}"
        )
    return output


def _last_logits(output, position: int) -> torch.Tensor:
    """float32 logits [batch, vocab] at ``position``, whole on every rank (a vocabulary-split
    DTensor is sliced first, so only [batch, vocab] is gathered)."""
    logits = _logits(output)[:, position]
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return logits.to(torch.float32)


def _warp(scores: torch.Tensor, options: GenerateOptions) -> torch.Tensor:
    """HF's TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in its order."""
    if options.temperature != 1.0:
        scores = scores / options.temperature
    if options.top_k:
        k = min(options.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if options.top_p < 1.0:
        ordered, indices = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - options.top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, indices, remove), -float("inf"))
    return scores


def _choose(scores: torch.Tensor, options: GenerateOptions) -> torch.Tensor:
    if not options.do_sample:
        return torch.argmax(scores, dim=-1)
    return torch.multinomial(_warp(scores, options).softmax(dim=-1), num_samples=1).squeeze(1)


class _Padded:
    """Steps without a cache: the tokens so far, padded at the end to ``length``, run whole."""

    def __init__(self, model: nn.Module, source: nn.Module, attention_mask, length: int, prompt: int):
        parameters = inspect.signature(source.forward).parameters
        if attention_mask is not None and "attention_mask" not in parameters:
            raise ValueError(
                f"attention_mask was given, but {type(source).__name__}.forward takes no attention_mask: pass the "
                "prompts unpadded (one length per call), or use a model that takes a mask"
            )
        self.model, self.length, self.prompt = model, length, prompt
        self.mask = attention_mask
        self.positions = "position_ids" in parameters

    def inputs(self, tokens: torch.Tensor, fill: int) -> tuple[tuple, dict]:
        batch, current = tokens.shape
        tail = self.length - current
        ids = torch.cat([tokens, tokens.new_full((batch, tail), fill)], dim=1)
        kwargs: dict[str, torch.Tensor] = {}
        if self.mask is not None:
            generated = self.mask.new_ones((batch, current - self.mask.shape[1]))
            mask = torch.cat([self.mask, generated, self.mask.new_zeros((batch, tail))], dim=1)
            kwargs["attention_mask"] = mask
            if self.positions:  # HF's positions under a (left-padded) mask
                kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        elif self.positions:  # 0..current-1, then 0 for the padding (which nothing before it reads)
            positions = torch.arange(self.length, device=tokens.device).masked_fill(
                torch.arange(self.length, device=tokens.device) >= current, 0)
            kwargs["position_ids"] = positions.unsqueeze(0).expand(batch, -1)
        return (ids,), kwargs

    def scores(self, tokens: torch.Tensor) -> torch.Tensor:
        position = tokens.shape[1] - 1
        args, kwargs = self.inputs(tokens, fill=0)
        scores = _last_logits(self.model(*args, **kwargs), position)
        if position == self.prompt - 1:  # the first step
            args, kwargs = self.inputs(tokens, fill=1)
            _check_causal(scores, _last_logits(self.model(*args, **kwargs), position))
        return scores


class _Cached:
    """Steps with each rank's part of a KV cache (``runtime.kv_cache.CachedSteps``)."""

    def __init__(self, steps: CachedSteps):
        self.steps = steps

    def scores(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.steps.written == 0:
            scores = self.steps.prefill(tokens)
            self.steps.check()
            return scores
        return self.steps.decode(tokens[:, -1:])


def _check_causal(first: torch.Tensor, second: torch.Tensor) -> None:
    if not torch.equal(first, second):
        raise ValueError(
            "generate() pads every step's sequence at its end and relies on the model being causal (logits at a "
            "position read no later position), but the last prompt token's logits changed with the padding "
            "after it: the model reads later positions, or draws dropout masks (call .eval() first). "
            "Generate with a causal language model in eval mode"
        )


@torch.no_grad()
def generate_tokens(model: nn.Module, input_ids: torch.Tensor, *, source: nn.Module, multiple: int = 1,
                    agree: Agree | None = None, run: Run | None = None,
                    layout: Callable[[int], list[torch.Tensor]] | None = None, **kwargs) -> torch.Tensor:
    """``input_ids`` [batch, prompt] followed by up to ``max_new_tokens`` generated tokens.

    ``model``: what runs a step (a parallel module, or ``source`` itself on one device);
    ``source``: the module whose forward signature and HF ``generation_config`` apply;
    ``multiple``: the padded length is a multiple of it (tp under sequence parallelism);
    ``agree``: makes every rank hold the tokens of tensor-parallel rank 0 after each choice;
    ``run``: a parallel module's ``_run_entry``, for the KV-cache steps (None: no cache);
    ``layout``: batch -> the model's empty cache at whole shapes (``kv_cache.cache_layout``)."""
    attention_mask = kwargs.get("attention_mask")
    _check_tokens(input_ids, attention_mask)
    options = resolve_options(source, kwargs, input_ids.shape[1])
    pad = options.pad_token_id
    if (attention_mask is None and hf_generation_config(source) is not None and pad is not None
            and pad not in options.eos_token_id and bool((input_ids == pad).any())):
        attention_mask = (input_ids != pad).long()  # HF infers the mask from padding tokens in the prompt
    prompt = input_ids.shape[1]
    padded = _Padded(model, source, attention_mask, -(-(prompt + options.max_new_tokens) // multiple) * multiple, prompt)
    steps: _Padded | _Cached = padded
    reason = "use_cache=False" if not options.use_cache else "no KV-cache steps on one device" if run is None \
        else cache_unsupported_reason(source)
    if reason is None:
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        dtype = next((p.dtype for p in source.parameters() if p.is_floating_point()), torch.float32)
        empty = layout(input_ids.shape[0])
        steps = _Cached(CachedSteps(run, empty, sp_multiple=multiple, mask=mask,
                                    slots=cache_slots(prompt, options.max_new_tokens), check_rtol=check_tolerance(dtype)))
    else:
        log.debug("generate without a KV cache: %s", reason)
    tokens = input_ids
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    eos = torch.tensor(options.eos_token_id, dtype=input_ids.dtype, device=input_ids.device)
    for step in range(options.max_new_tokens):
        try:
            scores = steps.scores(tokens)
        except CacheUnsupported as err:  # the first step only: nothing chosen yet
            log.warning("generate() falls back to no KV cache for %s: %s", type(source).__name__, err)
            steps = padded
            scores = steps.scores(tokens)
        chosen = _choose(scores, options).to(tokens.dtype)
        if agree is not None and options.do_sample:  # greedy: every rank has the same gathered logits
            chosen = agree(chosen)
        if options.eos_token_id:
            chosen = torch.where(unfinished, chosen, options.pad_token_id)
            unfinished = unfinished & ~torch.isin(chosen, eos)
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        if options.eos_token_id and not bool(unfinished.any()):
            break
    return tokens
