"""Coverage beyond causal LMs: every masked-LM, seq2seq-LM, image-classification, CTC and
speech-seq2seq class of the installed ``transformers``, plus torch's ``nn.TransformerEncoder``,
``nn.TransformerDecoder`` and ``nn.Transformer``, each shrunk the way ``tools/sweep_transformers.py``
shrinks causal LMs and checked with ``sptransform.verify`` at tp=2 with and without sequence
parallelism.

    python tools/sweep_tasks.py --dtype float64                          # all, simulated ranks
    python tools/sweep_tasks.py --processes --dtype float64 --sample 4   # 4 per task, real gloo ranks
    python tools/sweep_tasks.py --only torch:torch_decoder image:vit     # a few (task:model_type)
    python tools/sweep_tasks.py --render-from results.jsonl              # no run: rewrite the doc

A sibling of ``tools/sweep_transformers.py`` (same per-family subprocess, timeout, shrink by field
name, words and refusal classes; its docstring says why these live in ``tools/``). What differs
is per task: which mapping lists the classes, the extra shrink a task needs (image and audio
sizes, per-stage lists of vision backbones), and the inputs. The inputs are found by trying:
each task has a short list of candidate input sets (``candidates``) and the first one the
class runs with a finite scalar loss on one device is the one verified; the table says which.

Why trying rather than knowing: ``input_features`` is ``[batch, mel, frames]`` for Whisper and
``[batch, frames, features]`` for Speech2Text, and some seq2seq classes derive
``decoder_input_ids`` from ``labels`` while others need them; the signature does not say, and
naming families here is what the sweep must not do.

``--sample N`` (the real-rank run): per task, the first N model types in a ``random.Random(SEED)``
shuffle of the task's runnable families (the torch rows always run). The rule is fixed so that
a rerun picks the same families.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sweep_transformers as sweep  # noqa: E402

TESTS = os.path.join(sweep.ROOT, "tests")
SEED = 22
BATCH, SEQ, LABEL_SEQ, IMAGE, FRAMES = 2, 16, 8, 32, 32

COLUMNS = (("tp2_sp", "tp=2+SP", 2, True), ("tp2", "tp=2, no SP", 2, False))
"""(result key, column title, tp, sp) of the verify runs."""

TASKS = {
    # task -> (mapping in transformers.models.auto.modeling_auto, title)
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq LM"),
    "masked": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked LM"),
    "image": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image classification"),
    "ctc": ("MODEL_FOR_CTC_MAPPING_NAMES", "speech CTC"),
    "speech": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "speech seq2seq"),
}
TORCH = ("torch_encoder", "torch_decoder", "torch_transformer")
"""Rows from ``tests/models/encoders.py`` (importable by module name, as real ranks need)."""
TITLES = {**{task: title for task, (_, title) in TASKS.items()}, "torch": "torch nn.Transformer*"}

AUDIO_INPUTS = ("input_features", "input_values")


# -- which classes ---------------------------------------------------------------------------


def families(only: list[str] | None = None, tasks: list[str] | None = None) -> list[dict]:
    """One entry per (task, model type): ``{"model_type": "task:type", "class", "run", "why"}``.
    A class already listed under an earlier task, or a text seq2seq class that takes audio, is
    listed with why it is not run."""
    import transformers
    from transformers.models.auto import modeling_auto

    out, seen = [], {}
    speech = getattr(modeling_auto, TASKS["speech"][0])
    for task, (mapping, _) in TASKS.items():
        for model_type, names in getattr(modeling_auto, mapping).items():
            class_name = names[0] if isinstance(names, (tuple, list)) else names
            entry = {"model_type": f"{task}:{model_type}", "class": class_name, "run": True, "why": None}
            cls = getattr(transformers, class_name, None)
            if class_name in seen:
                entry.update(run=False, why=f"same class as {seen[class_name]}")
            elif cls is None:
                entry.update(run=False, why="class not importable from transformers")
            elif task == "seq2seq" and any(sweep._takes(cls, k) for k in AUDIO_INPUTS):
                entry.update(run=False, why=f"audio-conditioned (forward takes audio features): run as speech:{model_type}"
                             if model_type in speech else "audio-conditioned (forward takes audio features), "
                             "not in the speech-seq2seq mapping")
            if entry["run"]:
                seen.setdefault(class_name, entry["model_type"])
            out.append(entry)
    out += [{"model_type": f"torch:{name}", "class": name, "run": True, "why": None} for name in TORCH]
    if tasks:
        out = [e for e in out if e["model_type"].split(":")[0] in tasks]
    if only:
        missing = sorted(set(only) - {e["model_type"] for e in out})
        if missing:
            raise SystemExit(f"sweep_tasks: no such task:model_type: {', '.join(missing)}")
        out = [e for e in out if e["model_type"] in only]
    return out


def sample(entries: list[dict], n: int) -> list[dict]:
    """Per task, the first ``n`` runnable entries of a ``random.Random(SEED)`` shuffle; every torch row."""
    picked = []
    for task in [*TASKS, "torch"]:
        runnable = sorted(e["model_type"] for e in entries if e["run"] and e["model_type"].startswith(task + ":"))
        if task != "torch":
            random.Random(SEED).shuffle(runnable)
            runnable = runnable[:n]
        picked += [e for e in entries if e["model_type"] in runnable]
    return picked


# -- the shrink beyond sweep_transformers' -----------------------------------------------------


ENCODER_KEYS = {"encoder_layers": "layers", "num_encoder_layers": "layers", "encoder_attention_heads": "heads",
                "num_encoder_attention_heads": "heads", "encoder_ffn_dim": "intermediate"}
"""An encoder-decoder's encoder sizes (``sweep.shrink_config`` knows the decoder's): field -> ``Target`` field."""


def shrink_task_config(d: dict, notes: list[str], target=None) -> dict:
    """What ``sweep.shrink_config`` does not know: image and audio sizes, and the per-stage lists
    of hierarchical vision backbones (one block a stage, widths 32 x 2^stage, heads that divide
    them). Applied to sub-configs too."""
    d, target = copy.deepcopy(d), target or sweep.Target()
    for key, value in list(d.items()):
        if isinstance(value, dict) and (key.endswith("config") or key.endswith("_cfg")):
            d[key] = shrink_task_config(value, notes, target)
    for key, field in ENCODER_KEYS.items():  # heads are set (8 of 8 divide 64), sizes only lowered
        if sweep._int(d.get(key)) and (d[key] > getattr(target, field) or (field == "heads" and d[key] > 1)):
            d[key] = getattr(target, field)
    for key in ("image_size", "img_size"):
        if sweep._int(d.get(key)) and d[key] > IMAGE:
            d[key] = IMAGE
        elif isinstance(d.get(key), list) and len(d[key]) == 2:
            d[key] = [IMAGE, IMAGE]
    if any(k in d for k in ("image_size", "img_size")) and sweep._int(d.get("window_size")) and d["window_size"] > 4:
        d["window_size"] = 4  # windowed vision attention: a window that tiles the 8x8 and 4x4 patch grids
    if sweep._int(d.get("patch_size")) and (d["patch_size"] > 8 or IMAGE % d["patch_size"]):
        d["patch_size"] = 8
        if sweep._int(d.get("encoder_stride")):
            d["encoder_stride"] = 8
    stages = None
    for key in ("depths", "num_layers_per_stage", "stage_depths"):
        if isinstance(d.get(key), list) and d[key] and all(sweep._int(v) for v in d[key]):
            d[key] = [min(v, 1) for v in d[key]]
            stages = len(d[key])
    widths = None
    for key in ("hidden_sizes", "embed_dims", "embed_dim_per_stage", "dims"):
        if isinstance(d.get(key), list) and d[key] and all(sweep._int(v) for v in d[key]):
            d[key] = widths = [min(v, 32 * 2 ** i) for i, v in enumerate(d[key])]
    for key in ("num_heads", "num_attention_heads", "heads"):
        if isinstance(d.get(key), list) and d[key] and all(sweep._int(v) for v in d[key]):
            heads = [min(v, 2 ** (i + 1)) for i, v in enumerate(d[key])]
            if widths and len(widths) == len(heads):
                heads = [next(h for h in range(h, 0, -1) if w % h == 0) for h, w in zip(heads, widths)]
            d[key] = heads
    if stages:
        notes.append(f"{stages} stages of one block")
    if "stage_names" in d:  # a backbone's stage list (the causal-LM shrink may have cut the stages): rederived
        for key in ("stage_names", "out_features", "out_indices"):
            d.pop(key, None)
    # audio: the convolutional feature encoder's widths, its positional convolution, mel bins
    for key in ("conv_dim",):
        if isinstance(d.get(key), list) and all(sweep._int(v) for v in d[key]):
            d[key] = [min(v, 32) for v in d[key]]
    for key, small in (("num_conv_pos_embeddings", 16), ("num_mel_bins", 16), ("input_feat_per_channel", 16),
                       ("max_source_positions", FRAMES)):
        if sweep._int(d.get(key)) and d[key] > small:
            d[key] = small
    return d


def build(task: str, model_type: str, class_name: str, target):
    """(model, attn, notes): the class from its config's defaults, shrunk (both shrinks)."""
    import io

    import torch
    import transformers

    cls = getattr(transformers, class_name)
    notes: list[str] = []
    with contextlib.redirect_stderr(io.StringIO()):
        d = cls.config_class().to_dict()
    d = shrink_task_config(sweep.shrink_config(d, target, notes), notes, target)
    for key in ("transformers_version", "dtype", "torch_dtype"):
        d.pop(key, None)
    d["use_cache"] = False
    config = cls.config_class.from_dict(d)
    errors = []
    for attn in ("sdpa", "eager"):
        try:
            torch.manual_seed(0)
            with contextlib.redirect_stderr(io.StringIO()):
                model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32)
            return model.float().train(), attn, notes
        except Exception as error:
            errors.append(f"{attn}: {type(error).__name__}: {sweep._first_line(error)}")
    raise RuntimeError("; ".join(errors))


