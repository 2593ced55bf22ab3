"""Engine options are declared once (EngineConfig's field metadata); every front end derives its options from it."""

from __future__ import annotations

import ast
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import click
import pytest
import typer
from typer.testing import CliRunner

import kvforge.runtime.api as api
from kvforge import LLM
from kvforge.cli_common import ENGINE_FLAGS, check_reuse_flags, with_engine_options
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.cli import app as inference_app
from kvforge.runtime.engine.config import OPTION, EngineConfig, EngineOption, engine_options, make_engine_config
from kvforge.server.cli import app as serve_app
from kvforge.tools.testcases.cli import app as llm_test_app

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in fields(EngineConfig)]
# A value unlike the default for each field, of its type (the CLI test below parses them back).
CHANGED: dict[str, Any] = {"num_threads": 3, "enable_context_reuse": True, "context_cache_max_records": 7,
                           "prefill_chunk_size": 99, "max_num_tokens": 40, "max_batch_size": 2,
                           "multimodal_engine_dir": "engines/visual", "encoder_cache_budget_bytes": 5,
                           "context_cache_partial_kv_snapshot_pool_bytes": 11,
                           "context_cache_recurrent_snapshot_pool_bytes": 13, "snapshot_message_boundaries": False,
                           "snapshot_interval_tokens": 17, "spec_decode": "ngram", "spec_draft_step": 3,
                           "spec_prompt_lookup_min": 1, "spec_prompt_lookup_max": 5,
                           "spec_draft_engine_dir": "engines/x/draft", "spec_draft_top_k": 4, "spec_verify_size": 9,
                           "shared_cache": "redis://127.0.0.1:6390/0", "shared_cache_timeout_ms": 80.0,
                           "shared_cache_secret": "s3cret", "shared_cache_read_secrets": ("old s3cret",),
                           "shared_cache_encrypt": True,
                           "dflash_block_size": 4, "dspark_scheduler": "sps", "dspark_confidence_threshold": 0.5,
                           "dspark_min_proposal_len": 2, "dspark_max_proposal_len": 5,
                           "document_reuse": True, "document_repair": "none", "document_repair_budget": 0.25,
                           "document_segments": "paragraphs",
                           "document_segment_min_tokens": 32, "lora_corrections": ("checker",),
                           "lora_correction_pages": 12, "kv_events_endpoint": "tcp://127.0.0.1:5599",
                           "kv_events_topic": "kv"}


def _params(app: typer.Typer) -> dict[str, click.Parameter]:
    return {p.name: p for p in typer.main.get_command(app).params if p.name}


def _cli_fields() -> list[str]:
    return [name for name, (_, option) in engine_options().items() if option.flag]


def test_every_field_declares_its_option() -> None:
    for f in fields(EngineConfig):
        option = f.metadata.get(OPTION)
        assert isinstance(option, EngineOption), f"EngineConfig.{f.name} has no EngineOption"
        assert option.help, f.name
        if option.flag is not None:
            assert option.flag.startswith("--") and "_" not in option.flag, option.flag  # camelCase
    assert sorted(CHANGED) == sorted(FIELDS)
    assert [name for name in FIELDS if name not in _cli_fields()] == ["max_batch_size"]  # kvforge.LLM only


@pytest.mark.parametrize("app", [inference_app, serve_app], ids=["llm_inference", "llm_serve"])
def test_cli_offers_every_option_as_declared(app: typer.Typer) -> None:
    params = _params(app)
    for name, (default, option) in engine_options().items():
        if option.flag is None:
            assert name not in params, name
            continue
        param = params[name]
        assert param.opts == [option.flag], name
        assert param.secondary_opts == ([option.off_flag] if option.off_flag else []), name
        assert param.help == option.help, name
        assert param.default == default, name
    assert "engine_config" not in params


def test_llm_inference_and_llm_serve_agree_on_shared_flags() -> None:
    inference, serve = _params(inference_app), _params(serve_app)
    for name in _cli_fields():
        assert (inference[name].opts, inference[name].help, inference[name].default) == (
            serve[name].opts, serve[name].help, serve[name].default), name


