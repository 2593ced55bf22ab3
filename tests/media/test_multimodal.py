"""Images on the tiny synthetic SmolVLM: media identity in page keys, span-safe reuse, the encoder cache, the
vlm_context_reuse fixture's counters, warm == cold, and one-line errors for bad media input."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.engine_driver import assert_idle, run_file, top1_ids

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.encoder_build import build_encoder_engine
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.context_cache.keys import KeyExtras, MediaKey, page_keys
from kvforge.runtime.context_cache.planner import plan_reuse
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.file_loop import Scheduling
from kvforge.runtime.inputs.multimodal.encoder_cache import EncoderCache
from kvforge.runtime.inputs.multimodal.image import media_digest
from kvforge.tools.export.families.idefics3_source import write_visual_onnx_dir
from kvforge.tools.export.sources.synthetic import synthetic_idefics3
from kvforge.tools.export.writer import write_onnx_dir

pytestmark = [pytest.mark.attention_path, pytest.mark.in_process]  # fallback rerun; run_cli in process

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "test_cases" / "vlm_context_reuse.json"
T = 16  # tokens per page the fixture's counters are for
IMAGE_ROWS = 16  # placeholder tokens per tiny-idefics3 image


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("vlm")
    text, visual = synthetic_idefics3()
    write_onnx_dir(text, root / "onnx")
    write_visual_onnx_dir(visual, root / "onnx" / "visual")
    build_engine(root / "onnx", root / "engine",
                 BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=4, tokens_per_page=T))
    build_encoder_engine(root / "onnx" / "visual", root / "visual", "auto", 4)
    return root, root / "engine", root / "visual"


def make(dirs, reuse: bool, budget: int = 256 << 20, **config) -> Engine:
    _, engine, visual = dirs
    return Engine(engine, EngineConfig(num_threads=2, enable_context_reuse=reuse, multimodal_engine_dir=str(visual),
                                       encoder_cache_budget_bytes=budget, **config))


def fixture_data() -> dict:
    return json.loads(FIXTURE.read_text())


def expected_counters() -> dict:
    [block] = fixture_data()["_checks"]["engine_specific"]
    assert block["when"] == {"model": "tiny-idefics3", "tokens_per_page": T}
    return block["expected_context_cache"]


def image_request(*items, question: str = "What is shown?", **extra) -> dict:
    content = [{"type": "image", "image": str(i)} for i in items] + [{"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content}], **extra}


def noise_image(path: Path, shape: tuple[int, int], seed: int) -> Path:
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*shape, 3), dtype=np.uint8)).save(path)
    return path


# --- pure parts: keys, planner, cache ---------------------------------------------------------------

def test_media_digest_binds_shape_and_dtype() -> None:
    pixels = np.arange(24, dtype=np.uint8)
    digests = {media_digest(pixels.reshape(2, 4, 3)), media_digest(pixels.reshape(4, 2, 3)),
               media_digest(pixels.reshape(2, 12)), media_digest(pixels.view(np.int8).reshape(2, 4, 3))}
    assert len(digests) == 4  # same bytes, different shape or dtype: never the same identity
    assert media_digest(pixels.reshape(2, 4, 3).copy()) == media_digest(pixels.reshape(2, 4, 3))


def test_page_keys_follow_media_content_position_and_order() -> None:
    ids = list(range(64))
    a, b = b"a" * 16, b"b" * 16

    def keys(*media: MediaKey) -> list[bytes]:
        return page_keys(ids, T, KeyExtras(media=media))

    plain, with_a = keys(), keys(MediaKey(20, 16, a))
    assert with_a[0] == plain[0] and with_a[1] != plain[1]  # pages before the span are unaffected
    assert keys(MediaKey(20, 16, b))[1] != with_a[1]  # other content
    assert keys(MediaKey(21, 16, a))[1] != with_a[1]  # same content elsewhere
    ab, ba = keys(MediaKey(8, 8, a), MediaKey(40, 8, b)), keys(MediaKey(8, 8, b), MediaKey(40, 8, a))
    assert ab[0] != ba[0] and ab[2] != ba[2]  # order matters
    assert keys(MediaKey(20, 16, a)) == with_a  # deterministic


def test_reuse_point_never_splits_a_media_span() -> None:
    span = (MediaKey(20, 30, b"x" * 16),)  # tokens [20, 50): pages 1..3 of 16
    assert plan_reuse(100, T, [0, 1, 2], span).reuse_tokens == 16  # 48 is inside: back to page 1's start
    assert plan_reuse(100, T, [0, 1, 2, 3], span).reuse_tokens == 64  # 64 is past the span: kept
    assert plan_reuse(100, T, [0, 1], ()).reuse_tokens == 32
    two = (MediaKey(10, 8, b"a" * 16), MediaKey(18, 20, b"b" * 16))  # back to back: moving back enters the first
    assert plan_reuse(100, T, [0, 1], two).reuse_tokens == 0


def test_encoder_cache_lru_budget_and_oversize() -> None:
    rows = {k: np.full((4, 8), i, np.float32) for i, k in enumerate([b"a", b"b", b"c"])}  # 128 bytes each
    cache = EncoderCache(budget_bytes=256)
    assert cache.put(b"a", rows[b"a"]) and cache.put(b"b", rows[b"b"])
    assert cache.get(b"a") is not None  # a is now the most recent
    assert cache.put(b"c", rows[b"c"]) and cache.evictions == 1
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.bytes == 256
    assert not cache.put(b"big", np.zeros((16, 8), np.float32)) and cache.oversize == 1 and len(cache.entries) == 2
    disabled = EncoderCache(budget_bytes=0)
    assert not disabled.put(b"a", rows[b"a"]) and disabled.get(b"a") is None and disabled.bytes == 0
    with pytest.raises(KvforgeError, match="encoder_cache_budget_bytes"):
        EncoderCache(budget_bytes=-1)


# --- the fixture: counters, and warm == cold ----------------------------------------------------------

def test_vlm_fixture_counters_and_warm_equals_cold(dirs) -> None:
    data = fixture_data()
    warm_engine = make(dirs, reuse=True)
    warm = run_file(warm_engine, data, base_dir=FIXTURE.parent)
    counters = warm_engine.profile()["context_cache"]
    for key, value in expected_counters().items():
        assert counters[key] == value, key
    cold = run_file(make(dirs, reuse=False), data, base_dir=FIXTURE.parent)
    for w, c in zip(warm, cold, strict=True):
        assert w["output_text"] == c["output_text"]
        assert top1_ids(w) == top1_ids(c)
    multimodal = warm_engine.profile()["multimodal"]
    assert multimodal["total_images"] == 10 and multimodal["total_image_tokens"] == 10 * IMAGE_ROWS
    assert multimodal["encoder_cache"]["misses"] == 2 and multimodal["encoder_cache"]["hits"] == 8


def test_vlm_fixture_continuous_equals_static(dirs) -> None:
    data = {**fixture_data(), "batch_size": 4}
    static = run_file(make(dirs, reuse=True), data, base_dir=FIXTURE.parent)
    continuous = run_file(make(dirs, reuse=True), data, Scheduling.CONTINUOUS, base_dir=FIXTURE.parent)
    assert [top1_ids(r) for r in static] == [top1_ids(r) for r in continuous]


def test_image_changes_the_answer_and_same_image_reuses(dirs, tmp_path: Path) -> None:
    """Different images behind identical placeholder ids must not share KV; the splice reaches the logits."""
    a, b = noise_image(tmp_path / "a.png", (30, 30), 1), noise_image(tmp_path / "b.png", (30, 30), 2)
    engine = make(dirs, reuse=True)
    data = {"top_k": 1, "max_generate_length": 6, "num_logprobs": 1,
            "requests": [image_request(a), image_request(b), image_request(a)]}
    out = run_file(engine, data)
    assert top1_ids(out[0]) == top1_ids(out[2]) and top1_ids(out[0]) != top1_ids(out[1])
    # request 1 shares only text before the image (7 tokens, no full page); request 2 repeats request 0
    cache = engine.profile()["context_cache"]
    assert cache["hit_sequences"] == 1 and cache["media_aware_sequences"] == 3


def test_same_pixels_in_another_file_format_hit(dirs, tmp_path: Path) -> None:
    """Identity is the decoded pixels, not the file: a lossless re-encode hits both caches."""
    png = noise_image(tmp_path / "x.png", (24, 40), 5)
    Image.open(png).save(tmp_path / "x.bmp")
    engine = make(dirs, reuse=True)
    data = {"top_k": 1, "max_generate_length": 2, "requests": [image_request(png), image_request(tmp_path / "x.bmp")]}
    run_file(engine, data)
    profile = engine.profile()
    assert profile["multimodal"]["encoder_cache"]["hits"] == 1 and profile["context_cache"]["hit_sequences"] == 1


def test_span_split_recomputes_the_span_and_equals_cold(dirs, tmp_path: Path) -> None:
    """A reuse point inside an image span (chunked prefill) moves back to the span's page; answers equal cold."""
    a = noise_image(tmp_path / "a.png", (20, 36), 7)
    long_question = "Count the colours in this picture, please, and name each. " * 2
    data = {"top_k": 1, "max_generate_length": 6, "num_logprobs": 1,
            "requests": [image_request(a, question=long_question), image_request(a, question="Short?")]}
    warm_engine = make(dirs, reuse=True)
    warm = run_file(warm_engine, data)
    # Span [9, 25): request 1 matches page 0 only (page 1 holds its different question), and 16 is inside
    # the span, so nothing is reused although one page matched.
    cache = warm_engine.profile()["context_cache"]
    assert cache["matched_tokens"] == T and cache["reused_tokens"] == 0
    cold = run_file(make(dirs, reuse=False), data)
    assert [top1_ids(r) for r in warm] == [top1_ids(r) for r in cold]


