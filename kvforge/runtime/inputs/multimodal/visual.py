"""The visual encoder engine of a multimodal engine dir: decoded images in, one embedding row per placeholder token out.

Both encoder kinds (this one and audio.AudioEncoder; encoders.load_encoder picks one) answer the same questions
for MultimodalProcessor: how to decode an item (and its identity), how many placeholder rows it takes, the text
around its placeholders, and its rows for a batch of items.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvforge.contract.multimodal import (
    ENCODER_INPUT,
    ENCODER_OUTPUT,
    VISUAL_ENGINE_FILE,
    VISUAL_TRT_ENGINE_FILE,
    EncoderConfig,
)
from kvforge.runtime.inputs.multimodal.encoder_session import encoder_session
from kvforge.runtime.inputs.multimodal.image import (
    DecodedImage,
    TileGrid,
    decode_image,
    idefics3_pixel_values,
    idefics3_tile_grid,
)

# Idefics3Processor opens every tile (and the global image) with this token; the suffix of an image is it too.
TILE_SEPARATOR = "<fake_token_around_image>"


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

    def decode(self, source: Path | bytes, where: str) -> DecodedImage:
        return decode_image(source, where, self.config.preprocessing)

    def layout(self, item: DecodedImage) -> TileGrid:
        """What the image's placeholder text depends on: its tile grid (from the decoded shape alone)."""
        return idefics3_tile_grid(*item.pixels.shape[:2], self.config.preprocessing)

    def placeholder_text(self, grid: TileGrid) -> str:
        """Idefics3Processor's expansion of one image: per tile `<fake_token_around_image><row_r_col_c>` and its
        image tokens, a newline after each row of tiles, then a newline and the global image as an unsplit
        image is written (prefix, image tokens, suffix)."""
        image = self.config.image_token * self.config.tokens_per_image
        tiles = "".join("".join(f"{TILE_SEPARATOR}<row_{r + 1}_col_{c + 1}>{image}" for c in range(grid.cols)) + "\n"
                        for r in range(grid.rows))
        return (tiles + "\n" if grid.rows else "") + self.config.image_prefix + image + self.config.image_suffix

    def rows(self, item: DecodedImage) -> int:
        return self.layout(item).frames * self.config.tokens_per_image

    def encode(self, items: list[DecodedImage]) -> list[np.ndarray]:
        """Rows per image (its tiles' then its global image's, in prompt order), every frame of every image
        batched into calls of at most max_batch_size frames."""
        frames = [idefics3_pixel_values(item.pixels, self.config.preprocessing) for item in items]
        pixel_values = np.concatenate(frames)
        step = max(self.config.max_batch_size, 1)
        rows = np.concatenate([self.session.run([ENCODER_OUTPUT], {ENCODER_INPUT: pixel_values[i:i + step]})[0]
                               for i in range(0, len(pixel_values), step)]).astype(np.float32, copy=False)
        bounds = np.cumsum([0] + [len(f) for f in frames])
        # copies: a cached image must not keep the whole batch's array alive (the cache counts its own bytes)
        return [rows[lo:hi].reshape(-1, rows.shape[-1]).copy() for lo, hi in zip(bounds[:-1], bounds[1:],
                                                                                   strict=True)]
