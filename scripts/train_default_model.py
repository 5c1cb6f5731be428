#!/usr/bin/env python
"""Train vllm-lite's bundled default model: a tiny Llama on Python's own documentation.

Why: a fresh install must run end to end with no download, and its output should
read as English-like Python docs rather than noise. The corpus is text that ships
with every CPython (``pydoc_data.topics`` plus stdlib docstrings), so the script
needs nothing but the interpreter, torch, tokenizers and transformers.

Run (the bundled model was made with the command recorded in its TRAINING.md):

    python scripts/train_default_model.py --out vllm_lite/assets/default_model --minutes 20

The run is deterministic given ``--seed`` and the resolved step count. ``--minutes``
only picks the step count (from a short timing probe); pass ``--steps N`` to
reproduce a run exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import random
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]

# No BOS in the template: the tokenizer's post-processor adds it on encode.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Modules whose import has side effects (GUI, browser, printing, huge test trees) or that hang.
SKIP_MODULES = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "_tkinter",
    "turtle",
    "turtledemo",
    "__hello__",
    "__phello__",
    "test",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "webbrowser",
    "__main__",
    "_testcapi",
    "_testinternalcapi",
    "_testbuffer",
    "_testmultiphase",
    "_testimportmultiple",
    "_testsinglephase",
    "_xxtestfuzz",
    "_testclinic",
    "_ctypes_test",
    "msvcrt",
    "winreg",
    "winsound",
    "_winapi",
    "_msi",
    "msilib",
    "_overlapped",
    "nt",
}


# ---------------------------------------------------------------------------- corpus
@dataclass(frozen=True)
class Doc:
    """One training document: its plain text, and a question a chat user might ask about it."""

    title: str
    body: str
    question: str


def _safe_import(name: str):
    """Import quietly; None on any failure (missing C extension, platform module, ...)."""
    if any(name == s or name.startswith(s + ".") for s in SKIP_MODULES):
        return None
    if any(part.startswith("test") or part == "tests" for part in name.split(".")[1:]):
        return None
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - SystemExit and friends from odd modules too
        return None


def _stdlib_modules() -> Iterator[object]:
    """Every importable stdlib module and package submodule, in sorted name order."""
    names = set()
    for top in sorted(sys.stdlib_module_names):
        mod = _safe_import(top)
        if mod is None:
            continue
        names.add(top)
        path = getattr(mod, "__path__", None)
        if path:
            for info in pkgutil.walk_packages(path, prefix=top + ".", onerror=lambda _n: None):
                names.add(info.name)
    for name in sorted(names):
        mod = _safe_import(name)
        if mod is not None:
            yield mod


def _signature(obj: object) -> str:
    """The signature text, minus memory addresses (`<object object at 0x...>`) that change per run."""
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", sig)


def _docstring_docs(mod: object) -> Iterator[Doc]:
    """Module, class, function and method docstrings defined by this module (not re-exports)."""
    modname = mod.__name__  # type: ignore[attr-defined]
    doc = inspect.getdoc(mod)
    if doc:
        yield Doc(f"Module {modname}", doc, f"What is the {modname} module for?")
    for attr in sorted(vars(mod)):
        if attr.startswith("_"):
            continue
        obj = vars(mod)[attr]
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != modname:
            continue
        qual = f"{modname}.{attr}"
        doc = obj.__doc__ if isinstance(obj.__doc__, str) else None
        if doc:
            kind = "class" if inspect.isclass(obj) else "function"
            yield Doc(f"{qual}{_signature(obj)}", inspect.cleandoc(doc), f"What does the {kind} {qual} do?")
        if inspect.isclass(obj):
            for mname in sorted(vars(obj)):
                if mname.startswith("_") and mname != "__init__":
                    continue
                member = vars(obj)[mname]
                mdoc = getattr(member, "__doc__", None)
                if isinstance(mdoc, str) and mdoc and (inspect.isroutine(member) or isinstance(member, property)):
                    yield Doc(
                        f"{qual}.{mname}{_signature(member)}", inspect.cleandoc(mdoc), f"What does {qual}.{mname} do?"
                    )


def collect_corpus(min_chars: int = 40) -> list[Doc]:
    """pydoc topics then stdlib docstrings, exact duplicates dropped, order fixed."""
    from pydoc_data.topics import topics

    docs: list[Doc] = []
    seen: set[str] = set()

    def add(d: Doc) -> None:
        body = d.body.strip()
        if len(body) < min_chars or body in seen:
            return
        seen.add(body)
        docs.append(Doc(d.title, body, d.question))

    for key in sorted(topics):
        label = key.replace("-", " ")
        add(Doc(label, topics[key], f"Tell me about {label} in Python."))
    for mod in _stdlib_modules():
        try:
            for d in _docstring_docs(mod):
                add(d)
        except Exception:  # noqa: BLE001 - a module with a broken __getattr__ must not stop us
            continue
    return docs


def collect_corpus_isolated() -> list[Doc]:
    """collect_corpus in a fresh `python -I` with a fixed hash seed.

    Why: what the stdlib exposes depends on what is already imported (torch and
    transformers patch and register things), and imports can have side effects.
    A clean interpreter makes the corpus a function of the Python install alone.
    """
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import train_default_model as t; "
        "json.dump([[d.title, d.body, d.question] for d in t.collect_corpus()], sys.stdout)"
    )
    env = {"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-I", "-W", "ignore", "-c", code, os.path.dirname(os.path.abspath(__file__))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"corpus collection failed:\n{proc.stderr[-2000:]}")
    # Modules may print while imported; the JSON is the last line.
    return [Doc(*row) for row in json.loads(proc.stdout.strip().splitlines()[-1])]


def render(doc: Doc, as_chat: bool, max_answer_chars: int = 1200) -> str:
    """Plain documents teach the language; a share rendered as chat teaches the template."""
    if not as_chat:
        return f"{doc.title}\n\n{doc.body}" if doc.title and not doc.body.startswith(doc.title) else doc.body
    answer = doc.body[:max_answer_chars]
    cut = answer.rfind("\n\n")
    if len(doc.body) > max_answer_chars and cut > 200:
        answer = answer[:cut]
    return f"{IM_START}user\n{doc.question}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


# ---------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (any byte sequence encodes), BOS added by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eot = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot)]
    )
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def pack(token_lists: list[list[int]], eot: int, seq_len: int):
    """Documents joined by EOT, cut into (seq_len + 1)-token windows (input plus shifted target)."""
    import torch

    flat: list[int] = []
    for ids in token_lists:
        flat.append(eot)
        flat.extend(ids)
    n = (len(flat) - 1) // seq_len
    t = torch.tensor(flat[: n * seq_len + 1], dtype=torch.long)
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return t[idx]


# ---------------------------------------------------------------------------- model
def build_model(vocab_size: int, eot: int, args: argparse.Namespace):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    model.tie_weights()
    return model


def mean_loss(model, windows, batch_size: int, autocast: bool) -> float:
    """Mean next-token cross-entropy in nats/token over all windows."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            w = windows[i : i + batch_size]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=w[:, :-1]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += w[:, 1:].numel()
    model.train()
    return total / count


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