def test_llm_test_takes_flags_and_defaults_from_the_declaration() -> None:
    params = _params(llm_test_app)
    for name in ("num_threads", "enable_context_reuse", "multimodal_engine_dir"):
        default, option = engine_options()[name]
        assert (params[name].opts, params[name].default) == ([option.flag], default), name
    assert params["num_threads"].help == engine_options()["num_threads"][1].help


def test_no_front_end_declares_an_engine_flag_itself() -> None:
    """A typer.Option naming a declared flag would be a second declaration (and a second default)."""
    declared = {option.flag for _, option in engine_options().values() if option.flag}
    for path in ("kvforge/runtime/cli.py", "kvforge/server/cli.py", "kvforge/tools/testcases/cli.py",
                 "kvforge/tools/bench/cli.py"):
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Option":
                names = {a.value.split("/")[0] for a in node.args[1:] if isinstance(a, ast.Constant)}
                # llm_bench's --numThreads is its own: every engine's threads, its peers' too (default 2, min 1).
                if path == "kvforge/tools/bench/cli.py":
                    names.discard("--numThreads")
                assert not names & declared, f"{path}:{node.lineno} declares {names & declared}"


def test_engine_flags_cover_every_field() -> None:
    assert set(FIELDS) <= set(ENGINE_FLAGS)
    for name, (_, option) in engine_options().items():
        assert ENGINE_FLAGS[name] == (option.flag or "--maxBatchSize"), name  # the build flag where none


def test_parsed_flags_become_one_engine_config() -> None:
    app = typer.Typer()
    seen: list[EngineConfig] = []

    @app.command()
    @with_engine_options
    def command(before: int = typer.Option(1, "--before"), engine_config: EngineConfig = EngineConfig(),
                after: str = typer.Option("x", "--after")) -> None:
        seen.append(engine_config)
        assert (before, after) == (2, "y")

    args = ["--before", "2", "--after", "y"]
    for name, (_, option) in engine_options().items():
        value = CHANGED[name]
        if option.flag is None:
            continue
        if isinstance(value, bool):
            args.append(option.flag if value else option.off_flag)
        elif isinstance(value, tuple):  # a repeatable flag
            args += [arg for item in value for arg in (option.flag, item)]
        else:
            args += [option.flag, str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen == [replace(EngineConfig(**CHANGED), max_batch_size=0)]
    seen.clear()
    assert CliRunner().invoke(app, ["--before", "2", "--after", "y"]).exit_code == 0
    assert seen == [EngineConfig()]


@pytest.mark.parametrize("name", [n for n, (_, o) in engine_options().items() if o.requires_reuse])
def test_reuse_only_options_need_reuse(name: str) -> None:
    with pytest.raises(KvforgeError) as info:
        check_reuse_flags(EngineConfig(**{name: CHANGED[name]}))
    assert info.value.field == engine_options()[name][1].flag
    check_reuse_flags(EngineConfig(**{name: CHANGED[name]}, enable_context_reuse=True))


def test_llm_accepts_every_field_as_a_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[EngineConfig] = []

    class FakeEngine:
        def __init__(self, engine_dir: object, config: EngineConfig) -> None:
            made.append(config)

        def close(self) -> None:  # LLM closes the engine it made when it is collected
            pass

    monkeypatch.setattr(api, "Engine", FakeEngine)
    LLM("engines/x", **{**CHANGED, "multimodal_engine_dir": Path("engines/visual")})  # a Path is fine too
    LLM("engines/x", enable_context_reuse=False)  # reuse is on by default (tests/engine/test_api.py)
    assert made == [EngineConfig(**CHANGED), EngineConfig()]
    with pytest.raises(TypeError, match="'num_thread'"):
        LLM("engines/x", num_thread=2)


def test_engine_config_refuses_unknown_names_and_passes_paths_as_str() -> None:
    assert make_engine_config({"multimodal_engine_dir": Path("a/b")}).multimodal_engine_dir == "a/b"
    assert make_engine_config({"multimodal_engine_dir": None}).multimodal_engine_dir is None
    with pytest.raises(TypeError, match="'bogus'"):
        make_engine_config({"bogus": 1})
