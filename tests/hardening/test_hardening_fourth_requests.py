"""The fourth hostile pass (issue 52 items 9 and "also seen", issue 51 items 9 and 10): request fields a server
silently ignored or could not honour, the content-item limit, non-standard JSON, min_p and repetition_penalty."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import loads_json
from kvforge.runtime.inputs.checks import MAX_CONTENT_ITEMS, parse_messages
from kvforge.runtime.sampling.sampler import Sampler
from kvforge.runtime.types import SamplingParams
from kvforge.server.protocol import ApiError, parse_call

MODELS = {"tiny": None}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def refused(body: dict[str, Any], chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_call(body, chat, MODELS)
    assert info.value.status == 400 and "\n" not in info.value.message
    return info.value


def test_a_body_without_model_names_model() -> None:
    for body in ({k: v for k, v in CHAT.items() if k != "model"}, {**CHAT, "model": None}):
        error = refused(body)
        assert error.param == "model" and "model is required" in error.message and "tiny" in error.message
    assert refused({"prompt": "x"}, chat=False).param == "model"


@pytest.mark.parametrize(("field", "value"), [("modalities", ["text", "audio"]), ("modalities", ["audio"]),
                                               ("audio", {"voice": "alloy", "format": "wav"}),
                                               ("prediction", {"type": "content", "content": "x"}),
                                               ("web_search_options", {})])
def test_output_this_server_cannot_produce_is_refused_by_name(field: str, value: Any) -> None:
    error = refused({**CHAT, field: value})
    assert error.param == field and field in error.message


def test_neutral_values_of_those_fields_are_accepted() -> None:
    for extra in ({"modalities": ["text"]}, {"audio": None}, {"prediction": None}, {"web_search_options": None},
                  {"user": "someone", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}):
        parse_call({**CHAT, **extra}, True, MODELS)


def test_temperature_above_two_is_refused() -> None:
    assert parse_call({**CHAT, "temperature": 2}, True, MODELS).sampling.temperature == 2
    error = refused({**CHAT, "temperature": 2.5})
    assert error.param == "temperature" and "[0, 2]" in error.message


def test_min_p_and_repetition_penalty_reach_the_sampler() -> None:
    call = parse_call({**CHAT, "min_p": 0.1, "repetition_penalty": 1.3}, True, MODELS)
    assert (call.sampling.min_p, call.sampling.repetition_penalty) == (0.1, 1.3)
    for field, value in (("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0), ("repetition_penalty", 11)):
        assert refused({**CHAT, field: value}).param == field


def test_min_p_drops_what_is_below_its_share_of_the_best() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))  # ratios to the best: 1, 0.6, 0.3, 0.1
    for min_p, allowed in ((0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})):
        sampler = Sampler(SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=min_p, seed=3))
        drawn = {sampler.sample(logits).token_id for _ in range(400)}
        assert drawn == allowed, (min_p, drawn)
        probs = Sampler(SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=min_p)).probs(logits)
        assert set(np.flatnonzero(probs)) == allowed and math.isclose(probs.sum(), 1.0)


def test_repetition_penalty_divides_the_prompts_and_outputs_logits() -> None:
    """vLLM's rule: every token of the prompt or the output, a positive logit divided by the penalty, a negative one
    multiplied; greedy sees it too."""
    logits = np.array([2.0, 1.8, -1.0, -1.2, 0.5])
    params = SamplingParams(temperature=0.0, top_k=1, repetition_penalty=2.0, num_logprobs=5)
    sampler = Sampler(params, prompt_ids=[0, 2])
    first = sampler.sample(logits)
    assert first.token_id == 1  # 2.0 / 2 = 1.0 < 1.8
    second = sampler.sample(logits)  # token 1 is now an output too: 1.8 / 2 = 0.9 < 1.0
    assert second.token_id == 0
    for result, expected in ((first, [1.0, 1.8, -2.0, -1.2, 0.5]), (second, [1.0, 0.9, -2.0, -1.2, 0.5])):
        reference = np.array(expected) - np.log(np.exp(expected).sum())
        shown = dict(result.top_logprobs)
        assert all(math.isclose(shown[i], reference[i], rel_tol=1e-9) for i in range(5)), result
    assert Sampler(SamplingParams(temperature=0.0, top_k=1)).sample(logits).token_id == 0  # off by default


def test_a_retrieval_prompt_of_dozens_of_passages_fits_one_message() -> None:
    passages = [{"type": "document", "text": f"Passage {i}: the harbour tide was {i % 5} metres."} for i in range(64)]
    [message] = parse_messages([{"role": "user", "content": [*passages, {"type": "text", "text": "Which?"}]}], "m")
    assert len(message.documents) == 64
    assert MAX_CONTENT_ITEMS >= 64
    with pytest.raises(KvforgeError) as info:
        parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_CONTENT_ITEMS + 1)}], "m")
    assert info.value.field == "m[0].content" and f"at most {MAX_CONTENT_ITEMS} items" in info.value.message


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_json_is_refused(constant: str) -> None:
    """What llm_serve parses bodies with (the live server's 400 is checked below)."""
    with pytest.raises(KvforgeError) as info:
        loads_json(f'{{"model": "tiny", "temperature": {constant}, "messages": []}}'.encode(), "body", standard=True)
    assert info.value.field == "body" and constant in info.value.message and "not JSON" in info.value.message
    assert loads_json(b'{"temperature": 1e308}', "body", standard=True) == {"temperature": 1e308}


def test_the_live_server_answers_400_to_nan_and_audio(tiny_engine_dir: Path, tmp_path: Path) -> None:
    from support.server_harness import live_server

    body = json.dumps({**CHAT, "max_tokens": 2})
    with live_server(tiny_engine_dir, tmp_path) as server:
        status, reply = server.request("POST", "/v1/chat/completions", body.replace('"max_tokens": 2',
                                                                                     '"max_tokens": NaN').encode())
        assert status == 400 and "NaN" in reply["error"]["message"], reply
        status, reply = server.request("POST", "/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]})
        assert status == 400 and reply["error"]["param"] == "modalities", reply
        status, reply = server.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2, "min_p": 0.05,
                                                                         "repetition_penalty": 1.2})
        assert status == 200, reply