def test_chunked_prefill_splits_spans_correctly(dirs, tmp_path: Path) -> None:
    """Prefill chunks that cut an image span in two splice the right rows into each chunk."""
    a = noise_image(tmp_path / "a.png", (20, 36), 8)
    data = {"top_k": 1, "max_generate_length": 4, "num_logprobs": 1,
            "requests": [image_request(a, a, question="Are these the same?")]}
    whole = run_file(make(dirs, reuse=False), data)
    chunked = run_file(make(dirs, reuse=False, prefill_chunk_size=5), data)
    assert top1_ids(whole[0]) == top1_ids(chunked[0])


# --- encoder cache on the engine ------------------------------------------------------------------------

def test_encoder_cache_skips_the_encoder_without_context_reuse(dirs, tmp_path: Path, caplog) -> None:
    a = noise_image(tmp_path / "a.png", (30, 30), 1)
    engine = make(dirs, reuse=False)
    data = {"top_k": 1, "max_generate_length": 2, "requests": [image_request(a)]}
    run_file(engine, data)
    stages = {s["stage_id"]: s["total_runs"] for s in engine.profile()["stages"]}
    with caplog.at_level(logging.INFO, logger="kvforge.multimodal"):
        run_file(engine, {**data, "requests": [image_request(a, question="Again?")]})
    profile = engine.profile()
    assert {s["stage_id"]: s["total_runs"] for s in profile["stages"]}["vision_encoder"] == stages["vision_encoder"]
    cache = profile["multimodal"]["encoder_cache"]
    assert (cache["hits"], cache["misses"], cache["evictions"], cache["bytes"]) == (1, 1, 0, IMAGE_ROWS * 64 * 4)
    assert "context_cache" not in profile
    assert any("all 1 media items of the request hit" in r.message for r in caplog.records)


