"""OpenAI media content parts → MediaRefs holding their bytes: data URLs and base64 audio, local files only under
--allowedMediaDir, never a network fetch; every item's bytes bounded before they are decoded.

The bytes are decoded (Pillow, miniaudio) by the same runtime code as request-file items, on the engine thread
when the request is tokenized, so an image sent inline and the same file given by path share one identity.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from kvforge.contract.validation import check_choice, check_string, fail, json_kind, one_line, printable
from kvforge.runtime.inputs.checks import MediaItemParser, check_media_path
from kvforge.runtime.types import MediaRef

MAX_MEDIA_ITEM_BYTES = 20 * 2**20  # per item as sent (OpenAI's own per-image limit); decoding has its own bounds
AUDIO_FORMATS = ("wav", "mp3", "flac")
IMAGE_DETAILS = ("auto", "low", "high")  # accepted and ignored: the family's processor fixes the resolution
AUDIO_SUFFIXES = (".wav", ".mp3", ".flac")


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Where media may come from: inline always; local files only under `allowed_dir` (resolved, symlinks too)."""

    allowed_dir: Path | None = None
    max_item_bytes: int = MAX_MEDIA_ITEM_BYTES

    def parsers(self) -> dict[str, MediaItemParser]:
        """Content types → parsers, for request_file's message parser; `image`/`audio` file items are the request
        file's own form, held to the same local-file rule."""
        return {"image_url": self.image_url, "input_audio": self.input_audio, "image": self.file_item,
                "audio": self.file_item}

    def image_url(self, item: dict[str, Any], where: str) -> MediaRef:
        """`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (or a file:// URL / path)."""
        field = f"{where}.image_url"
        value = _object(item, "image_url", where)
        url = check_string(_required(value, "url", field), f"{field}.url")
        if "detail" in value:
            check_choice(value["detail"], f"{field}.detail", IMAGE_DETAILS)
        scheme = urlsplit(url).scheme.lower() if ":" in url[:12] else ""
        if scheme == "data":
            return MediaRef("image", "an inline image", where, data=self._data_url(url, field), key="image_url")
        if scheme in ("http", "https"):
            fail(field, "http(s) URLs are not fetched (this server makes no network requests); send the image "
                        "inline as a data:image/...;base64 URL")
        if scheme == "file":
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost"):
                fail(field, f"file URLs must name a local file (file:///path), got host {one_line(parts.netloc)!r}")
            return self._local(unquote(parts.path), "image", where, "image_url")
        if scheme and len(scheme) > 1:  # a Windows drive letter is a path, not a scheme
            fail(field, f"unsupported URL scheme {one_line(scheme)!r}; send a data:image/...;base64 URL")
        return self._local(url, "image", where, "image_url")

    def input_audio(self, item: dict[str, Any], where: str) -> MediaRef:
        """`{"type": "input_audio", "input_audio": {"data": base64, "format": "wav" | "mp3" | "flac"}}`."""
        field = f"{where}.input_audio"
        value = _object(item, "input_audio", where)
        audio_format = check_choice(_required(value, "format", field), f"{field}.format", AUDIO_FORMATS)
        data = self._base64(check_string(_required(value, "data", field), f"{field}.data"), f"{field}.data")
        return MediaRef("audio", f"inline {audio_format} audio", where, data=data, key="input_audio")

    def file_item(self, item: dict[str, Any], where: str) -> MediaRef:
        kind = item["type"]
        path = check_string(_required(item, kind, where), f"{where}.{kind}")
        return self._local(path, kind, where, kind)

    def _data_url(self, url: str, field: str) -> bytes:
        header, sep, payload = url[len("data:"):].partition(",")
        if not sep:
            fail(field, "is not a data URL (data:image/png;base64,...: no comma)")
        media_type, *params = header.split(";")
        if "base64" not in params:
            fail(field, "data URLs must be base64-encoded (data:image/png;base64,...)")
        if media_type and not media_type.lower().startswith("image/"):
            fail(field, f"holds {one_line(media_type)!r} data, expected an image/* type")
        return self._base64(payload, field)

    def _base64(self, text: str, field: str) -> bytes:
        if len(text) > (self.max_item_bytes + 2) // 3 * 4 + 4:  # refused before decoding
            fail(field, f"is more than {self.max_item_bytes:,} bytes of media")
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            fail(field, "is not valid base64")
        if not data:
            fail(field, "holds no data")
        if len(data) > self.max_item_bytes:
            fail(field, f"is more than {self.max_item_bytes:,} bytes of media")
        return data

    def _local(self, path: str, kind: str, where: str, key: str) -> MediaRef:
        """A file under --allowedMediaDir (relative paths resolve against it), read here with its size bounded."""
        field = f"{where}.{key}"
        if self.allowed_dir is None:
            fail(field, "local files are not served unless llm_serve was started with --allowedMediaDir; send the "
                        "media inline (a data: URL or input_audio)")
        check_media_path(path, field)  # a NUL (a file URL's %00 too) or an over-long name: refused before any os call
        shown = printable(path)
        try:  # resolve() and exists() raise too (ELOOP, ENAMETOOLONG once joined to the dir): all one-line errors
            resolved = (self.allowed_dir / path).resolve()  # an absolute path replaces the base
            if not resolved.is_relative_to(self.allowed_dir):
                fail(field, f"{shown} is outside --allowedMediaDir")
            if resolved.exists() and not resolved.is_file():  # a FIFO or device would block or never end
                fail(field, f"{shown} is not a regular file")
            if kind == "audio" and resolved.suffix.lower() not in AUDIO_SUFFIXES:
                fail(field, f"unsupported audio file {shown}; supported: {', '.join(AUDIO_SUFFIXES)}")
            with open(resolved, "rb") as handle:
                data = handle.read(self.max_item_bytes + 1)
        except FileNotFoundError:
            fail(field, f"{kind} file not found: {shown}")
        except IsADirectoryError:
            fail(field, f"{shown} is a directory, expected a {kind} file")
        except (OSError, ValueError) as exc:
            fail(field, f"cannot read {shown}: {one_line(getattr(exc, 'strerror', None) or str(exc))}")
        if len(data) > self.max_item_bytes:
            fail(field, f"{shown} is more than {self.max_item_bytes:,} bytes")
        return MediaRef(kind, path, where, data=data, key=key)


def media_policy(allowed_dir: Path | None) -> MediaPolicy:
    """The policy of --allowedMediaDir (None: inline media only); the dir must exist."""
    if allowed_dir is None:
        return MediaPolicy()
    resolved = allowed_dir.resolve()
    if not resolved.is_dir():
        fail("allowed_media_dir", f"{one_line(str(allowed_dir))} is not a directory")
    return MediaPolicy(resolved)


def _object(item: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = _required(item, key, where)
    if not isinstance(value, dict):
        fail(f"{where}.{key}", f"must be an object, got {json_kind(value)}")
    return value


def _required(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj or obj[key] is None:
        fail(f"{where}.{key}", "is required")
    return obj[key]