# -- inputs -----------------------------------------------------------------------------------


def _vocab(model) -> int:
    vocab = getattr(model.config, "vocab_size", None)
    emb = head = None
    with contextlib.suppress(NotImplementedError, AttributeError):  # audio encoders have no token embedding
        emb = model.get_input_embeddings()
    with contextlib.suppress(NotImplementedError, AttributeError):
        head = model.get_output_embeddings()
    sizes = [n for n in (vocab, getattr(emb, "num_embeddings", None), getattr(head, "out_features", None))
             if sweep._int(n)]
    return min(sizes) if sizes else 128


def _text_config(model):
    config = model.config
    return getattr(config, "text_config", None) or getattr(config, "decoder", None) or config


def _samples_for_frames(model, frames: int) -> int:
    """Raw audio length whose convolutional feature encoder gives ``frames`` frames (3200 when the
    model does not say how it downsamples)."""
    import torch

    lengths = getattr(model, "_get_feat_extract_output_lengths", None)
    if lengths is None:
        return 3200
    n = 16
    while int(lengths(torch.tensor(n))) < frames and n < 200_000:
        n += 16
    return n


def candidates(task: str, model) -> list[tuple[str, dict]]:
    """(what, inputs) to try in order; the first the model trains on is verified."""
    import torch

    g = torch.Generator().manual_seed(0)
    dtype = next(model.parameters()).dtype
    vocab = _vocab(model)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    if task in ("masked", "seq2seq"):
        dec = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        return [("input_ids, labels", {"input_ids": ids, "labels": ids.clone()}),
                ("input_ids, decoder_input_ids, labels", {"input_ids": ids, "decoder_input_ids": dec, "labels": dec})]
    if task == "image":
        config = model.config
        channels = getattr(config, "num_channels", 3) or 3
        pixels = torch.randn(BATCH, channels, IMAGE, IMAGE, generator=g, dtype=dtype)
        labels = torch.randint(0, max(1, getattr(config, "num_labels", 2)), (BATCH,), generator=g)
        return [(f"pixel_values {IMAGE}x{IMAGE}, labels", {"pixel_values": pixels, "labels": labels})]
    # speech: raw audio or features, in either order, with CTC or token labels
    labels = torch.randint(1, max(2, vocab), (BATCH, LABEL_SEQ), generator=g)
    out = []
    if sweep._takes(model, "input_values"):
        n = _samples_for_frames(model, FRAMES)
        out.append((f"input_values [{BATCH}, {n}], labels", {
            "input_values": torch.randn(BATCH, n, generator=g, dtype=dtype), "labels": labels}))
    if sweep._takes(model, "input_features"):
        config = model.config
        enc = getattr(config, "encoder_config", None) or getattr(config, "audio_config", None) or config
        feats = next((getattr(c, k) for c in (config, enc) for k in ("num_mel_bins", "input_feat_per_channel",
                      "feature_size", "num_mel_filters", "input_dim") if sweep._int(getattr(c, k, None))), 16)
        frames = 2 * FRAMES
        for shape in ((BATCH, feats, frames), (BATCH, frames, feats)):
            out.append((f"input_features {list(shape)}, labels", {
                "input_features": torch.randn(*shape, generator=g, dtype=dtype), "labels": labels}))
    return out