def test_encoder_cache_budget_zero_and_oversize(dirs, tmp_path: Path) -> None:
    a = noise_image(tmp_path / "a.png", (30, 30), 1)
    data = {"top_k": 1, "max_generate_length": 2, "requests": [image_request(a), image_request(a)]}
    row_bytes = IMAGE_ROWS * 64 * 4  # one image's encoder output (16 rows of the 64-wide text hidden size)
    for budget in (0, row_bytes - 1):
        engine = make(dirs, reuse=False, budget=budget)
        run_file(engine, data)
        cache = engine.profile()["multimodal"]["encoder_cache"]
        assert cache["hits"] == 0 and cache["misses"] == 2 and cache["bytes"] == 0
    engine = make(dirs, reuse=False, budget=row_bytes)
    run_file(engine, data)
    assert engine.profile()["multimodal"]["encoder_cache"]["hits"] == 1


def test_encoder_cache_evicts_least_recently_used(dirs, tmp_path: Path) -> None:
    a, b, c = (noise_image(tmp_path / f"{n}.png", (30, 30), i) for i, n in enumerate("abc"))
    engine = make(dirs, reuse=False, budget=2 * IMAGE_ROWS * 64 * 4)
    run_file(engine, {"top_k": 1, "max_generate_length": 1,
                      "requests": [image_request(a), image_request(b), image_request(a), image_request(c),
                                   image_request(a), image_request(b)]})
    cache = engine.profile()["multimodal"]["encoder_cache"]
    # a, b miss; a hits; c evicts b (least recent); a hits; b misses again and evicts c
    assert (cache["hits"], cache["misses"], cache["evictions"]) == (2, 4, 2)


