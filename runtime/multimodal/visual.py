"""The encoder engines of a multimodal engine dir: decoded media in, one embedding row per placeholder token out.

Both kinds answer the same questions for MultimodalProcessor: how to decode an item (and its identity), how many
placeholder rows it takes, the text around its placeholders, and its rows for a batch of items.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from PIL import Image, UnidentifiedImageError

from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.manifest import ENGINE_KIND, verify_manifest
from kvforge.contract.model_config import read_json
from kvforge.contract.multimodal import (
    AUDIO,
    ENCODER_FORMAT,
    ENCODER_INPUT,
    ENCODER_OUTPUT,
    VISUAL,
    VISUAL_ENGINE_FILE,
    VISUAL_TRT_ENGINE_FILE,
    AudioEncoderConfig,
    EncoderConfig,
)
from kvforge.runtime.multimodal.image import (
    SUPPORTED_FORMATS,
    DecodedImage,
    _to_rgb,
    decode_image,
    idefics3_pixel_values,
    media_digest,
)
from kvforge.runtime.ort_runner import make_session

FIELD = "multimodal_engine_dir"
# Inline images (llm_serve) are bounded before their pixels are decoded: 40 Mpx is 120 MB of RGB, and a small
# compressed file cannot claim more (Pillow's own decompression-bomb limit is 2 x 89 Mpx, an error past it).
MAX_INLINE_IMAGE_PIXELS = 40_000_000


def _session(path: Path, num_threads: int) -> ort.InferenceSession:
    return make_session(str(path), num_threads, field=FIELD)


def encoder_session(engine_dir: Path, config: Any, onnx_file: str, trt_file: str, num_threads: int):
    """The engine dir's encoder behind onnxruntime's `run(outputs, feeds)`: an ONNX Runtime session, or for
    backend tensorrt a TensorRT engine (needs the tensorrt extra; one-line error without it)."""
    if config.backend == "tensorrt":
        _check_engine_dir(engine_dir, config, trt_file)
        from kvforge.runtime.trt_runner import TrtEncoderSession  # imports tensorrt through the single guard

        return TrtEncoderSession(engine_dir / trt_file, FIELD)
    _check_engine_dir(engine_dir, config, onnx_file)
    return _session(engine_dir / onnx_file, num_threads)


def _check_engine_dir(engine_dir: Path, config: Any, file: str) -> None:
    if not config.backend:
        raise InvalidConfig(f"{engine_dir} is an encoder ONNX dir, not an engine dir; build it with llm_build", FIELD)
    if not (engine_dir / file).is_file():
        raise InvalidConfig(f"multimodal engine dir {engine_dir} is missing {file}; rebuild it", FIELD)
    verify_manifest(engine_dir, ENGINE_KIND, FIELD, "rebuild it with llm_build")


class VisualEncoder:
    __slots__ = ("config", "session")
    kind = "image"
    stage = "vision_encoder"

    def __init__(self, engine_dir: Path, config: EncoderConfig, num_threads: int = 0) -> None:
        self.config = config
        self.session = encoder_session(engine_dir, config, VISUAL_ENGINE_FILE, VISUAL_TRT_ENGINE_FILE, num_threads)

    @property
    def token_id(self) -> int:
        return self.config.image_token_id

    @property
    def marker(self) -> str:
        return self.config.image_token

    def placeholder_text(self, rows: int) -> str:
        return self.config.image_prefix + self.config.image_token * rows + self.config.image_suffix

    def decode(self, source: Path | bytes, where: str) -> DecodedImage:
        return decode_image(source, where) if isinstance(source, Path) else decode_image_bytes(source, where)

    def rows(self, item: DecodedImage) -> int:
        return self.config.tokens_per_image

    def encode(self, items: list[DecodedImage]) -> list[np.ndarray]:
        """Rows per image, in calls of at most max_batch_size images."""
        pixel_values = np.stack([idefics3_pixel_values(item.pixels, self.config.preprocessing) for item in items])
        step = max(self.config.max_batch_size, 1)
        parts = [self.session.run([ENCODER_OUTPUT], {ENCODER_INPUT: pixel_values[i:i + step]})[0]
                 for i in range(0, len(pixel_values), step)]
        return list(np.concatenate(parts).astype(np.float32, copy=False))


def decode_image_bytes(data: bytes, where: str) -> DecodedImage:
    """decode_image for bytes sent inline: the same formats, RGB conversion and identity, so an image sent
    inline and the same file given by path share their encoder-cache entry and page keys."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in SUPPORTED_FORMATS:
                raise KvforgeError(f"unsupported image format {image.format}; supported: "
                                   f"{', '.join(SUPPORTED_FORMATS)}", where)
            if image.width * image.height > MAX_INLINE_IMAGE_PIXELS:
                raise KvforgeError(f"the image is {image.width}x{image.height} pixels, more than the "
                                   f"{MAX_INLINE_IMAGE_PIXELS:,} this server decodes", where)
            image.load()
            rgb = _to_rgb(image)
    except UnidentifiedImageError:
        raise KvforgeError(f"the data is not an image Pillow can decode (supported: "
                           f"{', '.join(SUPPORTED_FORMATS)})", where) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:  # truncated or corrupt data
        raise KvforgeError(f"cannot decode the image: {exc}", where) from None
    pixels = np.asarray(rgb, dtype=np.uint8)
    return DecodedImage(pixels, media_digest(pixels))


def load_encoder(engine_dir: Path, num_threads: int = 0):  # -> VisualEncoder | AudioEncoder
    if not engine_dir.is_dir():
        raise InvalidConfig(f"{engine_dir} is not a directory", FIELD)
    data = read_json(engine_dir / "config.json", FIELD)
    where = f"{engine_dir}/config.json"
    if data.get("format") != ENCODER_FORMAT:
        raise InvalidConfig(f"{engine_dir} is not a kvforge encoder dir (a text engine?); give the dir llm_build "
                            "wrote from llm_export's OUTPUTDIR/visual or OUTPUTDIR/audio", FIELD)
    if data.get("kind") == AUDIO:
        from kvforge.runtime.multimodal.audio import AudioEncoder
        return AudioEncoder(engine_dir, AudioEncoderConfig.from_dict(data, where), num_threads)
    if data.get("kind") != VISUAL and "kind" in data:
        raise InvalidConfig(f"unsupported encoder kind {data.get('kind')!r}", FIELD)
    return VisualEncoder(engine_dir, EncoderConfig.from_dict(data, where), num_threads)
