"""What the speculative-decoding scripts share: the block and MTP drafts' build, workload and one-call timing.

block_draft.py, gemma4_mtp.py and hybrid_mtp.py measure drafts of the real shape the same way: one base engine,
a ~1,500-token document, decode and TTFT figures against plain decoding, and one backend call's cost.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from experiments._common import chat_request as common_chat_request
from experiments._common import median, run_alone
from kvforge.builder.build import BuildOptions
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.execution.backend import Backend, StepInputs
from kvforge.runtime.execution.tree_attention import causal_masks, start_positions
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams

BUILD = BuildOptions(max_input_len=2048, max_kv_cache_capacity=2304, max_batch_size=1, tokens_per_page=128)
DOCUMENT_TOKENS = 1500
MAX_GENERATE = 64
CONTEXTS = (64, 1536)


def chat_request(engine: Engine, text: str, reuse: bool = True) -> EngineRequest:
    return common_chat_request(engine, text, SamplingParams(temperature=0.0, max_generate_length=MAX_GENERATE,
                                                            reuse_context=reuse))


def run_one(engine: Engine, request: EngineRequest) -> dict[str, Any]:
    output = run_alone(engine, request)
    assert output.timing is not None
    spec = engine.profile().get("spec_decode_generation", {})
    generated = len(output.token_ids)
    return {"tokens": output.token_ids, "ttft_ms": output.timing.ttft_ms,
            "decode_tok_s": (generated - 1) * 1e3 / output.timing.decode_ms if output.timing.decode_ms else 0.0,
            "acceptance_length": spec.get("acceptance_length", 1.0)}


def decode_figures(run: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """A speculative run's decode figures against the plain run of the same request (run_one's results)."""
    return {"decode_tok_s": run["decode_tok_s"], "plain_decode_tok_s": plain["decode_tok_s"],
            "vs_plain": run["decode_tok_s"] / plain["decode_tok_s"], "acceptance_length": run["acceptance_length"],
            "same_tokens": run["tokens"] == plain["tokens"]}


def ttft_figures(warm: dict[str, Any], cold: dict[str, Any]) -> dict[str, Any]:
    """A warm run's TTFT against the cold run of the same request (run_one's results)."""
    return {"cold_ttft_ms": cold["ttft_ms"], "warm_ttft_ms": warm["ttft_ms"],
            "warm_over_cold": warm["ttft_ms"] / cold["ttft_ms"], "warm_same_tokens": warm["tokens"] == cold["tokens"]}


def decode_line(row: dict[str, Any]) -> str:
    return (f"decode {row['decode_tok_s']:.1f} tok/s vs plain {row['plain_decode_tok_s']:.1f} "
            f"({row['vs_plain']:.2f}x), acceptance length {row['acceptance_length']:.2f}, same tokens "
            f"{row['same_tokens']}")


def ttft_line(row: dict[str, Any], detail: str) -> str:
    return (f"TTFT warm {row['warm_ttft_ms']:.0f} ms vs cold {row['cold_ttft_ms']:.0f} ms "
            f"({row['warm_over_cold']:.2f}), {detail}, same tokens {row['warm_same_tokens']}")


def call_ms(backend: Backend, hidden_size: int, width: int, start: int, repeats: int,
            extra: dict[str, np.ndarray] | None = None, masked: bool = False, state_row: int | None = None) -> float:
    """Median ms of one call of `width` new tokens after `start` cached ones (pages 0.., values irrelevant;
    `state_row`: a recurrent engine's state row)."""
    T = backend.tokens_per_page  # type: ignore[attr-defined]
    pages = list(range((start + width) // T + 1))
    embeds = np.random.default_rng(0).standard_normal((1, width, hidden_size)).astype(np.float32)
    mask = causal_masks(1, width)
    if masked:
        mask[:] = True
    step = StepInputs(embeds, np.array([width], np.int32), np.array([start], np.int32), [pages],
                      state_rows=None if state_row is None else [state_row],
                      logits_indices=np.arange(width), extra_inputs=extra or {},
                      position_ids=start_positions(np.array([start]), width) if masked else None,
                      attention_mask=mask if masked else None)
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        backend.forward(step)
        times.append((time.perf_counter() - began) * 1e3)
    return median(times[1:])
