"""Documents from clients that do not mark them (issue 53 item 5): with --documentSegments paragraphs, blocks of
plain text between blank lines are looked up and stored exactly as document parts are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.cli_checks import assert_one_line_error

from kvforge import LLM, SamplingParams
from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.engine.engine import RequestOutput
from kvforge.runtime.inputs.checks import parse_messages
from kvforge.runtime.inputs.segments import check_segment_options, paragraph_spans, segment_messages
from kvforge.runtime.types import Message, Request

GREEDY = SamplingParams(temperature=0, max_generate_length=6)
# The tiny tokenizer gives a token per byte: each report (17 bytes) fills a 16-token page, the question (12) is
# shorter than the 16-token minimum used here, so it stays text.
REPORTS = ["The pump stopped.", "The gate is shut."]
QUESTION = "Tell me why?"
MIN_TOKENS = 16


def marked(system: str, reports: list[str]) -> list[dict[str, Any]]:
    """The reports as document parts, a blank line after each, then the question."""
    content: list[dict[str, Any]] = []
    for i, report in enumerate(reports):
        content += [{"type": "document", "text": report},
                    {"type": "text", "text": "\n\n" + (QUESTION if i == len(reports) - 1 else "")}]
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def plain(system: str, reports: list[str]) -> list[dict[str, Any]]:
    """The same prompt as RAG code sends it: one text, the passages joined by blank lines."""
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join([*reports, QUESTION])}]


def request(chat: list[dict[str, Any]]) -> Request:
    return Request(0, parse_messages(chat, "messages"), GREEDY, apply_chat_template=False)


def answer(llm: LLM, chat: list[dict[str, Any]]) -> RequestOutput:
    engine = llm.engine
    request_id = engine.add_request(engine.inputs.process(request(chat), where=""))
    final = None
    while engine.has_unfinished():
        final = next((out for out in engine.step() if out.request_id == request_id and out.finished), final)
    assert final is not None
    return final


def ask_twice(llm: LLM, form: Any) -> list[RequestOutput]:
    """The reports behind one system prompt, then in the other order behind another (a timestamp)."""
    return [answer(llm, form("t=1\n", REPORTS)), answer(llm, form("t=22\n", REPORTS[::-1]))]


def test_paragraph_spans_are_the_blocks_between_blank_lines_without_their_edges() -> None:
    content = "  Alpha one.\n\nBeta two. \n \t\n\n Gamma\nthree.\n\n\n   \n"
    assert [content[s:e] for s, e in paragraph_spans(content)] == ["Alpha one.", "Beta two.", "Gamma\nthree."]
    assert paragraph_spans("one block\nacross lines") == [(0, 22)]
    assert paragraph_spans(" \n\n \n") == []


def test_segments_take_long_system_and_user_blocks_and_keep_marked_documents() -> None:
    long_block, short_block = "x" * 20, "y" * 5
    content = f"{long_block}\n\n{short_block}\n\n{long_block}"
    user = Message("user", content, documents=((len(long_block) + 2 + len(short_block) + 2, len(content)),))
    messages = [Message("system", long_block), user, Message("assistant", long_block)]
    system, user_out, assistant = segment_messages(messages, len, 16)
    assert system.documents == ((0, 20),)
    assert user_out.documents == ((0, 20), user.documents[0])  # the short block stays text; the marked one stays
    assert assistant.documents == ()  # an assistant turn holds no retrieved text
    assert segment_messages(messages, len, 21)[0].documents == ()


@pytest.mark.parametrize(("mode", "min_tokens", "reuse", "field", "words"), [
    ("sentences", 64, True, "document_segments", "off, paragraphs"),
    ("paragraphs", 0, True, "document_segment_min_tokens", ">= 1"),
    ("paragraphs", 64, False, "document_segments", "needs document_reuse"),
])
def test_bad_segment_options_name_their_field(mode: str, min_tokens: int, reuse: bool, field: str,
                                              words: str) -> None:
    with pytest.raises(InvalidConfig) as error:
        check_segment_options(mode, min_tokens, reuse)
    assert error.value.field == field and words in str(error.value)


def test_a_plain_text_prompt_gets_the_marked_prompts_tokens_and_document_spans(tiny_engine_dir: Path) -> None:
    segmenting = LLM(str(tiny_engine_dir), num_threads=1, document_reuse=True, document_segments="paragraphs",
                     document_segment_min_tokens=MIN_TOKENS).engine.inputs
    reference = LLM(str(tiny_engine_dir), num_threads=1, document_reuse=True).engine.inputs
    want = reference.process(request(marked("t=1\n", REPORTS)), where="")
    got = segmenting.process(request(plain("t=1\n", REPORTS)), where="")
    assert len(want.documents) == 2 and got.prompt_ids == want.prompt_ids and got.documents == want.documents
    assert reference.process(request(plain("t=1\n", REPORTS)), where="").documents == ()  # off: no documents


def test_plain_text_reuses_as_much_as_marked_documents(tiny_engine_dir: Path) -> None:
    def second(form: Any, **options: Any) -> tuple[int, dict[str, int]]:
        llm = LLM(str(tiny_engine_dir), num_threads=1, document_reuse=True, document_repair="none", **options)
        return ask_twice(llm, form)[1].cached_tokens, llm.context_cache_metrics()["documents"]

    marked_cached, marked_counters = second(marked)
    plain_cached, plain_counters = second(plain, document_segments="paragraphs",
                                          document_segment_min_tokens=MIN_TOKENS)
    unsegmented_cached, _ = second(plain)
    assert marked_cached >= sum(map(len, REPORTS)) and plain_cached == marked_cached
    assert plain_counters == marked_counters and plain_counters["document_hits"] == 4
    assert unsegmented_cached == 0  # without segmentation a plain-text prompt reuses nothing here


def test_full_repair_of_segments_answers_as_cold(tiny_engine_dir: Path) -> None:
    cold = [out.token_ids for out in ask_twice(LLM(str(tiny_engine_dir), num_threads=1), plain)]
    full = LLM(str(tiny_engine_dir), num_threads=1, document_reuse=True, document_repair="full",
               document_segments="paragraphs", document_segment_min_tokens=MIN_TOKENS)
    assert [out.token_ids for out in ask_twice(full, plain)] == cold
    assert full.context_cache_metrics()["documents"]["repaired_tokens"] == 2 * sum(map(len, REPORTS))


@pytest.mark.in_process
@pytest.mark.parametrize(("flags", "flag", "words"), [
    (["--documentReuse", "--documentSegments", "sentences"], "--documentSegments", "off, paragraphs"),
    (["--documentReuse", "--documentSegments", "paragraphs", "--documentSegmentMinTokens", "0"],
     "--documentSegmentMinTokens", ">= 1"),
    (["--documentSegments", "paragraphs"], "--documentSegments", "document_reuse"),
])
def test_llm_inference_refuses_bad_segment_options_in_one_line(run_cli, tiny_engine_dir: Path, tmp_path: Path,
                                                                flags: list[str], flag: str, words: str) -> None:
    input_file, output_file = tmp_path / "in.json", tmp_path / "out.json"
    input_file.write_text(json.dumps({"apply_chat_template": False, "max_generate_length": 2,
                                      "requests": [{"messages": plain("t=1\n", REPORTS)}]}), encoding="utf-8")
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
                    output_file, *flags])
    assert_one_line_error(proc, flag, words)
    assert not output_file.exists()


@pytest.mark.in_process
def test_llm_inference_segments_plain_text_requests(run_cli, tiny_engine_dir: Path, tmp_path: Path) -> None:
    input_file, output_file, profile_file = tmp_path / "in.json", tmp_path / "out.json", tmp_path / "profile.json"
    input_file.write_text(json.dumps({"batch_size": 1, "temperature": 0, "max_generate_length": 2,
                                      "apply_chat_template": False,
                                      "requests": [{"messages": plain("t=1\n", REPORTS)},
                                                   {"messages": plain("t=22\n", REPORTS[::-1])}]}), encoding="utf-8")
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
                    output_file, "--profileOutputFile", profile_file, "--documentReuse", "--documentRepair", "none",
                    "--documentSegments", "paragraphs", "--documentSegmentMinTokens", str(MIN_TOKENS)])
    assert proc.returncode == 0, proc.stderr
    responses = json.loads(output_file.read_text())["responses"]
    documents = json.loads(profile_file.read_text())["context_cache"]["documents"]
    assert documents["document_hits"] == 4 and documents["documents_seen"] == 4
    assert responses[1]["usage"]["cached_tokens"] >= sum(map(len, REPORTS))
