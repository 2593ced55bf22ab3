"""Ambiguous JSON: a repeated key is refused everywhere JSON is read, naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.hardening_support import copy_engine, edit_engine, invoke, request_file

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import loads_json, read_json
from kvforge.runtime.cli import app as inference_app
from kvforge.tools.profile.cli import app as profile_app

REQUEST_CASES = [
    ('{"temperature": 0, "temperature": 1, "requests": [{"messages": [{"role": "user", "content": "hi"}]}]}',
     "temperature"),
    ('{"requests": [{"messages": [{"role": "user", "content": "hi", "content": "bye"}]}]}', "content"),
    ('{"requests": [{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"7": 1, "7": 2}}]}', "7"),
    ('{"available_lora_weights": {"a": "x", "a": "y"}, "requests": [{"messages": []}]}', "a"),
]


@pytest.mark.parametrize("text, key", REQUEST_CASES)
def test_request_file_duplicate_keys(tiny_engine_dir: Path, tmp_path: Path, text: str, key: str) -> None:
    input_file = tmp_path / "in.json"
    input_file.write_text(text, encoding="utf-8")
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
           tmp_path / "o.json").one_line_error("inputFile", f"duplicate key {json.dumps(key)}")
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("name, text, key", [
    ("config.json", None, "hidden_size"),
    ("tokenizer_config.json", '{"chat_template": "a", "chat_template": "{{ x }}"}', "chat_template"),
])
def test_engine_dir_duplicate_keys(tiny_engine_dir: Path, tmp_path: Path, name: str, text: str | None,
                                   key: str) -> None:
    if text is None:  # the real config with one key repeated at the end
        original = (tiny_engine_dir / "config.json").read_text(encoding="utf-8").rstrip().rstrip("}")
        text = original + ', "hidden_size": 65}'
    engine = edit_engine(copy_engine(tiny_engine_dir, tmp_path / "engine"), text={name: text})
    invoke(inference_app, "--engineDir", engine, "--inputFile", request_file(tmp_path / "in.json"), "--outputFile",
           tmp_path / "o.json").one_line_error("--engineDir", f'duplicate key "{key}"')


def test_profile_duplicate_keys(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"prefill": {"reused_tokens": 1, "reused_tokens": 2}}', encoding="utf-8")
    invoke(profile_app, "show", path).one_line_error('duplicate key "reused_tokens"')


def test_one_helper_for_every_reader(tmp_path: Path) -> None:
    with pytest.raises(KvforgeError, match='duplicate key "b"') as info:
        loads_json('{"a": [{"b": 1, "b": 1}]}', "where")
    assert info.value.field == "where"
    (tmp_path / "c.json").write_text('{"x": 1, "x": 1}')
    with pytest.raises(KvforgeError, match='duplicate key "x"'):
        read_json(tmp_path / "c.json", "onnx_dir")
    assert loads_json('{"a": {"a": 1}}', "w") == {"a": {"a": 1}}  # the same key at two levels is fine


def test_server_body_duplicate_keys() -> None:
    from kvforge.server.app import json_body
    from kvforge.server.protocol import ApiError

    class Body:
        async def stream(self):  # the body as it arrives (read with a size bound)
            yield b'{"model": "m", '
            yield b'"model": "n"}'

    import asyncio

    with pytest.raises(ApiError) as info:
        asyncio.run(json_body(Body()))  # type: ignore[arg-type]
    assert 'duplicate key "model"' in info.value.message
