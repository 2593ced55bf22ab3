"""The chat page in headless Chromium (Debian's `chromium`, driven by Playwright): two turns, and the second
shows cached tokens > 0. The screenshot is kept in out/test-artifacts/ (or $KVFORGE_TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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
