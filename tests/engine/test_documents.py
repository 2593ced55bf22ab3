"""Document content parts: plain text in place (same tokens as inline text), refused where they cannot be, and
recorded as token spans that are exactly each document's own tokens (issue 37, point 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvforge import LLM, SamplingParams
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.inputs.checks import parse_messages
from kvforge.runtime.inputs.processor import InputProcessor
from kvforge.runtime.inputs.request_file import parse_request_file
from kvforge.runtime.inputs.tokenizer import ChatTokenizer
from kvforge.runtime.types import Message, Request
from kvforge.server.protocol import ApiError, parse_call

REPORT = "Pump off."
GREEDY = SamplingParams(temperature=0, max_generate_length=4)


def doc(text: Any) -> dict[str, Any]:
    return {"type": "document", "text": text}


def conversation() -> list[dict[str, Any]]:
    return [{"role": "system", "content": [{"type": "text", "text": "A:\n"}, doc("Doc.")]},
            {"role": "user", "content": [doc(REPORT), {"type": "text", "text": "\nWhy?"}]}]


def inline() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "A:\nDoc."}, {"role": "user", "content": REPORT + "\nWhy?"}]


@pytest.fixture(scope="module")
def llm(tiny_engine_dir: Path) -> LLM:
    return LLM(str(tiny_engine_dir), num_threads=1)


def test_document_parts_parse_as_text_with_spans() -> None:
    system, user = parse_messages(conversation(), "messages")
    assert system.content == "A:\nDoc." and system.documents == ((3, 7),)
    assert user.content == REPORT + "\nWhy?" and user.documents == ((0, len(REPORT)),)
    assert user.content[slice(*user.documents[0])] == REPORT


@pytest.mark.parametrize(("messages", "field", "words"), [
    ([{"role": "assistant", "content": [doc("x")]}], "messages[0].content[0].type", "system and user"),
    ([{"role": "tool", "content": [doc("x")]}], "messages[0].content[0].type", "system and user"),
    ([{"role": "user", "content": [doc("")]}], "messages[0].content[0].text", "non-empty"),
    ([{"role": "user", "content": [doc(7)]}], "messages[0].content[0].text", "must be a string"),
    ([{"role": "user", "content": [doc(None)]}], "messages[0].content[0].text", "must be a string"),
    ([{"role": "user", "content": [{"type": "document"}]}], "messages[0].content[0].text", "is required"),
])
def test_bad_document_parts_name_the_field(messages: list[dict[str, Any]], field: str, words: str) -> None:
    with pytest.raises(KvforgeError) as info:
        parse_messages(messages, "messages")
    assert info.value.field == field and words in info.value.message and "\n" not in info.value.message


def test_request_files_and_the_server_take_document_parts() -> None:
    parsed = parse_request_file({"requests": [{"messages": conversation()}]})
    [request] = [r for batch in parsed.batches() for r in batch]
    assert [m.documents for m in request.messages] == [((3, 7),), ((0, len(REPORT)),)]
    call = parse_call({"model": "m", "messages": conversation()}, True, {"m": None})
    assert call.messages[1].documents == ((0, len(REPORT)),)
    with pytest.raises(ApiError) as info:
        parse_call({"model": "m", "messages": [{"role": "assistant", "content": [doc("x")]}]}, True, {"m": None})
    assert info.value.status == 400 and info.value.param == "messages[0].content[0].type"


def test_documents_are_plain_text_in_place(llm: LLM) -> None:
    """Same prompt tokens, same answer as the inline text; each span holds exactly the document's tokens."""
    with_docs = llm.engine.inputs.process(Request(0, parse_messages(conversation(), "messages"), GREEDY), where="")
    plain = llm.engine.inputs.process(Request(0, parse_messages(inline(), "messages"), GREEDY), where="")
    assert with_docs.prompt_ids == plain.prompt_ids and plain.documents == ()
    tokenizer = llm.engine.inputs.tokenizer.tokenizer
    assert len(with_docs.documents) == 2
    for span, text in zip(with_docs.documents, ("Doc.", REPORT), strict=True):
        assert with_docs.prompt_ids[span.start:span.end] == tokenizer.encode(text, add_special_tokens=False).ids
    assert with_docs.documents[0].end <= with_docs.documents[1].start
    [a], [b] = llm.chat(conversation(), GREEDY), llm.chat(inline(), GREEDY)
    assert a.token_ids == b.token_ids and a.prompt_token_ids == b.prompt_token_ids


def merging_processor(tiny_onnx_dir: Path, tmp_path: Path, llm: LLM) -> InputProcessor:
    """The tiny tokenizer plus one merge, "Ġ" + "T" (a space joins the letter after it), so a boundary can be
    crossed by a token; no template, so the prompt is the contents joined."""
    out = tmp_path / "merging"
    out.mkdir()
    config = json.loads((tiny_onnx_dir / "tokenizer.json").read_text())
    config["model"]["vocab"]["ĠT"] = max(config["model"]["vocab"].values()) + 1
    config["model"]["merges"] = ["Ġ T"]
    (out / "tokenizer.json").write_text(json.dumps(config))
    shutil.copy(tiny_onnx_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    return InputProcessor(ChatTokenizer(out), llm.engine.inputs.loras, 256, False, 4096)


def test_a_boundary_crossed_by_a_token_cuts_the_prompt_at_the_documents(tiny_onnx_dir: Path, tmp_path: Path,
                                                                         llm: LLM) -> None:
    """Issue 53: where a token crosses a document's edge, the prompt is tokenized part by part, so each document
    keeps its own tokens (the whole prompt's tokens would have given it no span); a clean prompt keeps the whole
    prompt's tokens."""
    processor = merging_processor(tiny_onnx_dir, tmp_path, llm)
    raw = processor.tokenizer.tokenizer
    messages = [Message("user", "Read: The end. The report", documents=((6, 14),)),  # " T" crosses at 6
                Message("user", " Tail.", documents=((0, 6),))]  # " T" inside: clean
    request = processor.process(Request(0, messages, GREEDY, apply_chat_template=False), where="")
    parts = ["Read: ", "The end.", " The report", " Tail."]
    assert request.prompt_ids == processor.tokenizer.encode_ids(
        [token for part in parts for token in raw.encode(part, add_special_tokens=False).ids])
    assert request.prompt_ids != processor.tokenizer.encode("".join(parts))
    assert [request.prompt_ids[span.start:span.end] for span in request.documents] == [
        raw.encode(parts[1]).ids, raw.encode(parts[3]).ids] and request.documents_skipped == ()
    clean = [Message("user", "Read:\nThe end. The report", documents=((6, 14),)), messages[1]]
    request = processor.process(Request(0, clean, GREEDY, apply_chat_template=False), where="")
    assert request.prompt_ids == processor.tokenizer.encode("Read:\nThe end. The report Tail.")
    assert len(request.documents) == 2
