"""Idefics3 image splitting: the tile grid and pixels against transformers' image processor, and a split tiny
SmolVLM engine (tiles + global image per image, one span per image) reusing KV without changing an answer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.engine_driver import run_file, top1_ids

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.encoder_build import build_encoder_engine
from kvforge.contract.multimodal import ImagePreprocessing
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.file_loop import prepare_requests
from kvforge.runtime.inputs.multimodal.image import idefics3_pixel_values, idefics3_tile_grid
from kvforge.runtime.inputs.request_file import parse_request_file
from kvforge.tools.export.families.idefics3_source import write_visual_onnx_dir
from kvforge.tools.export.sources.synthetic import synthetic_idefics3
from kvforge.tools.export.writer import write_onnx_dir

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "test_cases" / "vlm_context_reuse.json"
T = 16  # tokens per page
TILE_ROWS = 16  # placeholders per frame (tile or global image) of tiny-idefics3
HIDDEN = 64  # tiny-idefics3's text hidden size


def noise_image(path: Path, shape: tuple[int, int], seed: int) -> Path:
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*shape, 3), dtype=np.uint8)).save(path)
    return path


# (height, width, longest_edge) on 48-pixel tiles: wide, tall, square, tiny, sizes where the int truncations of
# the two resizes matter, a single row of tiles, and images that fit one tile (no split: the global image alone).
SHAPES = [(30, 53, 144), (53, 30, 144), (64, 64, 144), (3, 7, 144), (97, 41, 144), (41, 200, 96),
          (300, 299, 144), (20, 20, 48), (30, 53, 48)]


@pytest.mark.parametrize(("height", "width", "longest_edge"), SHAPES, ids=[f"{h}x{w}@{e}" for h, w, e in SHAPES])
def test_tile_grid_and_pixels_match_transformers(height: int, width: int, longest_edge: int) -> None:
    pytest.importorskip("transformers", reason="the reference is transformers' Idefics3ImageProcessorPil")
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    pixels = np.random.default_rng(height + width).integers(0, 255, (height, width, 3), dtype=np.uint8)
    reference = Idefics3ImageProcessorPil(do_image_splitting=True, size={"longest_edge": longest_edge},
                                          max_image_size={"longest_edge": 48}, do_pad=False)
    out = reference(images=[[Image.fromarray(pixels)]], return_row_col_info=True)
    frames = np.stack(out["pixel_values"][0])
    pre = ImagePreprocessing(longest_edge=longest_edge, image_size=48, do_image_splitting=True)
    grid = idefics3_tile_grid(height, width, pre)
    assert (grid.rows, grid.cols) == (out["rows"][0][0], out["cols"][0][0])
    ours = idefics3_pixel_values(pixels, pre)
    assert ours.shape == frames.shape == (grid.frames, 3, 48, 48)
    assert np.abs(ours - frames).max() <= 1e-5


def test_splitting_off_keeps_one_frame() -> None:
    pre = ImagePreprocessing(longest_edge=144, image_size=48)
    assert idefics3_tile_grid(30, 200, pre).frames == 1
    assert idefics3_pixel_values(np.zeros((30, 200, 3), np.uint8), pre).shape == (1, 3, 48, 48)


@pytest.fixture(scope="module")
def split_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vlm_split")
    text, visual = synthetic_idefics3(split_tiles=2)
    write_onnx_dir(text, root / "onnx")
    write_visual_onnx_dir(visual, root / "onnx" / "visual")
    build_engine(root / "onnx", root / "engine",
                 BuildOptions(max_input_len=512, max_kv_cache_capacity=1024, max_batch_size=4, tokens_per_page=T))
    build_encoder_engine(root / "onnx" / "visual", root / "visual", "auto", 4)
    return root / "engine", root / "visual"


def make(dirs: tuple[Path, Path], reuse: bool, **config) -> Engine:
    engine, visual = dirs
    return Engine(engine, EngineConfig(num_threads=2, enable_context_reuse=reuse, multimodal_engine_dir=str(visual),
                                       **config))


def image_request(*items: Path, question: str = "What is shown?") -> dict:
    content = [{"type": "image", "image": str(i)} for i in items] + [{"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content}]}


def prepared_spans(engine: Engine, request: dict) -> tuple[list[int], tuple]:
    request_file = parse_request_file({"top_k": 1, "max_generate_length": 1, "requests": [request]})
    [prepared] = prepare_requests(engine, request_file, None)
    return prepared.prompt_ids, prepared.media


def test_split_image_is_one_span_over_its_tiles(split_dirs, tmp_path: Path) -> None:
    engine = make(split_dirs, reuse=False)
    image = noise_image(tmp_path / "wide.png", (30, 53), 1)  # -> 72x128 -> 128x128: 2x2 tiles + global
    ids, [span] = prepared_spans(engine, image_request(image))
    token_id = engine.inputs.multimodal.image_token_id
    positions = [i for i, t in enumerate(ids) if t == token_id]
    assert len(positions) == len(span.embeds) == 5 * TILE_ROWS
    assert (span.start, span.end) == (positions[0], positions[-1] + 1) and span.end - span.start > len(positions)
    assert list(span.start + span.offsets) == positions  # rows land on the placeholders, markers are left alone
    text = engine.tokenizer.tokenizer.decode(ids, skip_special_tokens=False)
    assert all(f"<row_{r}_col_{c}>" in text for r in (1, 2) for c in (1, 2)) and "<row_3_col_1>" not in text


def test_split_fixture_warm_equals_cold_and_caches_one_entry_per_image(split_dirs) -> None:
    """The seed's vlm_context_reuse scenarios on the split engine: every warm answer equals cold; both fixture
    images take 2x2 tiles + global (80 placeholders), each one encoder-cache entry."""
    data = json.loads(FIXTURE.read_text())
    warm_engine = make(split_dirs, reuse=True)
    warm = run_file(warm_engine, data, base_dir=FIXTURE.parent)
    cold = run_file(make(split_dirs, reuse=False), data, base_dir=FIXTURE.parent)
    for w, c in zip(warm, cold, strict=True):
        assert w["output_text"] == c["output_text"] and top1_ids(w) == top1_ids(c)
    profile = warm_engine.profile()
    multimodal, cache = profile["multimodal"], profile["context_cache"]
    assert multimodal["total_images"] == 10 and multimodal["total_image_tokens"] == 10 * 5 * TILE_ROWS
    encoder = multimodal["encoder_cache"]
    assert (encoder["misses"], encoder["hits"], encoder["bytes"]) == (2, 8, 2 * 5 * TILE_ROWS * HIDDEN * 4)
    assert cache["hit_sequences"] == 7 and cache["media_aware_sequences"] == 7
    assert cache["reused_tokens"] == 1104  # measured; 592 unsplit (the fixture's own counters): spans are longer


def test_reuse_point_inside_a_split_span_moves_to_its_start(split_dirs, tmp_path: Path) -> None:
    """Same image, new question: the page holding the span's end holds the question too, so the reuse point
    falls inside the span (between or inside tiles) and moves back to the page holding the span's start."""
    image = noise_image(tmp_path / "a.png", (48, 64), 2)
    data = {"top_k": 1, "max_generate_length": 4, "num_logprobs": 1,
            "requests": [image_request(image, question="Describe it."), image_request(image, question="Colours?")]}
    warm_engine = make(split_dirs, reuse=True)
    warm = run_file(warm_engine, data)
    _, [span] = prepared_spans(warm_engine, data["requests"][1])
    cache = warm_engine.profile()["context_cache"]
    assert cache["matched_tokens"] > span.start + T  # pages over whole tiles matched...
    assert cache["reused_tokens"] == span.start // T * T  # ...but only the pages before the span are reused
    cold = run_file(make(split_dirs, reuse=False), data)
    assert [top1_ids(r) for r in warm] == [top1_ids(r) for r in cold]


