"""Exact-checkpoint reuse on recurrent and hybrid engines: warm vs cold TTFT, hit rate per turn with endpoint-only
vs message-boundary capture, and snapshot bytes retained per cached token against KV bytes per token.

Two workloads run on three engines over the same engine dir (a pure recurrent or hybrid export):

- chat: an 8-turn conversation over a ~1,550-token document, the model's own greedy answers fed back as
  assistant turns (commit policy including_generated_tokens);
- document: one document, then four conversations that each ask a different question about it.

Engines: `boundaries` (reuse, recurrent snapshots, checkpoints where each earlier message ends: the default),
`endpoint` (the seed's capture: prompt and generation ends only) and `cold` (lookup bypass on the boundaries
engine: nothing looked up, nothing published). A recurrent model cannot rebuild its state from pages, so a
request hits only at an exact checkpoint: in the document workload the endpoint engine never hits (each
question diverges inside the previous request's prompt), the boundaries engine hits at the end of the
document's turn. Medians over --repeats (fresh cache salts: every repeat sees the same hits).

    python -m experiments.reuse.recurrent_reuse --onnxDir out/onnx/mamba2 --engineDir /tmp/mamba2-engine --threads 2
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments._common import Progress, bench_parser, build_and_open, fit_document, median, write_json
from experiments.reuse._common import QUESTIONS as CHAT  # the same 8-turn chat over the document as partial_reuse.py
from experiments.reuse._common import SYSTEM, Bench, make_request
from kvforge.builder.build import BuildOptions
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.geometry import kv_bytes_per_page
from kvforge.runtime.engine.engine import Engine, snapshot_budgets

DOCUMENT_TOKENS = 1550
MAX_GENERATE = 16
SNAPSHOT_SLOTS = 64
DOCUMENT_QUESTIONS = ["Who operates the array?", "When did construction start?", "What limits the output?",
             "What should be done next?"]


def build_options(onnx_dir: Path) -> BuildOptions:
    from kvforge.contract.files import read_json
    from kvforge.contract.model_config import ModelConfig

    config = ModelConfig.from_dict(read_json(onnx_dir / "config.json", "onnx_dir"))
    pages = 64 if config.attention_layer_ids else 0  # a pure recurrent engine keeps no pages at all
    return BuildOptions(max_input_len=4096, max_kv_cache_capacity=4096, max_batch_size=1, max_kv_pool_pages=pages)


def open_engines(onnx_dir: Path, engine_dir: Path, threads: int) -> dict[str, Engine]:
    options = build_options(onnx_dir)
    build_and_open(onnx_dir, engine_dir, options, threads)  # builds once
    budgets = snapshot_budgets(load_engine_dir(engine_dir), SNAPSHOT_SLOTS)
    return {"boundaries": build_and_open(onnx_dir, engine_dir, options, threads, reuse=True, **budgets),
            "endpoint": build_and_open(onnx_dir, engine_dir, options, threads, reuse=True,
                                       snapshot_message_boundaries=False, **budgets)}


def measure(boundaries: Bench, endpoint: Bench, messages: list[dict[str, str]], salt: str,
            samples: dict[str, list[float]], checks: list[str], label: str) -> dict[str, Any]:
    """One request on the boundaries and endpoint engines (warm) and cold (lookup bypass); TTFTs into samples."""
    request = make_request(boundaries.engine, messages, max_generate_length=MAX_GENERATE, chat=True, salt=salt)
    runs = {"boundaries": boundaries.run(request, reuse=True), "endpoint": endpoint.run(request, reuse=True),
            "cold": boundaries.run(request, reuse=False)}
    if len({tuple(run.token_ids) for run in runs.values()}) != 1:
        checks.append(f"{label} ({salt}): answers differ between warm and cold")
    for name, run in runs.items():
        samples[name].append(run.ttft_ms)
    return {"prompt_tokens": len(request.prompt_ids), **runs}


def hit_rates(runs: dict[str, Any]) -> dict[str, Any]:
    prompt = runs["prompt_tokens"]
    return {"prompt_tokens": prompt, **{f"cached_{name}": runs[name].cached_tokens for name in ("boundaries",
                                                                                              "endpoint")},
            **{f"hit_rate_{name}": runs[name].cached_tokens / prompt for name in ("boundaries", "endpoint")}}


def chat(engines: dict[str, Engine], document: str, salt: str, samples: list[dict[str, list[float]]],
         info: list[dict[str, Any]], checks: list[str]) -> None:
    boundaries, endpoint = Bench(engines["boundaries"]), Bench(engines["endpoint"])
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(CHAT):
        messages.append({"role": "user", "content": question.format(document=document)})
        runs = measure(boundaries, endpoint, messages, salt, samples[turn], checks, f"chat turn {turn + 1}")
        info[turn] = {"turn": turn + 1, **hit_rates(runs)}
        messages.append({"role": "assistant", "content": runs["boundaries"].output.text})


def shared_document(engines: dict[str, Engine], document: str, salt: str, samples: list[dict[str, list[float]]],
                    info: list[dict[str, Any]], checks: list[str]) -> None:
    boundaries, endpoint = Bench(engines["boundaries"]), Bench(engines["endpoint"])
    for i, question in enumerate(DOCUMENT_QUESTIONS):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Here is a report.\n\n{document}"},
                    {"role": "assistant", "content": "I have read the report."},
                    {"role": "user", "content": question}]
        runs = measure(boundaries, endpoint, messages, salt, samples[i], checks, f"document question {i + 1}")
        info[i] = {"question": i + 1, **hit_rates(runs)}


def rows_of(samples: list[dict[str, list[float]]], info: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for s, i in zip(samples, info, strict=True):
        m = {k: median(v) for k, v in s.items()}
        rows.append({**i, "ttft_cold_ms": m["cold"], "ttft_boundaries_ms": m["boundaries"],
                     "ttft_endpoint_ms": m["endpoint"], "cold_over_boundaries": m["cold"] / m["boundaries"],
                     "cold_over_endpoint": m["cold"] / m["endpoint"], "samples": s})
    return rows


def print_rows(title: str, key: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{key:>8} {'prompt':>6} {'hit bound.':>10} {'hit endp.':>9} {'cold ms':>8} {'bound. ms':>9} "
          f"{'endp. ms':>8} {'cold/bound.':>11} {'cold/endp.':>10}")
    for row in rows:
        print(f"{row[key]:>8} {row['prompt_tokens']:>6} {row['hit_rate_boundaries']:>10.0%} "
              f"{row['hit_rate_endpoint']:>9.0%} {row['ttft_cold_ms']:>8.1f} {row['ttft_boundaries_ms']:>9.1f} "
              f"{row['ttft_endpoint_ms']:>8.1f} {row['cold_over_boundaries']:>11.2f} "
              f"{row['cold_over_endpoint']:>10.2f}")


def retained_bytes(engine: Engine) -> dict[str, Any]:
    """Bytes the cache holds for its records (snapshot slots and record pages) per token of the longest record,
    against the K/V an attention model of the same depth and width would keep per token (fp16, one KV head per
    query head) and, on a hybrid, against its own attention layers' K/V per token."""
    model, build = engine.engine_dir.model, engine.engine_dir.build
    pools = engine.profile()["context_cache"]["resource_pools"]
    used = {name: pool["capacity"] - pool["free"] for name, pool in pools.items()}
    page = kv_bytes_per_page(model.num_key_value_heads, model.head_dim, build.tokens_per_page, model.kv_cache_dtype) \
        * len(model.attention_layer_ids) if model.attention_layer_ids else 0
    held = (used["recurrent_snapshots"] * build.recurrent_snapshot_bytes_per_slot
            + used["partial_kv_snapshots"] * build.partial_kv_snapshot_bytes_per_slot
            + used["base_kv_pages"] * page)
    longest = max((len(r.token_ids) for r in engine.cache.records.least_recent_first()), default=0)
    dense_kv = 2 * model.num_hidden_layers * model.hidden_size * 2
    own_kv = page // build.tokens_per_page if page else 0
    # One checkpoint of the whole conversation: its recurrent slot, its partial page and its full pages.
    one = build.recurrent_snapshot_bytes_per_slot + (build.partial_kv_snapshot_bytes_per_slot if page else 0) \
        + own_kv * longest
    return {"bytes_held": held, "longest_record_tokens": longest, "records": len(engine.cache.records),
            "used_slots": used, "bytes_held_per_cached_token": held / longest if longest else None,
            "one_checkpoint_bytes_per_token": one / longest if longest else None,
            "attention_kv_bytes_per_token_same_shape": dense_kv, "own_kv_bytes_per_token": own_kv,
            "recurrent_snapshot_bytes_per_slot": build.recurrent_snapshot_bytes_per_slot}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--engineDir", type=Path, required=True, help="where to build the engine (reused if built)")
    parser.add_argument("--documentTokens", type=int, default=DOCUMENT_TOKENS)
    args = parser.parse_args()
    progress = Progress()
    engines = open_engines(args.onnxDir, args.engineDir, args.threads)
    document, doc_tokens = fit_document(engines["boundaries"].tokenizer.encode, args.documentTokens)
    progress(f"engines ready ({engines['boundaries'].deployment.name.lower()}); document {doc_tokens} tokens")
    checks: list[str] = []
    chat_samples = [{"boundaries": [], "endpoint": [], "cold": []} for _ in CHAT]
    chat_info: list[dict[str, Any]] = [{} for _ in CHAT]
    doc_samples = [{"boundaries": [], "endpoint": [], "cold": []} for _ in DOCUMENT_QUESTIONS]
    doc_info: list[dict[str, Any]] = [{} for _ in DOCUMENT_QUESTIONS]
    retained: dict[str, Any] = {}
    for r in range(args.repeats):
        chat(engines, document, f"chat-{r}", chat_samples, chat_info, checks)
        if r == 0:
            retained = retained_bytes(engines["boundaries"])
        shared_document(engines, document, f"doc-{r}", doc_samples, doc_info, checks)
        progress(f"repeat {r + 1}/{args.repeats}")
    chat_rows, doc_rows = rows_of(chat_samples, chat_info), rows_of(doc_samples, doc_info)
    print_rows("8-turn chat over the document (TTFT, hit rate = cached / prompt tokens)", "turn", chat_rows)
    print_rows("one document, four questions in separate conversations", "question", doc_rows)
    print(f"\nretained after one chat: {retained['bytes_held']:,} bytes for {retained['records']} records (every "
          f"boundary and endpoint checkpoint), longest {retained['longest_record_tokens']} tokens -> "
          f"{retained['bytes_held_per_cached_token'] or 0:,.0f} bytes per cached token; one checkpoint of the whole "
          f"conversation: {retained['one_checkpoint_bytes_per_token'] or 0:,.0f} bytes per token. An attention model "
          f"of the same depth and width keeps {retained['attention_kv_bytes_per_token_same_shape']:,} bytes of fp16 "
          f"K/V per token (this model's own attention layers: {retained['own_kv_bytes_per_token']:,})")
    for problem in checks:
        print(f"CHECK FAILED: {problem}")
    write_json(args.json, {"document_tokens": doc_tokens, "deployment": engines["boundaries"].deployment.name,
                           "threads": args.threads, "repeats": args.repeats, "checks": checks, "chat": chat_rows,
                           "document": doc_rows, "retained": retained})


if __name__ == "__main__":
    main()
