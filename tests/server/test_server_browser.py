"""The chat page in headless Chromium (Debian's `chromium`, driven by Playwright): two turns, and the second
shows cached tokens > 0; Stop, New chat, markdown answers, Attach only where the server takes media, and a
favicon. The screenshots are kept in out/test-artifacts/ (or $KVFORGE_TEST_ARTIFACTS)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from support.server_harness import build_server_engine, live_server

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root in a closed network: no sandbox, and nothing that phones home (refused connections slow it down).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000
FIRST_TURN = "Please summarise the commissioning report of the tidal energy array in two sentences."
SECOND_TURN = "And who chaired the review board?"


def artifact_dir() -> Path:
    path = Path(os.environ.get("KVFORGE_TEST_ARTIFACTS", ROOT / "out" / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_chat_page_shows_reuse_on_the_second_turn(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[dev]')")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does it)")
    engine_dir = build_server_engine(tiny_onnx_dir, tmp_path / "engine")
    with live_server(engine_dir, tmp_path) as server, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(server.url + "/")
            sync_api.expect(page.locator("#model")).to_have_text("tiny")
            page.click("summary")  # open the settings
            page.fill("#max-tokens", "24")
            stats = page.locator(".turn.assistant .stats")
            for count, text in enumerate((FIRST_TURN, SECOND_TURN), start=1):
                page.fill("#prompt", text)
                page.keyboard.press("Enter")
                sync_api.expect(stats).to_have_count(count)
            first, second = (stats.nth(i) for i in range(2))
            assert int(first.get_attribute("data-cached-tokens")) == 0
            cached = int(second.get_attribute("data-cached-tokens"))
            assert cached > 0, "the second turn did not reuse the first turn's pages"
            assert cached < int(second.get_attribute("data-prompt-tokens"))
            assert float(second.get_attribute("data-ttft-ms")) > 0
            assert "cached" in second.inner_text()
            shot = artifact_dir() / "chat_page.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"\nscreenshot: {shot}")
        finally:
            browser.close()


def test_chat_page_sends_an_attached_image_and_the_next_turn_reuses_it(tmp_path: Path) -> None:
    """Attach a PNG on the chat page: the turn shows it, the server answers, and the next turn (which sends the same
    image again as part of the conversation) hits the encoder cache and the cached pages."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[dev]')")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does it)")
    import numpy as np
    from PIL import Image
    from test_server import metric_values
    from test_server_media import BUILD

    from kvforge.builder.build import build_engine
    from kvforge.builder.encoder_build import build_encoder_engine
    from kvforge.tools.export.families.idefics3_source import write_visual_onnx_dir
    from kvforge.tools.export.sources.synthetic import synthetic_idefics3
    from kvforge.tools.export.writer import write_onnx_dir

    text, visual = synthetic_idefics3()
    write_onnx_dir(text, tmp_path / "onnx")
    write_visual_onnx_dir(visual, tmp_path / "onnx" / "visual")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BUILD)
    build_encoder_engine(tmp_path / "onnx" / "visual", tmp_path / "visual", "auto", 4)
    photo = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(photo)
    with live_server(tmp_path / "engine", tmp_path, multimodal_engine_dir=str(tmp_path / "visual")) as server, \
            sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(server.url + "/")
            sync_api.expect(page.locator("#model")).to_have_text("tiny")
            page.click("summary")
            page.fill("#max-tokens", "8")
            page.set_input_files("#attach", str(photo))
            sync_api.expect(page.locator("#attached")).to_contain_text("photo.png")
            stats = page.locator(".turn.assistant .stats")
            for count, question in enumerate(("What is in this picture?", "And its colours?"), start=1):
                page.fill("#prompt", question)
                page.keyboard.press("Enter")
                sync_api.expect(stats).to_have_count(count)
            sync_api.expect(page.locator("#attach-label")).to_be_visible()  # the server has an image encoder
            assert page.get_attribute("body", "data-modalities") == "text,image"
            assert page.locator(".turn.user img").count() == 1  # shown with the turn that attached it
            sync_api.expect(page.locator("#attached")).to_have_text("Attach")  # and not attached again
            second = stats.nth(1)
            assert int(second.get_attribute("data-cached-tokens")) > 0
            metrics = metric_values(server)
            assert metrics["kvforge_encoder_cache_misses_total"] == 1
            assert metrics["kvforge_encoder_cache_hits_total"] >= 1  # the second turn resent the same image
            page.screenshot(path=str(artifact_dir() / "chat_page_image.png"), full_page=True)
        finally:
            browser.close()


# An answer in markdown, and what a model might write to attack the page: all of it must show as text.
MARKDOWN = """## Tide table

The **high tide** is at `06:40`, see [the harbour](https://harbour.example/tides) or _ask_ the_master_on_duty.

1. Check the gauge
2. Log it

- one
- two

```python
print("<b>ok</b>")
```

| time | height |
|---|---|
| 06:40 | 4.1 m |

> quoted

<script>window.pwned = 1</script> <img src=x onerror="window.pwned = 2"> [click](javascript:window.pwned=3)"""


def _sse(text: str) -> str:
    """A streamed chat completion of `text` in three pieces, with usage, as the server sends it."""
    pieces = [text[:20], text[20:90], text[90:]]
    chunks = [{"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in pieces]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 30,
                                            "prompt_tokens_details": {"cached_tokens": 0}}})
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


