"""Media items of a request -> placeholder token spans, media identity and encoder embeddings (cached per scope)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.profile_schema import MULTIMODAL
from kvforge.contract.validation import one_line, printable
from kvforge.runtime.context_cache.keys import MediaKey
from kvforge.runtime.inputs.multimodal.encoder_cache import EncoderCache, cache_scope
from kvforge.runtime.inputs.multimodal.encoder_session import FIELD
from kvforge.runtime.inputs.tokenizer import ChatTokenizer, RenderedPrompt
from kvforge.runtime.media_spans import MediaSpan
from kvforge.runtime.profile import Profiler
from kvforge.runtime.types import MEDIA_SENTINEL, MediaRef

VISION_ENCODER_STAGE = "vision_encoder"
AUDIO_ENCODER_STAGE = "audio_encoder"
log = logging.getLogger("kvforge.multimodal")


@dataclass(slots=True)
class MultimodalStats:
    """The profile's `multimodal` block (the seed's totals)."""

    total_runs: int = 0  # encoder calls
    total_images: int = 0  # images in requests (cache hits included)
    total_image_tokens: int = 0
    total_audios: int = 0
    total_audio_tokens: int = 0
    encoded_tokens: int = 0  # placeholder rows the encoder computed (for the per-token time)


class MultimodalProcessor:
    """Owns the encoder engine and its cache; InputProcessor hands it prompts holding media sentinels.

    Shared state `tokenize` touches, for running it off the engine thread: the encoder cache (its own lock),
    `_expansions`, `stats` and the profiler's encoder stage (all under `_lock`, see `_record`), and the encoder
    session (one call at a time, `_encoder_lock`: a TensorRT session has one execution context and its buffers).
    Decoding (Pillow, miniaudio) touches none of it. The profiler is also written by the engine thread without
    `_lock`: a caller moving `tokenize` to a worker must make Profiler.record safe for that (or hand the stage
    time back to the engine thread)."""

    __slots__ = ("encoder", "cache", "tokenizer", "profiler", "stats", "_expansions", "_lock", "_encoder_lock")

    def __init__(self, encoder, cache: EncoderCache, tokenizer: ChatTokenizer, profiler: Profiler,
                 text_hidden_size: int) -> None:  # encoder: VisualEncoder | AudioEncoder
        if encoder.config.text_hidden_size != text_hidden_size:
            raise InvalidConfig(f"the encoder outputs {encoder.config.text_hidden_size}-wide rows but the text "
                                f"engine's hidden size is {text_hidden_size}; export both from one checkpoint", FIELD)
        self.encoder, self.cache, self.tokenizer, self.profiler = encoder, cache, tokenizer, profiler
        self.stats = MultimodalStats()
        self._expansions: dict[object, tuple[list[int], np.ndarray]] = {}  # layout -> (ids, placeholder positions)
        self._lock = threading.Lock()  # _expansions, stats and the profiler record (see the class docstring)
        self._encoder_lock = threading.Lock()  # one encoder session call at a time
        if tokenizer.tokenizer.encode(encoder.marker, add_special_tokens=False).ids != [encoder.token_id]:
            raise InvalidConfig(f"the text engine's tokenizer does not turn {encoder.marker!r} into the encoder's "
                                f"token id {encoder.token_id}; are the two dirs from one checkpoint?", FIELD)

    @property
    def image_token_id(self) -> int:
        return self.encoder.token_id

    def expansion(self, layout) -> tuple[list[int], np.ndarray]:
        """Token ids of one item's placeholder text (`layout` is what the text depends on: a row count, an image's
        tile grid) and the positions of its placeholder tokens in them, in order."""
        with self._lock:
            cached = self._expansions.get(layout)
        if cached is None:  # two threads may both tokenize a new layout: same result, the last one is kept
            ids = self.tokenizer.tokenizer.encode(self.encoder.placeholder_text(layout), add_special_tokens=False).ids
            positions = np.flatnonzero(np.asarray(ids) == self.encoder.token_id)
            positions.setflags(write=False)
            cached = (ids, positions)
            with self._lock:
                self._expansions[layout] = cached
        return cached

    def check_kinds(self, media: list[MediaRef]) -> None:
        """Every item must be of this engine's kind; checked before the chat template sees the request."""
        for ref in media:
            if ref.kind != self.encoder.kind:
                raise KvforgeError(f'"{ref.kind}" items need an {ref.kind} encoder; this multimodal engine has an '
                                   f"{self.encoder.kind} one", f"{ref.where}.type")

    def tokenize(self, text: str, media: list[MediaRef], base_dir: Path | None, max_input_len: int,
                 where: str, plain: RenderedPrompt | None = None,
                 cache_salt: str | None = None) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """Token ids of a rendered prompt whose media sentinels become placeholder spans, and those spans with
        their embeddings. Every error is one line naming the media item (or `where` for the prompt).
        `plain`: the formatted prompt with its content spans, kept plain text (None: special-token text is parsed).
        `cache_salt`: the request's; encoder outputs are cached per salt (encoder_cache.cache_scope), while the
        media identity in the spans (and so in the page keys) is the digest alone, the salt being keyed there."""
        segments = text.split(MEDIA_SENTINEL)
        if len(segments) - 1 != len(media):
            raise KvforgeError(f"the chat template kept {len(segments) - 1} of the request's {len(media)} media "
                               "items (it dropped a message holding one)", where)
        pieces = self.tokenizer.encode_chat_segments(segments, plain, where)
        ids = pieces[0]
        placed = []
        self.check_kinds(media)
        for ref, segment_ids in zip(media, pieces[1:], strict=True):
            item = self.encoder.decode(media_source(ref, base_dir), ref.media_field)
            rows = self.encoder.rows(item)
            if rows < 1:
                raise KvforgeError(f"this {ref.kind} is too short to give the encoder a single output row",
                                   ref.media_field)
            expansion, positions = self.expansion(self.encoder.layout(item))
            if len(positions) != rows:
                raise InvalidConfig(f"the text engine's tokenizer turns {len(positions)} of this {ref.kind}'s "
                                    f"{rows} placeholders into the encoder's token id {self.encoder.token_id} "
                                    f"({self.encoder.marker!r}); are the two dirs from one checkpoint?", FIELD)
            start = len(ids) + int(positions[0])
            ids += expansion
            if len(ids) > max_input_len:
                raise KvforgeError(f"this {ref.kind} brings the prompt to at least {len(ids)} tokens, more than the "
                                   f"engine's maxInputLen {max_input_len} (it takes {len(expansion)}); send fewer "
                                   "media items or rebuild with a larger --maxInputLen", ref.where)
            ids += segment_ids
            placed.append((start, positions, item))
        if ids.count(self.encoder.token_id) != sum(len(positions) for _, positions, _ in placed):
            raise KvforgeError(f"the prompt text contains the placeholder {self.encoder.marker!r}; send media as "
                               "content items", where)
        embeds = self._embeddings([item for _, _, item in placed], cache_scope(cache_salt))
        return ids, tuple(_media_span(start, positions, item.digest, rows)
                          for (start, positions, item), rows in zip(placed, embeds, strict=True))

    def _embeddings(self, items: list, scope: bytes) -> list[np.ndarray]:
        """Encoder rows per item: cache hits (in `scope`) as they are, misses encoded together (duplicates once)."""
        found: dict[bytes, np.ndarray] = {}
        missing: dict[bytes, object] = {}
        for item in items:
            if item.digest in found or item.digest in missing:
                continue
            cached = self.cache.get(item.digest, scope)
            if cached is None:
                missing[item.digest] = item
            else:
                found[item.digest] = cached
        encoder_ms = None
        if missing:
            with self._encoder_lock:  # timed inside: the stage is the encoder's work, not the wait for it
                start = time.perf_counter_ns()
                outputs = self.encoder.encode(list(missing.values()))
                encoder_ms = (time.perf_counter_ns() - start) / 1e6
            for digest, rows in zip(missing, outputs, strict=True):
                rows = np.ascontiguousarray(rows)
                self.cache.put(digest, rows, scope)
                rows.setflags(write=False)
                found[digest] = rows
        elif items:
            log.info("encoder cache: all %d media items of the request hit; encoder execution skipped", len(items))
        self._record(encoder_ms, sum(len(found[d]) for d in missing), sum(len(found[item.digest]) for item in items),
                     len(items))
        return [found[item.digest] for item in items]

    def _record(self, encoder_ms: float | None, encoded_tokens: int, tokens: int, count: int) -> None:
        """The profile's share of one request: the encoder stage (when it ran) and the multimodal totals."""
        with self._lock:
            if not self.profiler.enabled:
                return
            if encoder_ms is not None:
                self.profiler.record(self.encoder.stage, encoder_ms)
                self.stats.total_runs += 1
                self.stats.encoded_tokens += encoded_tokens
            if self.encoder.kind == "audio":
                self.stats.total_audios += count
                self.stats.total_audio_tokens += tokens
            else:
                self.stats.total_images += count
                self.stats.total_image_tokens += tokens

    def profile(self) -> dict:
        with self._lock:  # one consistent snapshot of the totals and the stage time they are averaged over
            s = replace(self.stats)
            encoder_ms = self.profiler.stage_ms(self.encoder.stage)
        return {MULTIMODAL: {
            "total_runs": s.total_runs, "total_images": s.total_images, "total_image_tokens": s.total_image_tokens,
            "total_audios": s.total_audios, "total_audio_tokens": s.total_audio_tokens,
            "total_multimodal_tokens": s.total_image_tokens + s.total_audio_tokens,
            "average_time_per_token_ms": round(encoder_ms / s.encoded_tokens, 4) if s.encoded_tokens else 0.0,
            "encoder_cache": self.cache.to_dict(),
        }}