def sample_texts(model, hf_tok, prompts: list[str], max_new: int = 40, repetition_penalty: float = 1.0) -> list[str]:
    """Greedy continuations with the HF model: documentation samples for TRAINING.md."""
    import torch

    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf_tok(p, return_tensors="pt").input_ids
            gen = model.generate(
                ids,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=hf_tok.pad_token_id,
                eos_token_id=hf_tok.eos_token_id,
                repetition_penalty=repetition_penalty,
            )
            outs.append(hf_tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    model.train()
    return outs


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory for the checkpoint")
    p.add_argument("--minutes", type=float, default=20.0, help="training wall-time budget used to pick --steps")
    p.add_argument("--steps", type=int, default=None, help="exact number of optimizer steps (overrides --minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="1 is fastest when the cores are shared")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30, help="at least 10: the timing probe runs inside it")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--chat-fraction", type=float, default=0.15, help="share of docstring documents rendered as chat")
    p.add_argument("--heldout-fraction", type=float, default=0.05)
    p.add_argument("--no-autocast", action="store_true", help="train in float32 instead of bf16 autocast")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    autocast = not args.no_autocast
    rng = random.Random(args.seed)
    if args.steps is None and args.warmup < 10:
        raise ValueError(
            f"--warmup must be at least 10 with --minutes (the timing probe runs inside it), got {args.warmup}"
        )

    t0 = time.time()
    docs = collect_corpus_isolated()
    log(f"corpus: {len(docs)} documents, {sum(len(d.body) for d in docs) / 1e6:.2f} M chars ({time.time() - t0:.0f}s)")

    order = list(range(len(docs)))
    rng.shuffle(order)
    n_held = max(1, int(len(docs) * args.heldout_fraction))
    held_idx, train_idx = sorted(order[:n_held]), sorted(order[n_held:])
    # Topics (the first documents) stay plain; a seeded share of docstrings becomes chat.
    as_chat = [i >= 79 and rng.random() < args.chat_fraction for i in range(len(docs))]
    train_texts = [render(docs[i], as_chat[i]) for i in train_idx]
    held_texts = [render(docs[i], as_chat[i]) for i in held_idx]

    tok = train_tokenizer(train_texts, args.vocab_size)
    hf_tok = wrap_tokenizer(tok)
    eot = tok.token_to_id(EOT)
    enc = lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]  # noqa: E731
    train_w = pack(enc(train_texts), eot, args.seq_len)
    held_w = pack(enc(held_texts), eot, args.seq_len)
    log(f"tokens: train {train_w.numel() / 1e6:.2f} M in {len(train_w)} windows, held-out {len(held_w)} windows")

    model = build_model(tok.get_vocab_size(), eot, args)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f} M parameters (tied embeddings)")
    untrained_loss = mean_loss(model, held_w, args.batch_size, autocast)
    log(f"held-out loss untrained: {untrained_loss:.4f} nats/token (ln V = {math.log(tok.get_vocab_size()):.4f})")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)

    def batches() -> Iterator[torch.Tensor]:
        while True:
            perm = torch.randperm(len(train_w), generator=gen)
            for i in range(0, len(perm) - args.batch_size + 1, args.batch_size):
                yield train_w[perm[i : i + args.batch_size]]

    def train_step(step: int, batch: torch.Tensor, total: int) -> float:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.lr, args.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    stream = batches()
    total_steps = args.steps
    model.train()
    step = 0
    t_train = time.time()
    if total_steps is None:
        # Timing probe: these steps are real (warmup) steps of the run; the total only sizes the schedule.
        probe = 10
        for step in range(probe):
            train_step(step, next(stream), 10**9)
        per_step = (time.time() - t_train) / probe
        total_steps = max(probe + 1, int(args.minutes * 60 / per_step))
        log(f"probe: {per_step:.2f} s/step -> {total_steps} steps for {args.minutes} min")
        step = probe
    ema = None
    while step < total_steps:
        loss = train_step(step, next(stream), total_steps)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        step += 1
        if step % 50 == 0 or step == total_steps:
            el = time.time() - t_train
            log(
                f"step {step}/{total_steps} loss {loss:.3f} (ema {ema:.3f}) lr {opt.param_groups[0]['lr']:.2e} "
                f"{step * args.batch_size * args.seq_len / el:.0f} tok/s, {el / 60:.1f} min"
            )
    train_minutes = (time.time() - t_train) / 60

    # Evaluate what ships: weights rounded to bfloat16.
    model = model.to(torch.bfloat16).float()
    trained_loss = mean_loss(model, held_w, args.batch_size, autocast)
    log(f"held-out loss trained (bf16 weights): {trained_loss:.4f} nats/token vs untrained {untrained_loss:.4f}")

    prompts = ["The for statement", "The with statement", "Return a list of", "This module provides"]
    samples = sample_texts(model, hf_tok, prompts)
    samples_rp = sample_texts(model, hf_tok, prompts, repetition_penalty=1.15)
    for p, s, r in zip(prompts, samples, samples_rp):
        log(f"sample: {p!r} -> {s!r} | with repetition penalty 1.15: {r!r}")

    save(
        model,
        hf_tok,
        args,
        dict(
            n_params=n_params,
            untrained_loss=untrained_loss,
            trained_loss=trained_loss,
            steps=total_steps,
            train_minutes=train_minutes,
            n_docs=len(docs),
            n_train_windows=len(train_w),
            n_held_windows=len(held_w),
            samples=list(zip(prompts, samples)),
            samples_rp=list(zip(prompts, samples_rp)),
            vocab_size=tok.get_vocab_size(),
        ),
        eot,
        hf_tok.convert_tokens_to_ids(IM_END),
    )
    log(f"saved to {args.out}")


