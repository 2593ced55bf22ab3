"""Decode an image file with Pillow and preprocess it as the family's HF image processor does (no torch)."""

from __future__ import annotations

import hashlib
import io
import math
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from kvforge.contract.errors import KvforgeError
from kvforge.contract.multimodal import ImagePreprocessing

_FILTERS = {"lanczos": Image.Resampling.LANCZOS, "bicubic": Image.Resampling.BICUBIC,
            "bilinear": Image.Resampling.BILINEAR, "nearest": Image.Resampling.NEAREST}
# transformers' cap on any side after the first resize (Idefics3 MAX_IMAGE_SIZE)
MAX_IMAGE_SIDE = 4096
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")


@dataclass(frozen=True, slots=True)
class DecodedImage:
    pixels: np.ndarray  # [H, W, 3] uint8 RGB, as decoded (before any resize)
    digest: bytes  # media identity: BLAKE2b-128 over shape, dtype and pixel bytes


def media_digest(array: np.ndarray) -> bytes:
    """Identity of decoded media: the same bytes under another shape or dtype get another digest."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kvforge-media-v1")
    h.update(struct.pack("<Q", array.ndim) + struct.pack(f"<{array.ndim}Q", *array.shape))
    h.update(array.dtype.str.encode("ascii"))
    h.update(np.ascontiguousarray(array).tobytes())
    return h.digest()


# Images are bounded from their header, before their pixels are decoded (Pillow's open reads the header only):
# - pixels: 40 Mpx is 120 MB of RGB (and about 5x that through the RGBA composite of convert_to_rgb), and a small
#   compressed file cannot claim more. A lower Image.MAX_IMAGE_PIXELS set by the host application is respected.
# - the longest edge: at most MAX_EDGE_FACTOR x the edge the family's processor resizes to (`longest_edge`, or
#   transformers' MAX_IMAGE_SIDE without resizing). Resizing costs Pillow filter coefficients per output pixel
#   and per source pixel under it, about 48 bytes per source pixel of the edge: a 1 x 39 M PNG of 38 KB took 9 s
#   and 1.8 GB to resize to 1456 x 1, all of it averaged away. At 16x the target, every photo, scan or panorama
#   that fits the pixel bound at an aspect ratio up to about 13:1 (Idefics3's 1456) or 26:1 (SmolVLM's 2048)
#   still decodes, and the resize of the longest allowed edge needs about 1.5 MB of coefficients.
MAX_IMAGE_PIXELS = 40_000_000
MAX_EDGE_FACTOR = 16
# Pillow warns (once, to stderr) for images between its MAX_IMAGE_PIXELS and twice that, and raises past it: both
# are far past the bound above, so the warning is made the error Pillow's documentation advises for untrusted
# input. A filter, not warnings.catch_warnings() around open: that swaps the process-wide filters and is unsafe
# once media are decoded on several threads.
warnings.filterwarnings("error", category=Image.DecompressionBombWarning)


def max_image_edge(pre: ImagePreprocessing | None) -> int:
    """The longest image edge decoded for a processor (None: no family, transformers' side cap)."""
    target = pre.longest_edge if pre is not None and pre.do_resize else MAX_IMAGE_SIDE
    return MAX_EDGE_FACTOR * target


def max_image_pixels() -> int:
    host = Image.MAX_IMAGE_PIXELS  # None: the host application switched Pillow's own bound off; ours still holds
    return MAX_IMAGE_PIXELS if host is None else min(MAX_IMAGE_PIXELS, int(host))


def decode_image(source: Path | bytes, where: str, pre: ImagePreprocessing | None = None) -> DecodedImage:
    """Pillow decode to RGB (transparent pixels composited onto white, as transformers' convert_to_rgb does) of a
    file or of bytes sent inline (llm_serve): the same formats, bounds and identity, so an image sent inline and
    the same file given by path share their encoder-cache entry and page keys. `pre`: the processor the image is
    for, which bounds its longest edge (see MAX_EDGE_FACTOR); the size is checked before any pixel is decoded."""
    name = str(source) if isinstance(source, Path) else "the data"
    if isinstance(source, Path) and not source.is_file():
        raise KvforgeError(f"image file not found: {source}", where)
    try:
        with Image.open(source if isinstance(source, Path) else io.BytesIO(source)) as image:
            if image.format not in SUPPORTED_FORMATS:
                raise KvforgeError(f"unsupported image format {image.format} in {name}; supported: "
                                   f"{', '.join(SUPPORTED_FORMATS)}", where)
            _check_size(image.width, image.height, pre, where)
            image.load()
            rgb = _to_rgb(image)
    except UnidentifiedImageError:
        raise KvforgeError(f"{name} is not an image Pillow can decode (supported: "
                           f"{', '.join(SUPPORTED_FORMATS)})", where) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # its header claims > 89 Mpx
        raise KvforgeError(f"the image is refused before decoding: {exc}", where) from None
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt data
        raise KvforgeError(f"cannot decode image {name}: {exc}", where) from None
    pixels = np.asarray(rgb, dtype=np.uint8)
    return DecodedImage(pixels, media_digest(pixels))


def _check_size(width: int, height: int, pre: ImagePreprocessing | None, where: str) -> None:
    pixels, edge = max_image_pixels(), max_image_edge(pre)
    if width * height > pixels:
        raise KvforgeError(f"the image is {width}x{height} pixels, more than the {pixels:,} kvforge decodes", where)
    if max(width, height) > edge:
        target = f"{pre.longest_edge}-pixel" if pre is not None and pre.do_resize else f"{MAX_IMAGE_SIDE}-pixel"
        raise KvforgeError(f"the image is {width}x{height} pixels; an edge longer than {edge:,} ({MAX_EDGE_FACTOR}x "
                           f"the {target} edge this encoder resizes to) is refused before decoding", where)


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


@dataclass(frozen=True, slots=True)
class TileGrid:
    """How Idefics3 splits one image: `rows` x `cols` tiles of image_size, then the global image; 0 x 0 means
    the global image alone (splitting off, or an image no larger than one tile)."""

    rows: int
    cols: int

    @property
    def frames(self) -> int:
        """Encoder inputs of the image: its tiles plus the global image."""
        return self.rows * self.cols + 1


def idefics3_tile_grid(height: int, width: int, pre: ImagePreprocessing) -> TileGrid:
    """The split Idefics3ImageProcessor makes of a height x width image, from the shape alone (no pixels touched),
    so a request's prompt is laid out before (or, on an encoder-cache hit, without) preprocessing."""
    if not pre.do_image_splitting:
        return TileGrid(0, 0)
    if pre.do_resize:
        height, width = _longest_edge_size(height, width, pre.longest_edge)
    height, width = _tile_multiple_size(height, width, pre.image_size)
    if height <= pre.image_size and width <= pre.image_size:
        return TileGrid(0, 0)
    return TileGrid(height // pre.image_size, width // pre.image_size)


def idefics3_pixel_values(pixels: np.ndarray, pre: ImagePreprocessing) -> np.ndarray:
    """[frames, 3, S, S] float32 as Idefics3ImageProcessor makes them: the longest edge to `longest_edge` (aspect
    kept, the other side even); with splitting, resized again so both sides are multiples of S and cut into
    row-major S x S tiles followed by the whole image squeezed to S x S; without, that square alone. Every resize
    runs on the previous one's uint8 result, as there. Then rescale and normalize."""
    image = Image.fromarray(pixels)
    resample = _FILTERS[pre.resample]
    size = pre.image_size
    if pre.do_resize:
        height, width = _longest_edge_size(image.height, image.width, pre.longest_edge)
        image = image.resize((width, height), resample=resample)
    frames = []
    if pre.do_image_splitting:
        height, width = _tile_multiple_size(image.height, image.width, size)
        image = image.resize((width, height), resample=resample)
        if height > size or width > size:
            tiles = np.asarray(image)
            frames = [tiles[r:r + size, c:c + size] for r in range(0, height, size) for c in range(0, width, size)]
    frames.append(np.asarray(image.resize((size, size), resample=resample)))
    array = np.stack(frames).astype(np.float32).transpose(0, 3, 1, 2)
    if pre.do_rescale:
        array = array * np.float32(pre.rescale_factor)
    if pre.do_normalize:
        mean = np.asarray(pre.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(pre.image_std, dtype=np.float32)[:, None, None]
        array = (array - mean) / std
    return np.ascontiguousarray(array, dtype=np.float32)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder sizes: the longer side rounded up to a multiple of the tile, the
    other side scaled by the aspect ratio from that and rounded up too (int truncation in between, as there)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _longest_edge_size(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers' _resize_output_size_rescale_to_max_len then _scale_below_upper_bound (MAX_IMAGE_SIDE)."""
    aspect = width / height
    if width >= height:
        width, height = max_len, int(max_len / aspect)
        height += height % 2
    else:
        height, width = max_len, int(max_len * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIDE:
        width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / aspect)
    elif height > width and height > MAX_IMAGE_SIDE:
        height, width = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * aspect)
    return max(height, 1), max(width, 1)