def one_device(model, inputs) -> dict:
    """Forward, backward, one SGD step on a copy: ok when the loss and every gradient are finite."""
    import torch

    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    torch.manual_seed(1)
    out = m(*inputs) if isinstance(inputs, tuple) else m(**inputs)
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if loss is None or loss.dim() != 0:
        return {"status": "fail", "reason": "no scalar loss for these inputs"}
    if not torch.isfinite(loss):
        return {"status": "fail", "reason": f"loss is {loss.item()}"}
    loss.backward()
    params = dict(m.named_parameters())
    bad = [n for n, p in params.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if bad:
        return {"status": "fail", "reason": f"non-finite gradient of {bad[0]} (+{len(bad) - 1})"}
    opt.step()
    return {"status": "ok", "loss": float(loss.detach()), "params": len(params),
            "numel": sum(p.numel() for p in params.values()),
            "no_grad": [n for n, p in params.items() if p.requires_grad and p.grad is None]}


# -- one family, in this process ------------------------------------------------------------------


def worker(key: str, result_path: str, processes: bool, dtype: str, columns: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    task, model_type = key.split(":", 1)
    class_name = families([key])[0]["class"]
    result: dict = {"model_type": key, "class": class_name, "stage": "build"}

    def save():
        with open(result_path + ".tmp", "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(result_path + ".tmp", result_path)

    save()
    try:
        if task == "torch":
            if TESTS not in sys.path:
                sys.path.insert(0, TESTS)
            from models import encoders

            torch.manual_seed(0)
            model, attn, notes = encoders.MODELS[model_type]().train(), "", ["tests/models/encoders.py"]
        else:
            import transformers

            transformers.logging.set_verbosity_error()
            model, attn, notes = build(task, model_type, class_name, sweep.Target())
        model = model.to(getattr(torch, dtype))
    except Exception as error:
        result["build"] = {"status": "fail", "reason": f"{type(error).__name__}: {sweep._first_line(error)}"}
        save()
        return
    result["build"], result["notes"], result["stage"] = {"status": "ok", "attn": attn}, notes, "single"
    save()
    try:
        tried = [("ids, memory ids, labels", encoders.inputs())] if task == "torch" else candidates(task, model)
    except Exception as error:  # the model does not say what its inputs are (sizes, vocabulary)
        tried = []
        single = {"status": "fail", "reason": f"making inputs: {type(error).__name__}: {sweep._first_line(error)}"}
    failures = []
    for what, inputs in tried:
        try:
            single = one_device(model, inputs)
        except Exception as error:
            single = {"status": "fail", "reason": f"{type(error).__name__}: {sweep._first_line(error)}"}
        if single["status"] == "ok":
            result["inputs"] = what
            if failures:  # the sets tried before, and why they did not train
                result["notes"] = notes + [f"first tried {f}" for f in failures]
            break
        failures.append(f"{what}: {single['reason']}")
    else:
        if tried:
            single = {"status": "fail", "reason": " / ".join(failures)}
    result["single"] = single
    save()
    if single["status"] != "ok":
        return
    for col, _, tp, sp in COLUMNS:
        if col in columns:
            result["stage"] = col
            save()
            result[col] = sweep.run_verify(model, inputs, tp=tp, sp=sp, processes=processes)
            save()
    result["stage"] = "done"
    save()


# -- the table -------------------------------------------------------------------------------------


def task_of(result: dict) -> str:
    return result["model_type"].split(":", 1)[0]


def totals(results: list[dict]) -> dict:
    """Per task and column: counts of each word, the held shares of the equal ones, refusal classes."""
    out: dict = {}
    for task in [*TASKS, "torch"]:
        rows = [r for r in results if task_of(r) == task]
        if not rows:
            continue
        run = [r for r in rows if "not_run" not in r]
        t = {"listed": len(rows), "not_run": len(rows) - len(run), "tried": len(run),
             "trains": sum(sweep.single_outcome(r)[0] == "trains" for r in run)}
        for col, *_ in COLUMNS:
            counts, held, reasons = {}, [], {}
            for r in run:
                word, reason = sweep.outcome(r, col)
                if not word:
                    continue
                counts[word] = counts.get(word, 0) + 1
                if word == "equal" and r[col].get("held_share") is not None:
                    held.append(r[col]["held_share"])
                if word == "refused":
                    k = sweep.reason_class(reason)
                    reasons[k] = reasons.get(k, 0) + 1
            t[col] = counts
            t[f"{col}_held"] = sorted(held)
            t[f"{col}_reasons"] = reasons
        out[task] = t
    return out


WORDS = ("equal", "refused", "wrong", "error")


def held_text(held: list[float]) -> str:
    if not held:
        return "–"
    return f"{statistics.median(held):.2f} ({held[0]:.2f}–{held[-1]:.2f})"


def summary_table(results: list[dict]) -> list[str]:
    """Markdown: per task and column, equal / refused / wrong / error (+ other words), and the
    median (range) of the held share over the equal ones."""
    t = totals(results)
    lines = ["| class | tried | train on one device | layout | equal / refused / wrong / error | other | "
             "held per rank: median (range) |", "| --- | ---: | ---: | --- | --- | --- | --- |"]
    for task, s in t.items():
        for i, (col, title, *_) in enumerate(COLUMNS):
            c = s[col]
            other = ", ".join(f"{w} {n}" for w, n in c.items() if w not in WORDS) or "–"
            head = f"| {TITLES[task]} | {s['tried']} | {s['trains']} |" if i == 0 else "| | | |"
            lines.append(f"{head} {title} | **{' / '.join(str(c.get(w, 0)) for w in WORDS)}** | {other} | "
                         f"{held_text(s[f'{col}_held'])} |")
    return lines


def _cell_word(result: dict, col: str) -> str:
    word = sweep.outcome(result, col)[0] or "–"
    if word == "equal":
        extra = []
        linears = result[col].get("linears")
        if linears and linears[0] < linears[1]:
            extra.append(f"{linears[0]}/{linears[1]} linears split")
        if result[col].get("held_share") is not None:
            extra.append(f"held {result[col]['held_share']:.2f}")
        word += f" ({', '.join(extra)})" if extra else ""
    return word


def render(results: list[dict], meta: dict) -> str:
    lines = [
        "## Beyond causal LMs",
        "",
        f"Generated by `{meta['command']}` ({meta['when']}; transformers {meta['transformers']}, torch {meta['torch']}; "
        + (f"{meta['seconds']:.0f} s" if meta.get("seconds") else "stopped before the end; the rows that finished")
        + f" with --jobs {meta['jobs']} on a shared 2-core machine). **{meta['engine']}**. "
        "Every class of transformers' masked-LM, seq2seq-LM, image-classification, CTC and speech-seq2seq mappings "
        "(`MODEL_FOR_*_MAPPING_NAMES`), built from its config's defaults shrunk as in the causal-LM sweep "
        f"(2 layers, hidden 64, 8 heads, MLP 128, vocab 128) and further for its task (images {IMAGE}x{IMAGE} with "
        "patches of at most 8, hierarchical backbones one block a stage of widths 32·2^stage, audio feature encoders "
        "32 channels wide, 16 mel bins), in train() mode; plus torch's `nn.TransformerEncoder`, "
        "`nn.TransformerDecoder` and `nn.Transformer` from `tests/models/encoders.py`. Inputs: the first of the "
        "task's candidate sets the class trains on with a finite loss on one device (column *inputs*). Then "
        "`sptransform.verify` at tp=2 with SP and without (1 SGD step, rtol 1e-4). *held* = the share of the "
        "parameter bytes one rank stores, measured on its tensors. Words as in the causal-LM section.",
    ]
    if meta.get("sample"):
        lines += ["", meta["sample"]]
    lines += ["", "### Totals", "", *summary_table(results)]
    reasons: dict[str, dict[str, int]] = {}
    for r in results:
        for col, *_ in COLUMNS:
            word, reason = sweep.outcome(r, col)
            if word == "refused":
                k = sweep.reason_class(reason)
                reasons.setdefault(k, {c: 0 for c, *_ in COLUMNS})[col] += 1
    if reasons:
        lines += ["", "### Refusal reasons", "", "| reason (specifics elided) | " +
                  " | ".join(t for _, t, *_ in COLUMNS) + " |", "| --- |" + " ---: |" * len(COLUMNS)]
        for k, c in sorted(reasons.items(), key=lambda kv: -sum(kv[1].values())):
            lines.append(f"| {sweep._cell(k)} | " + " | ".join(str(c[col]) for col, *_ in COLUMNS) + " |")
    for word, title in (("wrong", "Wrong (verify: different)"), ("error", "Error (verify itself raised)")):
        rows = [(r, t, reason) for r in results for col, t, *_ in COLUMNS
                for w, reason in [sweep.outcome(r, col)] if w == word]
        if rows:
            lines += ["", f"### {title}", "", "| task:model type | layout | what |", "| --- | --- | --- |"]
            lines += [f"| {r['model_type']} | {t} | {sweep._cell(reason, 600)} |" for r, t, reason in rows]
    lines += ["", "### All classes", "", "| task:model type | class | inputs | one device | " +
              " | ".join(t for _, t, *_ in COLUMNS) + " | reason |", "| --- | --- | --- | --- |" + " --- |" * (len(COLUMNS) + 1)]
    for r in results:
        if "not_run" in r:
            continue
        single, single_reason = sweep.single_outcome(r)
        words = [sweep.outcome(r, col) for col, *_ in COLUMNS]
        reasons_cell = [single_reason] if single_reason else []
        if words[0][1] and all(w[1] == words[0][1] for w in words):
            reasons_cell.append(f"both: {words[0][1]}")
        else:
            reasons_cell += [f"{t}: {reason}" for (_, reason), (_, t, *_) in zip(words, COLUMNS) if reason]
        if r.get("ended") and r["ended"] not in " ".join(reasons_cell):
            reasons_cell.append(r["ended"])
        lines.append(f"| {r['model_type']} | {r['class']} | {r.get('inputs', '')} | {single} | " +
                     " | ".join(_cell_word(r, col) for col, *_ in COLUMNS) + f" | {sweep._cell(' / '.join(reasons_cell))} |")
    skipped = [r for r in results if "not_run" in r]
    if skipped:
        lines += ["", "### Not run", "", "| task:model type | class | why |", "| --- | --- | --- |"]
        lines += [f"| {r['model_type']} | {r['class']} | {sweep._cell(r['not_run'])} |" for r in skipped]
    return "\n".join(lines) + "\n"


def load(path: str) -> tuple[list[dict], dict]:
    """(results, meta) from a ``--json`` file, or from a ``--jsonl`` file (one result a line, the
    meta on its last line; the last result of a model type wins, so a rerun with --only updates it)."""
    with open(path) as f:
        if path.endswith(".json"):
            saved = json.load(f)
            return saved["results"], saved["meta"]
        lines = [json.loads(line) for line in f if line.strip()]
    metas = [x["meta"] for x in lines if "meta" in x]
    results = {x["model_type"]: x for x in lines if "meta" not in x}
    order = [e["model_type"] for e in families()]
    return sorted(results.values(), key=lambda r: order.index(r["model_type"]) if r["model_type"] in order else 0), metas[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="TASK:MODEL_TYPE")
    parser.add_argument("--tasks", nargs="+", choices=[*TASKS, "torch"], help="these tasks only")
    parser.add_argument("--sample", type=int, metavar="N", help="per task, N families of a seeded shuffle")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family (default 300)")
    parser.add_argument("--processes", action="store_true", help="real gloo processes instead of simulated ranks")
    parser.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    parser.add_argument("--columns", nargs="+", default=[c for c, *_ in COLUMNS], choices=[c for c, *_ in COLUMNS])
    parser.add_argument("--jsonl", help="append each result here as it finishes (and the meta at the end)")
    parser.add_argument("--out", help="markdown file whose 'tasks-sweep' section is replaced (default: "
                        "docs/supported_models.md for a whole or --sample run)")
    parser.add_argument("--section", default="tasks-sweep", help="name of the generated section")
    parser.add_argument("--render-from", metavar="JSONL", help="no run: write --out from a --jsonl file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.result, args.processes, args.dtype, args.columns)
        return 0
    if args.render_from:
        results, meta = load(args.render_from)
        sweep.write_section(args.out or sweep.DOC, args.section, render(results, meta))
        print(f"wrote {args.out or sweep.DOC}")
        return 0
    entries = families(args.only, args.tasks)
    if args.sample:
        entries = sample(entries, args.sample)
    worker_args = (["--processes"] if args.processes else []) + ["--dtype", args.dtype, "--columns", *args.columns]

    def progress(result, done, total):
        cols = " ".join(f"{c}={sweep.outcome(result, c)[0] or '-'}" for c, *_ in COLUMNS)
        print(f"[{done:3d}/{total}] {result['model_type']:36s} {result.get('seconds', 0):6.1f}s "
              f"{sweep.single_outcome(result)[0]:12s} {cols}", flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(result, default=str) + "\n")

    import torch
    import transformers

    engine = ("real gloo processes" if args.processes else "simulated ranks") + f", {args.dtype}"
    meta = {"when": time.strftime("%Y-%m-%d"), "transformers": transformers.__version__,
            "torch": torch.__version__.split("+")[0], "seconds": None, "jobs": args.jobs, "engine": engine,
            "command": "python tools/sweep_tasks.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "sample": (f"A sample: per task, the first {args.sample} runnable model types of a "
                       f"`random.Random({SEED})` shuffle of the task's sorted model types, and every torch row."
                       if args.sample else "")}
    if args.jsonl:  # a run stopped early still renders (its meta says it is partial)
        with open(args.jsonl, "a") as f:
            f.write(json.dumps({"meta": {**meta, "partial": True}}) + "\n")
    start = time.monotonic()
    results = sweep.sweep(entries, jobs=args.jobs, timeout=args.timeout, progress=progress,
                          script=os.path.abspath(__file__), worker_args=tuple(worker_args))
    meta["seconds"] = seconds = time.monotonic() - start
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(json.dumps({"meta": meta}) + "\n")
    print(json.dumps({task: {c: s[c] for c, *_ in COLUMNS} for task, s in totals(results).items()}), flush=True)
    print(f"sweep took {seconds:.0f} s", flush=True)
    out = args.out or (sweep.DOC if not args.only and not args.tasks else None)
    if out:
        sweep.write_section(out, args.section, render(results, meta))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