def test_chunks_cutting_tiles_and_markers_splice_the_right_rows(split_dirs, tmp_path: Path) -> None:
    a, b = noise_image(tmp_path / "a.png", (30, 53), 3), noise_image(tmp_path / "b.png", (53, 30), 4)
    data = {"top_k": 1, "max_generate_length": 4, "num_logprobs": 1,
            "requests": [image_request(a, b, question="Are these the same?")]}
    whole = run_file(make(split_dirs, reuse=False), data)
    chunked = run_file(make(split_dirs, reuse=False, prefill_chunk_size=7), data)
    assert top1_ids(whole[0]) == top1_ids(chunked[0])


def test_export_reads_splitting_and_old_encoder_dirs_stay_unsplit(tmp_path: Path) -> None:
    from kvforge.contract.multimodal import EncoderConfig
    from kvforge.tools.export.families.idefics3_source import read_preprocessing

    assert read_preprocessing(tmp_path).do_image_splitting  # no preprocessor_config.json: transformers' default
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"do_image_splitting": False, "size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}}))
    pre = read_preprocessing(tmp_path)
    assert (pre.do_image_splitting, pre.longest_edge, pre.image_size) == (False, 2048, 512)
    _, visual = synthetic_idefics3(split_tiles=2)
    written = visual.config.to_dict()
    assert written["preprocessing"]["do_image_splitting"] is True
    del written["preprocessing"]["do_image_splitting"]  # a dir written before the field existed
    assert not EncoderConfig.from_dict(written, "config.json").preprocessing.do_image_splitting
