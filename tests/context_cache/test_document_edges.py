"""Documents as retrievers produce them (issue 53 item 3): whitespace at a document's edge, which a whole-prompt
tokenization merges with the next token, does not disable reuse (the prompt is tokenized part by part); the
document items that still cannot be reused are counted by reason and named once on stderr."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvforge import LLM, SamplingParams
from kvforge.contract.engine_dir import ENGINE_KIND
from kvforge.contract.manifest import write_manifest
from kvforge.runtime.cli import skipped_documents_note
from kvforge.runtime.context_cache.types.document_chunks import DOCUMENT_COUNTERS
from kvforge.runtime.engine.engine import RequestOutput
from kvforge.runtime.inputs.checks import parse_messages
from kvforge.runtime.types import Request

GREEDY = SamplingParams(temperature=0, max_generate_length=6)
# Two reports of 17 bytes (the tiny tokenizer: a token per byte, plus the merges added below), so each fills a
# 16-token page and a prompt of both fits the engine's 64 tokens. Each begins with "The", so a space ending the report
# before it merges into " T"; the text after a report begins with the separator, so a newline ending a report merges
# with a blank line after it. Prompts are the contents joined (no chat template): the tiny engine's template alone
# would take a third of its maxInputLen.
REPORTS = ["The pump stopped.", "The gate is shut."]
EDGES = {"space": (" ", ""), "newline": ("\n", "\n\n")}  # (what ends each report, the text between parts)


def with_tokenizer(engine_dir: Path, target: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the engine dir whose tokenizer.json `edit` changed."""
    shutil.copytree(engine_dir, target)
    config = json.loads((target / "tokenizer.json").read_text())
    edit(config)
    (target / "tokenizer.json").write_text(json.dumps(config))
    write_manifest(target, ENGINE_KIND)  # the edit is deliberate: record it, as llm_build would have
    return target


def add_merges(config: dict[str, Any]) -> None:
    """A space joins the letter after it (" T") and newlines join (as byte-level BPE merges them): in a whole-prompt
    encoding, a report ending with a space or a newline shares its last token with the text after it."""
    take_ids(config, "ĠT", "ĊĊ")
    config["model"]["merges"] = ["Ġ T", "Ċ Ċ"]


def take_ids(config: dict[str, Any], *tokens: str) -> None:
    """Give `tokens` the ids of byte tokens no text here holds (bytes 0xFE, 0xFF: "þ", "ÿ" in byte-level BPE): the
    engine's embedding has no row past the tokenizer's vocabulary."""
    vocab = config["model"]["vocab"]
    for token, byte in zip(tokens, ("þ", "ÿ"), strict=False):
        vocab[token] = vocab.pop(byte)


