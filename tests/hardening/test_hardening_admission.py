"""What a step will use is checked at admission, work before the length check is bounded by the limit, and a
step failure fails only the rows that caused it (pages freed, nothing published, the cache audits clean)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.backends import FlakyBackend
from support.engine_driver import assert_idle, make_engine
from support.hardening_support import invoke, request_file

from kvforge import SamplingParams
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.cli import app as inference_app
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.execution.load import load_backend
from kvforge.runtime.file_loop import drain, prepare_requests
from kvforge.runtime.inputs.request_file import parse_request_file

PROMPTS = ["The harbor tide rose at dawn", "Turbines turned slowly", "The review ended in May"]
GREEDY = SamplingParams(temperature=0, max_generate_length=8)


@pytest.fixture
def engine(tiny_engine_dir: Path) -> Engine:
    return make_engine(tiny_engine_dir, reuse=True)


def run_alone(engine: Engine, prompt: str) -> list[int]:
    request_id = engine.add_request(engine.inputs.process_prompt(prompt, GREEDY))
    return drain(engine, {request_id})[0].token_ids


def run(engine_dir: Path, input_file: Path, tmp_path: Path, *extra: object):
    return invoke(inference_app, "--engineDir", engine_dir, "--inputFile", input_file, "--outputFile",
                  tmp_path / "out.json", *extra)


# --- values a step uses are refused at admission ----------------------------------------------------------


def test_llm_inference_refuses_a_lone_surrogate_salt_as_a_bad_request(tiny_engine_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "in.json"
    path.write_text('{"max_generate_length": 2, "requests": [{"messages": [{"role": "user", "content": "hi"}], '
                    '"cache_salt": "\\ud800"}]}', encoding="utf-8")
    line = run(tiny_engine_dir, path, tmp_path, "--enableContextReuse").one_line_error("cache_salt")
    assert "lone surrogate" in line and not (tmp_path / "out.json").exists()


def test_llm_inference_refuses_an_out_of_vocabulary_logit_bias(tiny_engine_dir: Path, tmp_path: Path) -> None:
    path = request_file(tmp_path / "in.json", {"messages": [{"role": "user", "content": "hi"}],
                                               "logit_bias": {"1000000": 2}})
    run(tiny_engine_dir, path, tmp_path).one_line_error("requests[0].logit_bias", "outside the vocabulary")


def test_the_python_api_gets_the_same_checks(engine: Engine) -> None:
    with pytest.raises(KvforgeError) as salt:
        engine.inputs.process_prompt("hi", GREEDY, cache_salt="\udc80")
    with pytest.raises(KvforgeError) as bias:
        engine.inputs.process_prompt("hi", SamplingParams(logit_bias={engine.inputs.vocab_size: 1.0}))
    assert (salt.value.field, bias.value.field) == ("cache_salt", "logit_bias")


# --- a step failure fails only its rows --------------------------------------------------------------------


def test_a_sampling_failure_fails_only_its_row(engine: Engine) -> None:
    alone = [run_alone(engine, prompt) for prompt in PROMPTS]
    ids = [engine.add_request(engine.inputs.process_prompt(prompt, GREEDY)) for prompt in PROMPTS]
    doomed = engine.core.sequences[ids[1]]

    def broken(*_: Any) -> Any:
        raise IndexError("index 999999 is out of bounds for axis 0")

    doomed.sampler.sample = broken  # type: ignore[method-assign] - the fault this request alone carries
    outputs = {output.request_id: output for output in drain(engine, set(ids))}
    failed = outputs[ids[1]]
    assert failed.finish_reason == "error" and "IndexError" in (failed.error or "")
    assert [outputs[i].token_ids for i in (ids[0], ids[2])] == [alone[0], alone[2]]
    assert_idle(engine)
    assert run_alone(engine, PROMPTS[1]) == alone[1]  # nothing of the failed row was published


def test_an_admission_failure_fails_only_that_request(engine: Engine) -> None:
    alone = [run_alone(engine, prompt) for prompt in PROMPTS]
    requests = [engine.inputs.process_prompt(prompt, GREEDY) for prompt in PROMPTS]
    requests[0].cache_salt = "\ud800"  # past the checks, as a bug elsewhere could: hashing it raises
    ids = [engine.add_request(request) for request in requests]
    outputs = {output.request_id: output for output in drain(engine, set(ids))}
    assert outputs[ids[0]].finish_reason == "error" and "admission failed" in (outputs[ids[0]].error or "")
    assert [outputs[i].token_ids for i in ids[1:]] == alone[1:]
    assert_idle(engine)


def test_a_failed_batched_call_fails_its_rows_and_the_engine_goes_on(tiny_engine_dir: Path) -> None:
    backend = FlakyBackend(load_backend(load_engine_dir(tiny_engine_dir), 2))
    engine = make_engine(tiny_engine_dir, backend, reuse=True)  # type: ignore[arg-type]
    alone = run_alone(engine, PROMPTS[0])
    ids = [engine.add_request(engine.inputs.process_prompt(prompt, GREEDY)) for prompt in PROMPTS]
    backend.fail_next = True
    outputs = {output.request_id: output for output in drain(engine, set(ids))}
    assert all(outputs[i].finish_reason == "error" and "simulated" in (outputs[i].error or "") for i in ids)
    assert_idle(engine)
    assert run_alone(engine, PROMPTS[0]) == alone


# --- work before the length check is bounded by the limit --------------------------------------------------


class CountingTokenizer:
    """Wraps the engine tokenizer's entry points and records the size of every text they are given."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        tokenizer = engine.tokenizer
        for name in ("encode", "encode_chat", "format"):
            original = getattr(tokenizer, name)
            monkeypatch.setattr(tokenizer, name, self._counted(original))

    def _counted(self, original: Any) -> Any:
        def counted(text: Any, *args: Any, **kwargs: Any) -> Any:
            self.sizes.append(len(text) if isinstance(text, str) else sum(len(m.content) for m in text))
            return original(text, *args, **kwargs)
        return counted


@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_a_12_mib_completion_prompt_is_refused_without_tokenizing(engine: Engine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingTokenizer(engine, monkeypatch)
    started = time.perf_counter()
    with pytest.raises(KvforgeError) as refused:
        engine.inputs.process_prompt("tide " * (12 * 2**20 // 5), GREEDY)
    assert refused.value.field == "prompt" and "maxInputLen" in refused.value.message
    assert time.perf_counter() - started < 1.0 and counting.sizes == []


@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_64_large_chat_messages_are_refused_before_templating(engine: Engine, tiny_engine_dir: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = [{"role": "user" if i % 2 else "assistant", "content": "tide " * 26_000} for i in range(64)]
    data = {"max_generate_length": 2, "requests": [{"messages": messages}]}
    counting = CountingTokenizer(engine, monkeypatch)
    started = time.perf_counter()
    with pytest.raises(KvforgeError) as refused:
        prepare_requests(engine, parse_request_file(data))
    assert refused.value.field == "requests[0].messages" and "maxInputLen" in refused.value.message
    assert time.perf_counter() - started < 1.0 and counting.sizes == []
    path = tmp_path / "in.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    run(tiny_engine_dir, path, tmp_path).one_line_error("requests[0].messages", "maxInputLen")