# --- bad input ------------------------------------------------------------------------------------------

def expect(engine: Engine, data: dict, field: str, fragment: str, base_dir: Path | None = None) -> None:
    with pytest.raises(KvforgeError) as info:
        run_file(engine, data, base_dir=base_dir)
    assert info.value.field == field and fragment in info.value.message, str(info.value)
    assert "\n" not in str(info.value)
    assert_idle(engine)


def test_bad_media_input_names_the_item(dirs, tmp_path: Path) -> None:
    engine = make(dirs, reuse=True)
    good = noise_image(tmp_path / "good.png", (20, 20), 1)
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    (tmp_path / "truncated.png").write_bytes(good.read_bytes()[:200])
    (tmp_path / "notes.txt").write_text("not an image")
    Image.open(good).save(tmp_path / "pic.ico")
    item = "requests[0].messages[0].content[1].image"
    for name, fragment in (("missing.png", "not found"), ("corrupt.png", "not an image Pillow can decode"),
                           ("truncated.png", "cannot decode image"), ("notes.txt", "not an image"),
                           ("pic.ico", "unsupported image format ICO")):
        data = {"requests": [image_request(good, tmp_path / name)]}
        expect(engine, data, item, fragment)
    # `<image>` typed as text is plain text (tests/test_media_prompt_text.py); opting into special tokens refuses it
    text_with_placeholder = {"requests": [image_request(good, question="and <image> here", parse_special_tokens=True)]}
    expect(engine, text_with_placeholder, "requests[0].messages", "contains the placeholder")
    too_many = {"requests": [image_request(*[good] * 14)]}  # 14 × 19 tokens > maxInputLen 256
    expect(engine, too_many, "requests[0].messages[0].content[13]", "maxInputLen 256")
    # the engine still serves a good request afterwards
    run_file(engine, {"top_k": 1, "max_generate_length": 1, "requests": [image_request(good)]})


def test_media_to_a_text_only_engine(dirs, tmp_path: Path) -> None:
    _, engine_dir, _ = dirs
    engine = Engine(engine_dir, EngineConfig(num_threads=1))
    data = {"requests": [image_request(noise_image(tmp_path / "a.png", (8, 8), 1))]}
    expect(engine, data, "requests[0].messages[0].content[0]", "--multimodalEngineDir")


def test_cli_runs_the_fixture_and_reports_bad_images(dirs, tmp_path: Path, run_cli) -> None:
    _, engine_dir, visual_dir = dirs
    cli = ["llm_inference", "--engineDir", engine_dir, "--multimodalEngineDir", visual_dir,
           "--outputFile", tmp_path / "out.json"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"requests": [image_request(tmp_path / "nope.png")]}))
    result = run_cli([*cli, "--inputFile", bad])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: requests[0].messages[0].content[0].image: image file not found: {tmp_path / 'nope.png'}"]
    result = run_cli([*cli, "--inputFile", FIXTURE, "--encoderCacheBudgetBytes", "-5"])
    assert result.returncode == 2 and "--encoderCacheBudgetBytes" in result.stderr
    result = run_cli([*cli, "--inputFile", FIXTURE, "--enableContextReuse", "--profileOutputFile",
                      tmp_path / "profile.json"])
    assert result.returncode == 0, result.stderr
    counters = json.loads((tmp_path / "profile.json").read_text())["context_cache"]
    assert all(counters[k] == v for k, v in expected_counters().items())
    assert "[INFO] encoder cache: all 1 media items of the request hit" in result.stderr


def test_llm_test_runs_the_fixture_with_a_multimodal_engine(dirs, tmp_path: Path, run_cli) -> None:
    _, engine_dir, visual_dir = dirs
    report = tmp_path / "report.json"
    result = run_cli(["llm_test", "--engineDir", engine_dir, "--multimodalEngineDir", visual_dir,
                      "--jsonReport", report, FIXTURE])
    assert result.returncode == 0, result.stdout + result.stderr
    checks = [c for f in json.loads(report.read_text())["files"] for c in f["checks"]]
    assert {c["status"] for c in checks} == {"passed"} and len(checks) >= 3
    result = run_cli(["llm_test", "--engineDir", engine_dir, "--jsonReport", report, FIXTURE])  # no encoder: skipped
    assert result.returncode == 0, result.stdout + result.stderr
    [check] = [c for f in json.loads(report.read_text())["files"] for c in f["checks"]]
    assert check["status"] == "skipped" and "--multimodalEngineDir" in check["reason"]


