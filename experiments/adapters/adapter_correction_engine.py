"""`adapter_correction.py --engine`: the same agent workload through kvforge's engine path (`lora_corrections`).

The experiment's tiny model and PEFT adapters are exported and built as an engine with hidden states of layers
0..L-2. Per adapter and rank it reports, against the adapter's exact cold run on the same engine (which equals
PEFT's greedy answer on this float32 model):

- answers equal: greedy answers of the corrected start equal to the exact run's;
- first token equal: the first answer token (the one a classifier or checker verdict often is);
- TTFT: best of `--repeats` prefills (one generated token) of the invocation over the conversation: exact cold
  (no reuse) against corrected (the base model's cached pages copied and corrected, then the rest computed);
- corrected pages: whole base pages the corrected request started from.

Top-1 agreement and KL need teacher-forced logits, which the engine does not return: they stay the torch mode's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINE_HEADER = ("| adapter | rank | answers equal corrected | first token equal | corrected pages | "
                 "TTFT exact / corrected ms | TTFT gain |")


def build(peft_model: Any, ranks: list[int], names: list[str], args: argparse.Namespace, root: Path) -> dict[str, str]:
    """The base model exported with every LoRA target and hidden states of layers 0..L-2, built to root/engine;
    each PEFT adapter converted. Returns the converted paths by adapter name."""
    from tokenizers import Tokenizer, models

    from experiments._common import tiny_llama
    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.contract.lora import LORA_TARGETS
    from kvforge.tools.export.lora import write_converted_adapter
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.writer import write_onnx_dir

    base = tiny_llama(args.seed)  # the same weights again (seeded): the PEFT model's modules carry LoRA layers
    base.save_pretrained(root / "hf", safe_serialization=True)
    vocab = base.config.vocab_size
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(str(root / "hf" /
                                                                                           "tokenizer.json"))
    peft_model.save_pretrained(root / "peft")  # one folder per adapter name
    loaded = load_hf_dir(root / "hf", kv_cache_dtype="fp32")
    loaded.config.lora_targets = list(LORA_TARGETS)
    loaded.config.hidden_state_layers = list(range(base.config.num_hidden_layers - 1))
    write_onnx_dir(loaded, root / "onnx")
    longest = args.promptTokens + args.answerTokens + 16  # the pool holds every base conversation and the copies
    capacity = (longest + args.answerTokens + 15) // 16 * 16
    build_engine(root / "onnx", root / "engine", BuildOptions(max_input_len=capacity, max_kv_cache_capacity=capacity,
                                                              max_batch_size=args.conversations + 2, tokens_per_page=16,
                                                              max_lora_rank=max(ranks)))
    paths = {}
    for name in names:
        paths[name] = str(root / f"{name}.safetensors")
        write_converted_adapter(root / "peft" / name, root / "onnx", Path(paths[name]))
    return paths


def best_ttft_ms(llm: Any, prompt: list[int], name: str, repeats: int) -> float:
    from kvforge import SamplingParams

    first = SamplingParams(temperature=0.0, top_k=1, max_generate_length=1)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate([prompt], first, lora_name=name)
        best = min(best, (time.perf_counter() - started) * 1e3)
    return best


def measure_engine(peft_model: Any, workload: Any, ranks: list[int], roles: list[str],
                   args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (role, rank), averaged over the conversations."""
    from kvforge import LLM, SamplingParams

    names = [f"{role}-r{rank}" for role in roles for rank in ranks]
    greedy = SamplingParams(temperature=0.0, top_k=1, max_generate_length=args.answerTokens)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        paths = build(peft_model, ranks, names, args, Path(folder))
        engine_dir = Path(folder) / "engine"
        exact = LLM(engine_dir, lora_weights=paths, enable_context_reuse=False, num_threads=args.threads)
        corrected = LLM(engine_dir, lora_weights=paths, lora_corrections=tuple(names), num_threads=args.threads)
        for conversation in workload.conversations:  # the base model's pages and factors for every adapter
            corrected.generate([conversation], SamplingParams(temperature=0.0, top_k=1, max_generate_length=1))
        for role in roles:
            for rank in ranks:
                name = f"{role}-r{rank}"
                runs = []
                for conversation in workload.conversations:
                    prompt = conversation + workload.invocations[role]
                    want = exact.generate([prompt], greedy, lora_name=name)[0]
                    got = corrected.generate([prompt], greedy, lora_name=name)[0]
                    runs.append({"equal_corrected": float(got.token_ids == want.token_ids),
                                 "first_equal": float(got.token_ids[:1] == want.token_ids[:1]),
                                 "corrected_pages": got.cached_tokens // 16,
                                 "exact_ms": best_ttft_ms(exact, prompt, name, args.repeats),
                                 "corrected_ms": best_ttft_ms(corrected, prompt, name, args.repeats)})
                row: dict[str, Any] = {"adapter": role, "rank": rank}
                row.update({key: statistics.fmean(run[key] for run in runs) for key in runs[0]})
                rows.append(row)
                print(format_engine_row(row), flush=True)
        corrected.engine.cache.check_invariants()
    return rows


def format_engine_row(row: dict[str, Any]) -> str:
    return (f"| {row['adapter']} | {row['rank']} | {row['equal_corrected']:.0%} | {row['first_equal']:.0%} | "
            f"{row['corrected_pages']:.0f} | {row['exact_ms']:.1f} / {row['corrected_ms']:.1f} | "
            f"{row['exact_ms'] / row['corrected_ms']:.1f}x |")
