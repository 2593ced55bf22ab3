"""MTP on a hybrid base: a Qwen3.5-shaped model (small-qwen3_5: 0.8B's widths, 8 layers) with a random MTP layer,
against plain decoding, in one run.

No public Qwen3.5 checkpoint can be downloaded here, so base and MTP layer are random: guesses are almost never
accepted and every verify row rolls the base's recurrent state back. What it measures:

- a decode step, a verify call of k + 1 tokens and one MTP draft step, at 64 and 1,536 tokens of context;
- the base's recurrent rollback as built (the row copied before the verify call, copied back on a rejection, and
  the kept tokens recomputed next step: a call of a + 1 tokens for a accepted drafts) against keeping the state
  after every verified position instead (no recompute, but k + 1 states written per verify row: timed here as the
  copies alone, a lower bound for a kernel that would emit them);
- decode tok/s with MTP against plain, and the acceptance length, on a question about a ~1,500-token document;
- TTFT of a second question on the document, warm (a batch of one, both snapshot pools: the checkpoint restored and
  the draft's tail replayed) vs cold.

    python -m experiments.spec.hybrid_mtp --threads 2
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from experiments._common import Progress, bench_parser, median, write_json
from experiments.spec._common import (
    BUILD,
    CONTEXTS,
    DOCUMENT_TOKENS,
    MAX_GENERATE,
    call_ms,
    chat_request,
    decode_figures,
    decode_line,
    run_one,
    ttft_figures,
    ttft_line,
)
from kvforge.builder.build import build_engine
from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, DRAFT_HIDDEN_INPUT
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams
from kvforge.tools.bench.text import fit_document, spec_messages
from kvforge.tools.export.drafts.qwen3_5_mtp import export_mtp, write_random_mtp
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

DRAFT_STEP = 6
SNAPSHOT_BYTES = 256 * 2**20  # each snapshot pool, for the warm run


def timed_ms(action, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        action()
        times.append((time.perf_counter() - began) * 1e3)
    return median(times[1:])


def main() -> None:
    parser = bench_parser(__doc__, repeats=5, onnx_dir=False)
    args = parser.parse_args()
    progress = Progress()
    row: dict[str, Any] = {"draft_step": DRAFT_STEP}
    with tempfile.TemporaryDirectory(prefix="kvforge-hmtp-") as tmp:
        root = Path(tmp)
        progress("exporting small-qwen3_5 and a random MTP layer")
        loaded = synthetic_model("small-qwen3_5", hidden_state_layers=[7])
        write_onnx_dir(loaded, root / "base_onnx")
        build_engine(root / "base_onnx", root / "engine", replace(BUILD, spec_base=True))
        write_random_mtp(root / "base_onnx", root / "hf", seed=1)
        export_mtp(root / "hf", root / "base_onnx", root / "mtp_onnx")
        build_engine(root / "mtp_onnx", root / "engine" / "draft", replace(BUILD, spec_draft=True))
        plain = Engine(root / "engine", EngineConfig(num_threads=args.threads))
        # The synthetic model's tokenizer is byte-level: the report cut to about DOCUMENT_TOKENS bytes.
        text, _ = fit_document(plain.tokenizer.encode, DOCUMENT_TOKENS)
        document = text[:text.rfind(".", 0, DOCUMENT_TOKENS) + 1]
        doc_tokens = len(plain.tokenizer.encode(document))
        questions = next(iter(spec_messages(document).values()))
        progress("plain")
        base_run = run_one(plain, chat_request(plain, questions[0], reuse=False))
        engine = Engine(root / "engine", EngineConfig(num_threads=args.threads, spec_decode="mtp",
                                                      spec_draft_step=DRAFT_STEP))
        H = engine.engine_dir.model.hidden_size
        states = engine.states
        assert states is not None
        state_row = states.allocate()
        progress("call costs")
        draft = engine.proposer.backend  # type: ignore[union-attr]
        zeros = {BASE_HIDDEN_INPUT: np.zeros((1, 1, H), np.float32), DRAFT_HIDDEN_INPUT: np.zeros((1, 1, H),
                                                                                                  np.float32)}
        for context in CONTEXTS:
            decode = call_ms(engine.backend, H, 1, context, args.repeats, state_row=state_row)
            verify = call_ms(engine.backend, H, DRAFT_STEP + 1, context, args.repeats, state_row=state_row)
            kept3 = call_ms(engine.backend, H, 4, context, args.repeats, state_row=state_row)
            step = call_ms(draft, H, 1, context, args.repeats, zeros)
            row |= {f"decode_ms@{context}": decode, f"verify_{DRAFT_STEP + 1}_ms@{context}": verify,
                    f"verify_over_decode@{context}": verify / decode, f"mtp_step_ms@{context}": step,
                    f"recompute_1_ms@{context}": decode, f"recompute_4_ms@{context}": kept3}
        progress("rollback: row copy vs per-position states")
        per_row = states.bytes_per_row
        copy_ms = timed_ms(lambda: (states.save([state_row]), states.rollback(state_row)), args.repeats * 4)
        snapshot = np.concatenate([a.reshape(-1) for a in states.read(state_row)])
        positions = np.empty((DRAFT_STEP + 1, snapshot.size), np.float32)

        def write_positions() -> None:
            for k in range(DRAFT_STEP + 1):
                positions[k] = snapshot

        per_position_ms = timed_ms(write_positions, args.repeats * 4)
        states.free(state_row)  # the engine's batch of one needs its row back
        row |= {"state_bytes_per_row": per_row, "row_save_and_restore_ms": copy_ms,
                f"per_position_{DRAFT_STEP + 1}_states_ms": per_position_ms}
        progress("decoding")
        run = run_one(engine, chat_request(engine, questions[0], reuse=False))
        row |= decode_figures(run, base_run)
        progress("warm vs cold TTFT")
        warm_engine = Engine(root / "engine", EngineConfig(
            num_threads=args.threads, spec_decode="mtp", spec_draft_step=DRAFT_STEP, enable_context_reuse=True,
            max_batch_size=1, context_cache_recurrent_snapshot_pool_bytes=SNAPSHOT_BYTES,
            context_cache_partial_kv_snapshot_pool_bytes=SNAPSHOT_BYTES))
        # Checkpoints are exact prompt ends (endpoint-only capture): the second request extends the first's prompt.
        first = warm_engine.tokenizer.encode(questions[0])  # the document and a question
        second = first + warm_engine.tokenizer.encode(questions[1][len(document):])  # ... and the next question

        def raw(ids: list[int], reuse: bool = True) -> EngineRequest:
            return EngineRequest(ids, SamplingParams(temperature=0.0, max_generate_length=MAX_GENERATE,
                                                     reuse_context=reuse))

        run_one(warm_engine, raw(first))
        warm = run_one(warm_engine, raw(second))
        cold = run_one(warm_engine, raw(second, reuse=False))
        cache = warm_engine.profile().get("context_cache", {})
        row |= ttft_figures(warm, cold) | {"reused_tokens": cache.get("reused_tokens", 0)}
    k = DRAFT_STEP
    print(f"\nhybrid MTP bench: small-qwen3_5 (random), a random MTP layer, {args.threads} threads, document "
          f"{doc_tokens} tokens, greedy, {MAX_GENERATE} tokens; total {progress.elapsed:.0f} s\n")
    for c in CONTEXTS:
        print(f"@{c}: decode step {row[f'decode_ms@{c}']:.1f} ms, verify {k + 1} tokens "
              f"{row[f'verify_{k + 1}_ms@{c}']:.1f} ms = {row[f'verify_over_decode@{c}']:.2f}x, MTP step "
              f"{row[f'mtp_step_ms@{c}']:.1f} ms, recompute after a rejection {row[f'recompute_1_ms@{c}']:.1f} ms "
              f"(0 kept) / {row[f'recompute_4_ms@{c}']:.1f} ms (3 kept)")
    print(f"rollback: {row['state_bytes_per_row'] / 2**20:.1f} MiB of state per row; row copy before + after "
          f"{row['row_save_and_restore_ms']:.2f} ms vs writing {k + 1} per-position states "
          f"{row[f'per_position_{k + 1}_states_ms']:.2f} ms (then no recompute)")
    print(decode_line(row))
    print(ttft_line(row, f"reused {row['reused_tokens']} tokens"))
    write_json(args.json, row)


if __name__ == "__main__":
    main()