@pytest.fixture(scope="module")
def merging_engine(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_tokenizer(tiny_engine_dir, tmp_path_factory.mktemp("merging") / "engine", add_merges)


def messages(system: str, reports: list[str], edge: str, separator: str) -> list[dict[str, Any]]:
    """The reports as document parts, each ending with `edge`, `separator` after each, then the question."""
    content: list[dict[str, Any]] = []
    for i, report in enumerate(reports):
        content.append({"type": "document", "text": report + edge})
        text = separator + ("Tell me why?" if i == len(reports) - 1 else "")
        if text:
            content.append({"type": "text", "text": text})
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def plain(chat: list[dict[str, Any]]) -> Request:
    return Request(0, parse_messages(chat, "messages"), GREEDY, apply_chat_template=False)


def answer(llm: LLM, chat: list[dict[str, Any]]) -> RequestOutput:
    engine = llm.engine
    request_id = engine.add_request(engine.inputs.process(plain(chat), where=""))
    final = None
    while engine.has_unfinished():
        final = next((out for out in engine.step() if out.request_id == request_id and out.finished), final)
    assert final is not None
    return final


def ask_twice(llm: LLM, edge: str, separator: str) -> list[RequestOutput]:
    """The reports behind one system prompt, then in the other order behind another (a timestamp)."""
    return [answer(llm, messages("t=1\n", REPORTS, edge, separator)),
            answer(llm, messages("t=22\n", REPORTS[::-1], edge, separator))]


def chat_request(edge: str, separator: str) -> Request:
    return plain(messages("t=1\n", REPORTS, edge, separator))


@pytest.mark.parametrize(("edge", "merged"), [("space", "ĠT"), ("newline", "ĊĊ")])
def test_the_merge_is_real_and_the_prompt_is_tokenized_part_by_part(merging_engine: Path, edge: str,
                                                                    merged: str) -> None:
    """Whole-prompt tokens cross the reports' edges; the processed prompt keeps each report's own tokens."""
    inputs = LLM(str(merging_engine), num_threads=1).engine.inputs
    end, separator = EDGES[edge]
    request = chat_request(end, separator)
    processed = inputs.process(request, where="")
    raw = inputs.tokenizer.tokenizer
    whole = inputs.tokenizer.encode(inputs.prompt_text(request))
    assert raw.token_to_id(merged) in whole  # the merge a whole-prompt tokenization makes across a report's edge
    assert len(processed.documents) == 2 and processed.documents_skipped == ()
    for span, report in zip(processed.documents, REPORTS, strict=True):
        assert processed.prompt_ids[span.start:span.end] == raw.encode(report + end, add_special_tokens=False).ids
    assert raw.decode(processed.prompt_ids, skip_special_tokens=False) == inputs.prompt_text(request)
    # Clean edges: part by part is the whole prompt's tokenization, token for token.
    clean = chat_request("", separator)
    assert inputs.process(clean, where="").prompt_ids == inputs.tokenizer.encode(inputs.prompt_text(clean))


@pytest.mark.parametrize("edge", ["space", "newline"])
def test_a_document_ending_with_whitespace_reuses_as_much_as_a_clean_one(merging_engine: Path, edge: str) -> None:
    end, separator = EDGES[edge]

    def reused(end: str) -> tuple[int, dict[str, int]]:
        llm = LLM(str(merging_engine), num_threads=1, document_reuse=True, document_repair="none")
        second = ask_twice(llm, end, separator)[1]
        return second.cached_tokens, llm.context_cache_metrics()["documents"]

    clean_cached, clean = reused("")
    cached, counters = reused(end)
    assert clean_cached >= sum(map(len, REPORTS)) and cached >= clean_cached  # each report is one token longer
    assert counters["document_hits"] == clean["document_hits"] == 4 and counters["documents_seen"] == 4
    assert not any(counters[f"skipped_{reason}"] for reason in ("too_short", "edge_merge", "refused"))


def test_full_repair_of_whitespace_edged_documents_answers_as_cold(merging_engine: Path) -> None:
    cold = [out.token_ids for out in ask_twice(LLM(str(merging_engine), num_threads=1), " ", "")]
    full = LLM(str(merging_engine), num_threads=1, document_reuse=True, document_repair="full")
    assert [out.token_ids for out in ask_twice(full, " ", "")] == cold
    assert full.context_cache_metrics()["documents"]["repaired_tokens"] == 2 * sum(len(r) + 1 for r in REPORTS)


def test_part_wise_tokens_differ_from_whole_prompt_ones_only_at_the_edges(merging_engine: Path) -> None:
    """What part-wise tokenization changes: the same text, its tokens cut at the reports' edges, the first change at
    the first report's last token. (Whether answers move is measured on SmolLM2 in docs/document-reuse.md: on this
    random-weight engine any changed input token changes the greedy tokens, so it measures nothing there.)"""
    inputs = LLM(str(merging_engine), num_threads=1).engine.inputs
    raw = inputs.tokenizer.tokenizer
    for end, separator in EDGES.values():
        request = chat_request(end, separator)
        processed = inputs.process(request, where="")
        part_wise, whole = processed.prompt_ids, inputs.tokenizer.encode(inputs.prompt_text(request))
        assert raw.decode(part_wise) == raw.decode(whole) == inputs.prompt_text(request)
        first_change = next(i for i, (a, b) in enumerate(zip(part_wise, whole, strict=False)) if a != b)
        assert first_change == processed.documents[0].end - 1, repr(end)
        assert 0 < len(part_wise) - len(whole) <= len(processed.documents), repr(end)


def lowercase(config: dict[str, Any]) -> None:
    """A normalizer that rewrites text: part-wise ids no longer decode to the prompt, so the whole-prompt ids stay,
    and a report whose edge " t" crosses gets no span."""
    config["normalizer"] = {"type": "Lowercase"}
    take_ids(config, "Ġt")
    config["model"]["merges"] = ["Ġ t"]


def test_documents_that_cannot_be_reused_are_counted_by_reason(tiny_engine_dir: Path, tmp_path: Path) -> None:
    engine = with_tokenizer(tiny_engine_dir, tmp_path / "lowercase", lowercase)
    llm = LLM(str(engine), num_threads=1, document_reuse=True, document_repair="none")
    content = [{"type": "document", "text": REPORTS[0] + " "},  # " t" crosses into the text after: edge_merge
               {"type": "text", "text": "then\n"},
               {"type": "document", "text": REPORTS[1]},  # clean: reused
               {"type": "text", "text": "\nShort:"},
               {"type": "document", "text": "Tiny."},  # under a page: too_short
               {"type": "text", "text": "\nWhy?"}]
    last = [{"type": "text", "text": "Q:\n"}, {"type": "document", "text": REPORTS[1]}]  # the last token: refused
    for parts in (content, last):
        answer(llm, [{"role": "user", "content": parts}])
    counters = llm.context_cache_metrics()["documents"]
    assert counters["documents_seen"] == 4
    assert (counters["skipped_edge_merge"], counters["skipped_too_short"], counters["skipped_refused"]) == (1, 1, 1)
    series = {sample.name: sample.value for sample in DOCUMENT_COUNTERS.samples({"documents": counters})}
    assert (series["documents_skipped_edge_merge"], series["documents_skipped_too_short"],
            series["documents_skipped_refused"]) == (1, 1, 1)  # /metrics: kvforge_documents_skipped_<reason>
    note = skipped_documents_note({"context_cache": {"documents": counters}})
    assert note == ("note: 3 of 4 document parts were not reused (1 too_short, 1 edge_merge, 1 refused); see "
                    "docs/document-reuse.md")
    none_skipped = {**counters, "skipped_edge_merge": 0, "skipped_too_short": 0, "skipped_refused": 0}
    assert skipped_documents_note({"context_cache": {"documents": none_skipped}}) == ""


@pytest.mark.in_process
def test_llm_inference_names_the_skipped_documents_once_on_stderr(run_cli, tiny_engine_dir: Path,
                                                                  tmp_path: Path) -> None:
    short = {"messages": [{"role": "user", "content": [{"type": "document", "text": "Tiny."},
                                                       {"type": "text", "text": "\nWhy?"}]}]}
    input_file = tmp_path / "in.json"
    input_file.write_text(json.dumps({"temperature": 0, "max_generate_length": 2, "apply_chat_template": False,
                                      "requests": [short, short]}), encoding="utf-8")
    args = ["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
            tmp_path / "out.json"]
    proc = run_cli([*args, "--documentReuse"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("note: 2 of 2 document parts were not reused (2 too_short)") == 1, proc.stderr
    quiet = run_cli(args)  # without --documentReuse nothing is counted, nothing said
    assert quiet.returncode == 0 and "document parts" not in quiet.stderr