def _media_span(start: int, positions: np.ndarray, digest: bytes, rows: np.ndarray) -> MediaSpan:
    """The span from an item's first placeholder to its last (a split image's tile markers included: the reuse
    point never lands between its tiles, and its identity covers them), its rows placed at its placeholders."""
    offsets = positions - positions[0]
    contiguous = int(offsets[-1]) + 1 == len(offsets)
    return MediaSpan(MediaKey(start, int(offsets[-1]) + 1, digest), rows, None if contiguous else offsets)


def media_source(ref: MediaRef, base_dir: Path | None) -> Path | bytes:
    """What the encoder decodes: the bytes sent inline (llm_serve), else the item's file, checked to be one the
    os calls of the decoders can take (request_checks.check_media_path ran on the path as given; joined to the
    request file's dir it can still be too long, or unreadable: a one-line error, not an escaping OSError)."""
    if ref.data is not None:
        return ref.data
    path = _resolve(ref.path, base_dir)
    try:
        path.is_file()  # False for a missing file (the decoder says so); raises for what the decoder could not say
    except (OSError, ValueError) as exc:
        raise KvforgeError(f"cannot read {ref.kind} file {printable(str(path))}: "
                           f"{one_line(getattr(exc, 'strerror', None) or str(exc))}", ref.media_field) from None
    return path


def _resolve(path: str, base_dir: Path | None) -> Path:
    """Relative media paths resolve against the request file's directory (like adapter paths), else the cwd."""
    p = Path(path)
    return p if p.is_absolute() or base_dir is None else base_dir / p