# A template in the style of SmolVLM's: message content is a list of {type, ...} items, images print `<image>`.
ITEM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_templates_reading_content_items_get_image_items(dirs, tmp_path: Path) -> None:
    import shutil

    from kvforge.runtime.inputs.request_file import parse_request_file

    _, engine_dir, _ = dirs
    copy = tmp_path / "engine"
    shutil.copytree(engine_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": ITEM_TEMPLATE}))
    from kvforge.contract.manifest import ENGINE_KIND, write_manifest
    write_manifest(copy, ENGINE_KIND)  # the edit is deliberate: record it, as llm_build would have
    engine = make((None, copy, dirs[2]), reuse=False)
    assert engine.tokenizer.content_as_items
    image = noise_image(tmp_path / "a.png", (20, 20), 1)
    [request] = parse_request_file({"requests": [image_request(image, question="What?")]}).requests
    prepared = engine.inputs.process(request)
    expansion = "<fake_token_around_image><global-img>" + "<image>" * IMAGE_ROWS + "<fake_token_around_image>"
    expected = engine.tokenizer.encode(f"<|im_start|>User:{expansion}What?<end_of_utterance>\nAssistant:")
    assert prepared.prompt_ids == expected and prepared.media[0].start == expected.index(engine.inputs.multimodal
                                                                                       .image_token_id)
    text_only = parse_request_file({"requests": [{"messages": [{"role": "user", "content": "Hi"}]}]}).requests[0]
    assert engine.inputs.prompt_text(text_only) == "<|im_start|>User: Hi<end_of_utterance>\nAssistant:"


def test_wrong_multimodal_engine_dirs_are_named(dirs) -> None:
    root, engine_dir, _ = dirs
    for path, fragment in ((root / "onnx" / "visual", "build it with llm_build"),
                           (engine_dir, "is not a kvforge encoder dir"), (root / "nowhere", "is not a directory")):
        with pytest.raises(KvforgeError) as info:
            Engine(engine_dir, EngineConfig(num_threads=1, multimodal_engine_dir=str(path)))
        assert info.value.field == "multimodal_engine_dir" and fragment in info.value.message, str(info.value)


def test_python_api_takes_image_items(dirs, tmp_path: Path) -> None:
    from kvforge import LLM, SamplingParams

    _, engine_dir, visual_dir = dirs
    a = noise_image(tmp_path / "a.png", (30, 30), 1)
    llm = LLM(engine_dir, multimodal_engine_dir=visual_dir, enable_context_reuse=True, num_threads=1)
    params = SamplingParams(top_k=1, max_generate_length=3, num_logprobs=1)
    chat = [{"role": "user", "content": [{"type": "image", "image": str(a)}, {"type": "text", "text": "What?"}]}]
    [first] = llm.chat(chat, params)
    [again] = llm.chat(chat, params)
    assert first.token_ids == again.token_ids and again.cached_tokens > 0
    assert llm.engine.profile()["multimodal"]["encoder_cache"]["hits"] == 1
    with pytest.raises(KvforgeError) as info:
        llm.chat([{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "nope.png")}]}], params)
    assert info.value.field == "messages[0].content[0].image"


def test_encoder_engines_keep_the_hardening_promises(dirs, tmp_path: Path) -> None:
    """An encoder build never writes over its export, is staged with a manifest, and a damaged encoder engine is
    refused on load (like text engines: tests/test_hardening_*)."""
    import shutil

    root, engine_dir, visual = dirs
    export = root / "onnx" / "visual"
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    with pytest.raises(KvforgeError) as info:
        build_encoder_engine(export, export, "auto", 4)
    assert info.value.field == "engine_dir"
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before
    assert (visual / "manifest.json").is_file()
    damaged = tmp_path / "visual"
    shutil.copytree(visual, damaged)
    weights = next(p for p in damaged.iterdir() if p.suffix == ".data")
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.raises(KvforgeError) as info:
        Engine(engine_dir, EngineConfig(num_threads=1, multimodal_engine_dir=str(damaged)))
    assert info.value.field == "multimodal_engine_dir" and "manifest" in info.value.message
