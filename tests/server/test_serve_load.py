"""The serve benchmark's load client (kvforge.tools.bench.serve_load) against a live llm_serve on the tiny engine: it
sends what it says (growing sessions, exactly max_tokens tokens each), measures from the stream, and the server's own
counters agree with it; bad arguments fail naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.server_harness import MODEL, live_server

from kvforge.builder.build import BuildOptions
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import KvforgeError
from kvforge.tools.bench import serve_load

# Byte-level tokenizer: a 2-turn session with 3 short documents a turn is a few hundred tokens.
LOAD_BUILD = BuildOptions(max_input_len=1024, max_kv_cache_capacity=4096, max_batch_size=4, tokens_per_page=16)


def prefix_hits(server) -> float:
    _, text = server.request("GET", "/metrics")
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:prefix_cache_hits_total")


def test_sessions_grow_and_draw_three_documents_in_changing_order() -> None:
    work = serve_load.sessions(4, 3, doc_words=5, seed=7)
    assert work == serve_load.sessions(4, 3, doc_words=5, seed=7)  # the same prompts for every server
    for session in work:
        for before, after in zip(session.turns, session.turns[1:], strict=False):
            assert after[:len(before)] == before and len(after) == len(before) + 2  # + reply + next user message
        users = [turn[-1]["content"] for turn in session.turns]
        assert all(u.count("Document ") == serve_load.PER_TURN for u in users)
    firsts = {turn[-1]["content"].split("\n\n")[1] for s in work for turn in s.turns}
    assert len(firsts) > 1  # the order changes between turns and sessions
    with pytest.raises(KvforgeError, match="sessions"):
        serve_load.sessions(0, 2, doc_words=5)


def test_load_client_measures_a_live_server(engine_dir_for: Callable[..., Path], tmp_path: Path) -> None:
    engine_dir = engine_dir_for(build=LOAD_BUILD)
    banned = list(load_engine_dir(engine_dir).model.eos_token_ids)
    work = serve_load.sessions(3, 2, doc_words=3, seed=1, system_prompt="Be brief.")
    with live_server(engine_dir, tmp_path, reuse=True) as server:
        before = prefix_hits(server)
        figures = serve_load.level(server.url, MODEL, 2, work, max_tokens=5, banned=banned)
        after = prefix_hits(server)
        with pytest.raises(KvforgeError, match="clients"):
            serve_load.level(server.url, MODEL, 0, work, max_tokens=5, banned=banned)
        bad = serve_load.level(server.url, "no-such-model", 1, work[:1], max_tokens=5, banned=banned)
    assert figures.requests == 6 and figures.errors == 0, figures
    assert figures.output_tokens == 6 * 5  # end tokens banned: every request generated exactly max_tokens
    assert 0 < figures.ttft_p50_ms <= figures.ttft_p95_ms and figures.ttft_p50_ms <= figures.latency_p50_ms
    assert figures.requests_per_s > 0 and figures.output_tokens_per_s == pytest.approx(30 / figures.wall_s, rel=0.01)
    # A second turn extends the first's prompt, so the server served part of it from its prefix cache.
    assert after - before > 0 and figures.prompt_tokens > after - before
    assert bad.errors == 2 and bad.requests == 2 and set(bad.error_kinds) == {"HTTP 404"}, bad
