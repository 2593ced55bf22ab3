"""Media items of a request -> placeholder token spans, media identity and encoder embeddings (cached by digest)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.profile_schema import MULTIMODAL
from kvforge.runtime.context_cache.keys import MediaKey
from kvforge.runtime.multimodal.encoder_cache import EncoderCache
from kvforge.runtime.multimodal.image import DecodedImage, decode_image
from kvforge.runtime.multimodal.spans import MediaSpan
from kvforge.runtime.multimodal.visual import FIELD, VisualEncoder
from kvforge.runtime.profile import Profiler
from kvforge.runtime.tokenizer import ChatTokenizer
from kvforge.runtime.types import MEDIA_SENTINEL, MediaRef

VISION_ENCODER_STAGE = "vision_encoder"
MULTIMODAL_PROCESSING_STAGE = "multimodal_processing"
log = logging.getLogger("kvforge.multimodal")


@dataclass(slots=True)
class MultimodalStats:
    """The profile's `multimodal` block (the seed's totals; audio stays 0 until audio lands)."""

    total_runs: int = 0  # encoder calls
    total_images: int = 0  # images in requests (cache hits included)
    total_image_tokens: int = 0
    encoded_tokens: int = 0  # placeholder rows the encoder computed (for the per-token time)


class MultimodalProcessor:
    """Owns the visual engine and the encoder cache; InputProcessor hands it prompts holding media sentinels."""

    __slots__ = ("encoder", "cache", "tokenizer", "profiler", "stats", "expansion", "offset_in_expansion")

    def __init__(self, encoder: VisualEncoder, cache: EncoderCache, tokenizer: ChatTokenizer,
                 profiler: Profiler, text_hidden_size: int) -> None:
        config = encoder.config
        if config.text_hidden_size != text_hidden_size:
            raise InvalidConfig(f"the encoder outputs {config.text_hidden_size}-wide rows but the text engine's "
                                f"hidden size is {text_hidden_size}; export both from one checkpoint", FIELD)
        self.encoder, self.cache, self.tokenizer, self.profiler = encoder, cache, tokenizer, profiler
        self.stats = MultimodalStats()
        text = config.image_prefix + config.image_token * config.tokens_per_image + config.image_suffix
        self.expansion = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        image_positions = [i for i, t in enumerate(self.expansion) if t == config.image_token_id]
        if len(image_positions) != config.tokens_per_image or \
                image_positions[-1] - image_positions[0] + 1 != config.tokens_per_image:
            raise InvalidConfig(f"the text engine's tokenizer does not turn {config.image_token!r} into the encoder's "
                                f"image_token_id {config.image_token_id}; are the two dirs from one checkpoint?",
                                FIELD)
        self.offset_in_expansion = image_positions[0]

    @property
    def image_token_id(self) -> int:
        return self.encoder.config.image_token_id

    def tokenize(self, text: str, media: list[MediaRef], base_dir: Path | None, max_input_len: int,
                 where: str) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """Token ids of a rendered prompt whose media sentinels become placeholder spans, and those spans with
        their embeddings. Every error is one line naming the media item (or `where` for the prompt)."""
        segments = text.split(MEDIA_SENTINEL)
        if len(segments) - 1 != len(media):
            raise KvforgeError(f"the chat template kept {len(segments) - 1} of the request's {len(media)} media "
                               "items (it dropped a message holding one)", where)
        ids = self.tokenizer.encode(segments[0])
        keys_and_images: list[tuple[int, MediaRef, DecodedImage]] = []
        tokens = self.encoder.config.tokens_per_image
        for ref, segment in zip(media, segments[1:], strict=True):
            if ref.kind != "image":
                raise KvforgeError(f'"{ref.kind}" items need an {ref.kind} encoder; this engine has a visual one',
                                   f"{ref.where}.type")
            start = len(ids) + self.offset_in_expansion
            ids += self.expansion
            if len(ids) > max_input_len:
                raise KvforgeError(f"this image brings the prompt to at least {len(ids)} tokens, more than the "
                                   f"engine's maxInputLen {max_input_len} (each image takes {len(self.expansion)}); "
                                   "send fewer images or rebuild with a larger --maxInputLen", ref.where)
            ids += self.tokenizer.tokenizer.encode(segment, add_special_tokens=False).ids
            keys_and_images.append((start, ref, decode_image(_resolve(ref.path, base_dir), f"{ref.where}.image")))
        if ids.count(self.image_token_id) != tokens * len(media):
            raise KvforgeError(f"the prompt text contains the image placeholder {self.encoder.config.image_token!r}; "
                               "send images as {\"type\": \"image\"} content items", where)
        embeds = self._embeddings([image for _, _, image in keys_and_images])
        spans = tuple(MediaSpan(MediaKey(start, tokens, image.digest), rows)
                      for (start, _, image), rows in zip(keys_and_images, embeds, strict=True))
        return ids, spans

    def _embeddings(self, images: list[DecodedImage]) -> list[np.ndarray]:
        """Encoder rows per image: cache hits as they are, misses encoded in one batch (duplicates once)."""
        found: dict[bytes, np.ndarray] = {}
        missing: dict[bytes, DecodedImage] = {}
        for image in images:
            if image.digest in found or image.digest in missing:
                continue
            cached = self.cache.get(image.digest)
            if cached is None:
                missing[image.digest] = image
            else:
                found[image.digest] = cached
        if missing:
            started = time.perf_counter()
            pixel_values = np.stack([self.encoder.preprocess(image.pixels) for image in missing.values()])
            preprocess_ms = (time.perf_counter() - started) * 1e3
            with self.profiler.stage(VISION_ENCODER_STAGE):
                outputs = self.encoder.encode(pixel_values)
            self.profiler.record(MULTIMODAL_PROCESSING_STAGE, preprocess_ms)
            for digest, rows in zip(missing, outputs, strict=True):
                rows = np.ascontiguousarray(rows)
                self.cache.put(digest, rows)
                rows.setflags(write=False)
                found[digest] = rows
            if self.profiler.enabled:
                self.stats.total_runs += 1
                self.stats.encoded_tokens += len(missing) * self.encoder.config.tokens_per_image
        elif images:
            log.info("encoder cache: all %d media items of the request hit; encoder execution skipped", len(images))
        if self.profiler.enabled:
            self.stats.total_images += len(images)
            self.stats.total_image_tokens += len(images) * self.encoder.config.tokens_per_image
        return [found[image.digest] for image in images]

    def profile(self) -> dict:
        s = self.stats
        encoder_ms = self.profiler.stage_ms(VISION_ENCODER_STAGE)
        return {MULTIMODAL: {
            "total_runs": s.total_runs, "total_images": s.total_images, "total_image_tokens": s.total_image_tokens,
            "total_audios": 0, "total_audio_tokens": 0, "total_multimodal_tokens": s.total_image_tokens,
            "average_time_per_token_ms": round(encoder_ms / s.encoded_tokens, 4) if s.encoded_tokens else 0.0,
            "encoder_cache": self.cache.to_dict(),
        }}


def _resolve(path: str, base_dir: Path | None) -> Path:
    """Relative media paths resolve against the request file's directory (like adapter paths), else the cwd."""
    p = Path(path)
    return p if p.is_absolute() or base_dir is None else base_dir / p
