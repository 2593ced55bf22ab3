"""LoRA cost on SmolLM2: prefill and decode tokens/s with an adapter vs without, adapter switch time, and a
batch mixing two adapters in one call (per-row adapter inputs) against one call per adapter group.

    python -m experiments.adapters.lora --onnxDir onnx/smollm2-lora --threads 2

The ONNX dir must be exported with LoRA inputs (llm_export ... --loraTargets all, the default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR, load_engine_dir
from kvforge.runtime.adapters import load_adapter, lora_input_shapes, stack_adapters
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.tools.export.lora import write_converted_adapter, write_random_peft_adapter


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnxDir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--promptTokens", type=int, default=256)
    parser.add_argument("--decodeTokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        options = dict(max_input_len=1024, max_kv_cache_capacity=1024, max_batch_size=2, tokens_per_page=128)
        build_engine(args.onnxDir, work / "lora_engine", BuildOptions(**options, max_lora_rank=args.rank))
        build_engine(args.onnxDir, work / "base_engine", BuildOptions(**options))
        engine = load_engine_dir(work / "lora_engine")
        adapters = []
        for seed in (1, 2):
            write_random_peft_adapter(args.onnxDir, work / f"peft{seed}", rank=args.rank, seed=seed)
            write_converted_adapter(work / f"peft{seed}", args.onnxDir, work / f"a{seed}.safetensors")
        started = time.perf_counter()
        adapters = [load_adapter(f"a{seed}", work / f"a{seed}.safetensors", engine, "bench") for seed in (1, 2)]
        load_ms = (time.perf_counter() - started) * 1e3 / 2
        shapes = lora_input_shapes(engine)
        started = time.perf_counter()
        single = [stack_adapters([a], shapes) for a in adapters]  # what one row on one adapter binds
        stack_ms = (time.perf_counter() - started) * 1e3 / 2
        mixed = stack_adapters(adapters, shapes)  # rows on adapters A and B in one call
        runner = OrtBackend(engine, args.threads)
        base_runner = OrtBackend(load_engine_dir(work / "base_engine"), args.threads)
        embedding = load_file(str(engine.file(EMBEDDING_FILE)))[EMBEDDING_TENSOR]
        ids = np.random.default_rng(0).integers(0, embedding.shape[0], args.promptTokens)
        prompt = embedding[ids][None]
        pages = list(range(engine.build.max_pages_per_seq))
        token = embedding[ids[:1]][None]

        def prefill(r: OrtBackend, tensors) -> None:
            r.forward(StepInputs(prompt, np.array([args.promptTokens]), np.array([0]), [pages], tensors))

        def decode(r: OrtBackend, tensors) -> None:
            for step in range(args.decodeTokens):
                r.forward(StepInputs(token, np.array([1]), np.array([args.promptTokens + step]), [pages], tensors))

        two_pages = [pages, [p + engine.build.max_pages_per_seq for p in pages]]
        two_tokens = np.concatenate([token, token])

        def mixed_grouped() -> None:  # the alternative: one call per adapter group
            for step in range(args.decodeTokens):
                for row in range(2):
                    runner.forward(StepInputs(token, np.array([1]), np.array([args.promptTokens + step]),
                                              [two_pages[row]], single[row]))

        def mixed_per_row() -> None:  # what the runtime does: rows on adapters A and B in one call
            for step in range(args.decodeTokens):
                runner.forward(StepInputs(two_tokens, np.array([1, 1]), np.array([args.promptTokens + step] * 2),
                                          two_pages, mixed))

        prefill(runner, None)  # warm both sessions
        prefill(base_runner, None)
        prefill(runner, single[0])
        results = {
            "prefill_base_engine_s": median_time(lambda: prefill(base_runner, None), args.repeats),
            "prefill_no_adapter_s": median_time(lambda: prefill(runner, None), args.repeats),
            "prefill_adapter_s": median_time(lambda: prefill(runner, single[0]), args.repeats),
            "decode_base_engine_s": median_time(lambda: decode(base_runner, None), args.repeats),
            "decode_no_adapter_s": median_time(lambda: decode(runner, None), args.repeats),
            "decode_adapter_s": median_time(lambda: decode(runner, single[0]), args.repeats),
            "decode_mixed_grouped_s": median_time(mixed_grouped, args.repeats),
            "decode_mixed_per_row_s": median_time(mixed_per_row, args.repeats),
        }

        def one_step(tensors) -> None:
            runner.forward(StepInputs(token, np.array([1]), np.array([args.promptTokens]), [pages], tensors))

        def alternate() -> None:
            for i in range(10):
                one_step(single[i % 2])

        def same() -> None:
            for _ in range(10):
                one_step(single[0])

        switch_ms = (median_time(alternate, args.repeats) - median_time(same, args.repeats)) * 1e3 / 10

    n, d = args.promptTokens, args.decodeTokens
    figures = {
        "rank": args.rank, "threads": args.threads,
        "prefill_tok_s_base_engine": n / results["prefill_base_engine_s"],
        "prefill_tok_s_no_adapter": n / results["prefill_no_adapter_s"],
        "prefill_tok_s_adapter": n / results["prefill_adapter_s"],
        "decode_tok_s_base_engine": d / results["decode_base_engine_s"],
        "decode_tok_s_no_adapter": d / results["decode_no_adapter_s"],
        "decode_tok_s_adapter": d / results["decode_adapter_s"],
        "mixed_batch_decode_tok_s_grouped": 2 * d / results["decode_mixed_grouped_s"],
        "mixed_batch_decode_tok_s_per_row": 2 * d / results["decode_mixed_per_row_s"],
        "adapter_switch_ms_per_call": switch_ms,
        "adapter_load_ms": load_ms,
        "adapter_stack_ms": stack_ms,
    }
    figures["prefill_ratio_adapter_vs_none"] = figures["prefill_tok_s_adapter"] / figures["prefill_tok_s_no_adapter"]
    figures["decode_ratio_adapter_vs_none"] = figures["decode_tok_s_adapter"] / figures["decode_tok_s_no_adapter"]
    figures["prefill_ratio_lora_engine_vs_base_engine"] = (figures["prefill_tok_s_no_adapter"]
                                                           / figures["prefill_tok_s_base_engine"])
    figures["decode_ratio_lora_engine_vs_base_engine"] = (figures["decode_tok_s_no_adapter"]
                                                          / figures["decode_tok_s_base_engine"])
    figures["mixed_batch_per_row_vs_grouped"] = (figures["mixed_batch_decode_tok_s_per_row"]
                                                 / figures["mixed_batch_decode_tok_s_grouped"])
    for key, value in figures.items():
        print(f"{key:46} {value:10.3f}" if isinstance(value, float) else f"{key:46} {value:>10}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
