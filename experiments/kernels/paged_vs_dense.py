"""Prefill and decode tokens/s of the paged engine against the same graph run as a plain dense ORT model.

Both variants come from one export: the paged engine is what llm_build writes; the dense baseline is the
same graph lowered with per-layer past_key/past_value tensors (concat, no pages, no scatter). Ratios are
measured in one run on the same machine, so they hold even where absolute numbers vary.

    python -m experiments.kernels.paged_vs_dense --onnxDir onnx/smollm2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from safetensors.numpy import load_file

from kvforge.builder.build import BuildOptions, build_engine, read_onnx_dir
from kvforge.builder.lora import strip_lora
from kvforge.builder.lower_ort import lower_for_onnxruntime
from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR, load_engine_dir
from kvforge.plugins.reference import rope_table
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.ort import OrtBackend, make_session


def dense_session(onnx_dir: Path, work: Path, threads: int):
    config = read_onnx_dir(onnx_dir)
    model = strip_lora(onnx.load(onnx_dir / "model.onnx"))  # the paged engine is built without LoRA too
    dense = lower_for_onnxruntime(model, kv_cache_dtype=config.kv_cache_dtype, tokens_per_page=128, num_pages=1,
                                  dense=True)
    onnx.save_model(dense, work / "dense.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location="dense.onnx.data", size_threshold=1024)
    return make_session(str(work / "dense.onnx"), threads), config


class DenseModel:
    def __init__(self, session, config, capacity: int) -> None:
        self.session, self.config = session, config
        self.rope = rope_table(capacity, config.head_dim, config.rope_theta)
        self.reset()

    def reset(self) -> None:
        c = self.config
        empty = np.zeros((1, c.num_key_value_heads, 0, c.head_dim), dtype=np.float32)
        self.past = {f"past_{kind}_{i}": empty for i in range(c.num_hidden_layers) for kind in ("key", "value")}
        self.length = 0

    def forward(self, embeds: np.ndarray) -> np.ndarray:
        n = embeds.shape[1]
        feeds = {"inputs_embeds": embeds, "context_lengths": np.array([n], np.int32),
                 "kvcache_start_index": np.array([self.length], np.int32), "rope_rotary_cos_sin": self.rope,
                 "logits_indices": np.array([n - 1], np.int64), **self.past}
        names = [o.name for o in self.session.get_outputs()]
        outputs = dict(zip(names, self.session.run(names, feeds), strict=True))
        self.past = {name.replace("present_", "past_"): value for name, value in outputs.items()
                     if name.startswith("present_")}
        self.length += n
        return outputs["logits"]


def paged_forward(runner: OrtBackend, pages: list[int], start: int, embeds: np.ndarray) -> np.ndarray:
    n = embeds.shape[1]
    return runner.forward(StepInputs(embeds, np.array([n], np.int32), np.array([start], np.int32), [pages])).logits


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnxDir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--promptTokens", type=int, default=512)
    parser.add_argument("--decodeTokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    capacity = 2048
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_engine(args.onnxDir, work / "engine", BuildOptions(max_input_len=1024, max_kv_cache_capacity=capacity,
                                                                 max_batch_size=1, tokens_per_page=128))
        engine = load_engine_dir(work / "engine")
        runner = OrtBackend(engine, args.threads)
        session, config = dense_session(args.onnxDir, work, args.threads)
        dense = DenseModel(session, config, capacity)
        embedding = load_file(str(engine.file(EMBEDDING_FILE)))[EMBEDDING_TENSOR]
        ids = np.random.default_rng(0).integers(0, config.vocab_size, args.promptTokens + args.decodeTokens)
        prompt = embedding[ids[:args.promptTokens]][None]
        pages = list(range(engine.build.max_pages_per_seq))[::-1]  # non-contiguous on purpose

        results: dict[str, list[float]] = {k: [] for k in ("paged_prefill", "dense_prefill", "paged_decode",
                                                           "dense_decode")}
        max_diff = 0.0
        for _ in range(args.repeats):
            dense.reset()
            results["dense_prefill"].append(timed(lambda: dense.forward(prompt)))
            results["paged_prefill"].append(timed(lambda: paged_forward(runner, pages, 0, prompt)))
            paged_time = dense_time = 0.0
            for step in range(args.decodeTokens):
                token = embedding[ids[args.promptTokens + step]][None, None]
                started = time.perf_counter()
                paged_logits = paged_forward(runner, pages, args.promptTokens + step, token)
                paged_time += time.perf_counter() - started
                started = time.perf_counter()
                dense_logits = dense.forward(token)
                dense_time += time.perf_counter() - started
                max_diff = max(max_diff, float(np.abs(paged_logits - dense_logits).max()))
            results["paged_decode"].append(paged_time)
            results["dense_decode"].append(dense_time)

    best = {k: statistics.median(v) for k, v in results.items()}
    figures = {
        "threads": args.threads, "prompt_tokens": args.promptTokens, "decode_tokens": args.decodeTokens,
        "paged_prefill_tok_s": args.promptTokens / best["paged_prefill"],
        "dense_prefill_tok_s": args.promptTokens / best["dense_prefill"],
        "paged_decode_tok_s": args.decodeTokens / best["paged_decode"],
        "dense_decode_tok_s": args.decodeTokens / best["dense_decode"],
        "max_abs_logit_diff": max_diff,
    }
    figures["prefill_ratio"] = figures["paged_prefill_tok_s"] / figures["dense_prefill_tok_s"]
    figures["decode_ratio"] = figures["paged_decode_tok_s"] / figures["dense_decode_tok_s"]
    print(f"{'':10}{'paged tok/s':>14}{'dense tok/s':>14}{'paged/dense':>13}")
    for phase in ("prefill", "decode"):
        print(f"{phase:10}{figures[f'paged_{phase}_tok_s']:14.1f}{figures[f'dense_{phase}_tok_s']:14.1f}"
              f"{figures[f'{phase}_ratio']:13.3f}")
    print(f"max |paged - dense| logits over decode: {max_diff:.2e} (fp16 KV storage vs fp32 dense cache)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