def save(model, hf_tok, args: argparse.Namespace, stats: dict, eot: int, im_end: int) -> None:
    """bf16 safetensors + tokenizer + generation config + TRAINING.md with the numbers."""
    import torch

    os.makedirs(args.out, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(args.out)
    write_generation_config(args.out, eot, im_end)
    hf_tok.save_pretrained(args.out)
    make_portable(args.out)
    write_training_md(args, stats)


def _update_json(path: str, updates: dict) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(updates)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def make_portable(out: str) -> None:
    """Spell config and tokenizer files so transformers 4.45+ reads them too, not only v5.

    v5 writes `rope_parameters`, `dtype`, `extra_special_tokens`, a `TokenizersBackend`
    class and a separate chat_template.jinja; older readers want `rope_theta`,
    `torch_dtype`, `additional_special_tokens`, `PreTrainedTokenizerFast` and the
    template inside tokenizer_config.json. Both spellings are kept.
    """
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters") or {}
    _update_json(
        cfg_path,
        {
            "dtype": "bfloat16",
            "torch_dtype": "bfloat16",
            "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        },
    )
    _update_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
            "additional_special_tokens": [IM_START, IM_END],
            "extra_special_tokens": [IM_START, IM_END],
        },
    )


def write_generation_config(out: str, eot: int, im_end: int) -> None:
    """Both end tokens stop generation; mild sampling defaults suit a model this small.

    The repetition penalty matters most: a few-million-parameter model falls into
    loops quickly, greedy or not.
    """
    cfg = {
        "bos_token_id": eot,
        "eos_token_id": [eot, im_end],
        "pad_token_id": eot,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "repetition_penalty": 1.15,
    }
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def write_training_md(args: argparse.Namespace, s: dict) -> None:
    # Every hyperparameter spelled out, so the command survives changes to the defaults.
    flags = {k: v for k, v in vars(args).items() if k not in ("out", "minutes", "steps")}
    parts = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in flags.items() if v is not False]
    cmd = f"python scripts/train_default_model.py --out {args.out} --steps {s['steps']} " + " ".join(parts)
    samples = "\n".join(f"- `{p}` → {t!r}" for p, t in s["samples"])
    samples_rp = "\n".join(f"- `{p}` → {t!r}" for p, t in s["samples_rp"])
    text = f"""# vllm-lite default model

A tiny Llama-architecture model bundled so that `vllm-lite generate "..."` works
on a fresh install with no download (`vllm_lite.default_model.default_model_path()`
gives its directory; it is used whenever no model is named). It was trained by
`scripts/train_default_model.py` on text that ships with CPython: the
`pydoc_data.topics` help pages and the docstrings of the standard library
(modules, classes, functions, methods), {s["n_docs"]} documents after removing
exact duplicates; about {100 - args.heldout_fraction * 100:.0f}% for training
and {args.heldout_fraction * 100:.0f}% held out by document. A seeded
{args.chat_fraction:.0%} of docstring documents were rendered in the chat
template (`<|im_start|>user ... <|im_end|>`), so `vllm-lite chat` answers in kind.

| | |
|---|---|
| architecture | LlamaForCausalLM, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads, MLP {args.intermediate}, tied embeddings |
| parameters | {s["n_params"]:,} |
| tokenizer | byte-level BPE, {s["vocab_size"]} tokens, `<|endoftext|>` is BOS/EOS/pad, `<|im_end|>` also ends a chat turn |
| context | trained on {args.seq_len}-token windows; max_position_embeddings {args.max_positions} |
| weights | bfloat16 safetensors |
| training | {s["steps"]} AdamW steps, batch {args.batch_size}×{args.seq_len} tokens, lr {args.lr} (warmup {args.warmup}, cosine to 10%), bf16 autocast, {args.threads} CPU threads, {s["train_minutes"]:.1f} min |
| **held-out loss, trained** | **{s["trained_loss"]:.3f} nats/token** (with the shipped bf16 weights) |
| held-out loss, untrained | {s["untrained_loss"]:.3f} nats/token (same architecture, random init, seed {args.seed}; ln {s["vocab_size"]} = {math.log(s["vocab_size"]):.3f}) |
| held-out windows | {s["n_held_windows"]} × {args.seq_len} tokens |

Greedy samples from the trained model (Hugging Face `generate`, 40 new tokens):

{samples}

Greedy with repetition penalty 1.15 (the shipped generation_config also samples
at temperature 0.7, top-p 0.9 unless told otherwise):

{samples_rp}

Reproduce exactly (deterministic given seed, step count and thread count, on
the same CPU, Python and library versions):

    {cmd}

The original run was `--minutes {args.minutes}`, which only picks the step count
from a timing probe (the probe steps fall inside the warmup, whose learning rate
does not depend on the total), so the command above repeats it bit for bit.
"""
    with open(os.path.join(args.out, "TRAINING.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