def _slow_engine(server: Any, seconds: float) -> None:
    """Each engine step takes `seconds` longer, so an answer streams long enough to be stopped by a click."""
    backend = server.state.engine_loop.engine.backend
    inner = type(backend).forward.__get__(backend)

    def forward(step: Any) -> Any:
        time.sleep(seconds)
        return inner(step)

    backend.forward = forward


def test_chat_page_stop_new_chat_markdown_favicon(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[dev]')")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does it)")
    engine_dir = build_server_engine(tiny_onnx_dir, tmp_path / "engine")
    with live_server(engine_dir, tmp_path) as server, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            page.set_default_timeout(TIMEOUT_MS)
            missing: list[str] = []
            page.on("response", lambda response: missing.append(response.url) if response.status >= 400 else None)
            page.goto(server.url + "/")
            sync_api.expect(page.locator("#model")).to_have_text("tiny")

            # a text-only server: no Attach (it would refuse every file); the favicon is served, not a 404
            sync_api.expect(page.locator("#attach-label")).to_be_hidden()
            assert page.get_attribute("body", "data-modalities") == "text"
            icon = page.request.get(server.url + "/favicon.ico")
            assert icon.status == 200 and icon.headers["content-type"] == "image/x-icon"
            assert icon.body()[:4] == b"\x00\x00\x01\x00"  # an ICO file
            page.wait_for_load_state("networkidle")
            assert not missing, f"requests that failed: {missing}"

            # Stop: the answer stops where it is, its text is kept, and the server cancels the request
            page.click("summary")
            page.fill("#max-tokens", "200")
            _slow_engine(server, 0.05)  # 200 tokens would take 10 s
            page.fill("#prompt", FIRST_TURN)
            page.keyboard.press("Enter")
            sync_api.expect(page.locator("#stop")).to_be_visible()
            sync_api.expect(page.locator("#send")).to_be_hidden()
            page.wait_for_function("document.querySelector('.turn.assistant .text').textContent.length > 0")
            stopped_at = time.monotonic()
            page.click("#stop")
            sync_api.expect(page.locator(".turn.assistant.stopped")).to_have_count(1)
            sync_api.expect(page.locator(".turn.assistant.stopped .stats")).to_have_text("stopped")
            sync_api.expect(page.locator("#send")).to_be_visible()
            sync_api.expect(page.locator("#stop")).to_be_hidden()
            while server.state.in_flight and time.monotonic() - stopped_at < 5:
                time.sleep(0.05)
            assert server.state.in_flight == 0, "the server kept generating after Stop"
            assert time.monotonic() - stopped_at < 5

            # the next turn goes on from the stopped one: its partial answer is part of the conversation
            _slow_engine(server, 0.0)
            page.fill("#max-tokens", "8")
            with page.expect_request("**/v1/chat/completions") as sent:
                page.fill("#prompt", SECOND_TURN)
                page.keyboard.press("Enter")
            messages = sent.value.post_data_json["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant", "user"] and messages[1]["content"]
            sync_api.expect(page.locator(".stats[data-prompt-tokens]")).to_have_count(1)
            page.screenshot(path=str(artifact_dir() / "chat_page_stopped.png"), full_page=True)

            # New chat: the turns are gone and the next request carries only its own question
            page.click("#new-chat")
            sync_api.expect(page.locator(".turn")).to_have_count(0)
            with page.expect_request("**/v1/chat/completions") as sent:
                page.fill("#prompt", SECOND_TURN)
                page.keyboard.press("Enter")
            assert [m["role"] for m in sent.value.post_data_json["messages"]] == ["user"]
            sync_api.expect(page.locator(".stats[data-prompt-tokens]")).to_have_count(1)

            # markdown: a streamed answer renders as markup built from text, whatever it holds
            page.route("**/v1/chat/completions", lambda route: route.fulfill(
                status=200, headers={"content-type": "text/event-stream"}, body=_sse(MARKDOWN)))
            page.click("#new-chat")
            page.fill("#prompt", "The tides?")
            page.keyboard.press("Enter")
            answer = page.locator(".turn.assistant .text.md")
            sync_api.expect(answer.locator("table td")).to_have_count(2)
            assert answer.locator("table th").all_inner_texts() == ["time", "height"]
            assert answer.locator("h4").inner_text() == "Tide table"  # ## is h4: # is h3 in an answer
            assert answer.locator("strong").inner_text() == "high tide"
            assert answer.locator("p code").first.inner_text() == "06:40"
            assert answer.locator("em").inner_text() == "ask"  # and the_master_on_duty stays a word
            assert "the_master_on_duty" in answer.inner_text()
            assert answer.locator("ol li").count() == 2 and answer.locator("ul li").count() == 2
            assert answer.locator("pre code").get_attribute("data-lang") == "python"
            assert answer.locator("pre code").inner_text() == 'print("<b>ok</b>")'
            assert answer.locator("blockquote").inner_text() == "quoted"
            links = answer.locator("a")
            assert links.count() == 1 and links.get_attribute("href") == "https://harbour.example/tides"
            assert links.get_attribute("rel") == "noopener noreferrer nofollow"
            assert answer.locator("script, img, b").count() == 0  # shown as text, not made into elements
            assert "<script>window.pwned = 1</script>" in answer.inner_text()
            assert "[click](javascript:window.pwned=3)" in answer.inner_text()
            assert page.evaluate("window.pwned") is None
            page.screenshot(path=str(artifact_dir() / "chat_page_markdown.png"), full_page=True)
        finally:
            browser.close()
