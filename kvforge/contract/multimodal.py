"""The encoder-dir contract (visual ONNX dir and multimodal engine dir): written by export, built, then run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.files import read_json

ENCODER_FORMAT = "kvforge-encoder-v1"
VISUAL = "visual"
AUDIO = "audio"
ENCODER_KINDS = (VISUAL, AUDIO)
ENCODER_MODEL_FILE = "model.onnx"  # in the ONNX dir
ENCODER_WEIGHTS_FILE = "model.onnx.data"
VISUAL_ENGINE_FILE = "visual.onnx"  # in the engine dir (backend onnxruntime)
VISUAL_ENGINE_WEIGHTS = "visual.onnx.data"
AUDIO_ENGINE_FILE = "audio.onnx"  # in an audio engine dir
AUDIO_ENGINE_WEIGHTS = "audio.onnx.data"
VISUAL_TRT_ENGINE_FILE = "visual.engine"  # backend tensorrt: a serialized TensorRT engine instead of the ONNX
AUDIO_TRT_ENGINE_FILE = "audio.engine"
ENCODER_INPUT = "pixel_values"  # [N, C, S, S] float32, preprocessed
ENCODER_OUTPUT = "image_embeds"  # [N, tokens_per_image, text hidden size]
RESAMPLE_FILTERS = ("lanczos", "bicubic", "bilinear", "nearest")


@dataclass(frozen=True, slots=True)
class ImagePreprocessing:
    """How a decoded RGB image becomes `pixel_values`, as the family's HF image processor does it."""

    longest_edge: int  # first resize: the longest edge to this, aspect ratio kept (Idefics3 `size`)
    image_size: int  # side of every encoder input: the global image and each tile (Idefics3 `max_image_size`)
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: str = "lanczos"
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    # Idefics3 image splitting: tiles of image_size plus the global image. Off by default so encoder dirs written
    # before the field existed keep their meaning (their images ran unsplit).
    do_image_splitting: bool = False


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """config.json of an encoder ONNX dir and of a multimodal engine dir (which adds `builder_config`)."""

    kind: str  # "visual"
    model: str  # family, e.g. "idefics3"
    image_token_id: int
    tokens_per_image: int  # placeholder tokens per image (encoder output rows)
    text_hidden_size: int  # width of each output row: the text model's hidden size
    # Text the chat template's image marker expands into: prefix + image_token × tokens_per_image + suffix.
    image_token: str
    image_prefix: str
    image_suffix: str
    preprocessing: ImagePreprocessing
    max_batch_size: int = 0  # set by llm_build: images per encoder call (0 in an ONNX dir)
    backend: str = ""  # set by llm_build
    format: str = ENCODER_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)  # family details (vision geometry) for humans

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> EncoderConfig:
        if data.get("format") != ENCODER_FORMAT:
            raise InvalidConfig(f"not a kvforge encoder dir (format {data.get('format')!r}, expected "
                                f"{ENCODER_FORMAT!r})", where)
        known = {f.name for f in fields(cls)}
        try:
            raw = {k: v for k, v in data.items() if k in known}
            pre = dict(raw.pop("preprocessing"))
            for key in ("image_mean", "image_std"):
                if key in pre:
                    pre[key] = tuple(float(v) for v in pre[key])
            config = cls(**raw, preprocessing=ImagePreprocessing(**pre))
        except (TypeError, KeyError) as exc:
            raise InvalidConfig(f"missing or invalid field ({exc})", where) from None
        config.validate(where)
        return config

    def validate(self, where: str) -> None:
        if self.kind != VISUAL:
            raise InvalidConfig(f"unsupported encoder kind {self.kind!r}; expected one of {ENCODER_KINDS}", where)
        if self.tokens_per_image <= 0 or self.text_hidden_size <= 0 or self.preprocessing.image_size <= 0:
            raise InvalidConfig("tokens_per_image, text_hidden_size and image_size must be positive", where)
        if self.preprocessing.resample not in RESAMPLE_FILTERS:
            raise InvalidConfig(f"resample must be one of {RESAMPLE_FILTERS}", where)


@dataclass(frozen=True, slots=True)
class AudioEncoderConfig:
    """config.json of an audio encoder dir: 16 kHz PCM -> log-mel frames -> one embedding row per placeholder."""

    kind: str  # "audio"
    model: str  # family, e.g. "qwen2_audio"
    audio_token_id: int
    audio_token: str  # the placeholder the processor repeats once per output row
    text_hidden_size: int
    num_mel_bins: int
    num_frames: int  # mel frames per encoder call (30 s at a 10 ms hop)
    sample_rate: int = 16000
    max_batch_size: int = 0  # set by llm_build
    backend: str = ""  # set by llm_build
    format: str = ENCODER_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> AudioEncoderConfig:
        known = {f.name for f in fields(cls)}
        try:
            config = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise InvalidConfig(f"missing or invalid field ({exc})", where) from None
        if config.kind != AUDIO or config.num_frames <= 0 or config.num_mel_bins <= 0:
            raise InvalidConfig("not an audio encoder config (kind, num_frames, num_mel_bins)", where)
        return config


def encoder_kind(path: Path) -> str:
    """The `kind` of the encoder dir at `path` ("visual", "audio"); errors name `onnx_dir`."""
    kind = read_json(path / "config.json", "onnx_dir").get("kind")
    if kind not in ENCODER_KINDS:
        raise InvalidConfig(f"unsupported encoder kind {kind!r}; expected one of {ENCODER_KINDS}", "onnx_dir")
    return kind


def is_encoder_dir(path: Path) -> bool:
    """Whether `path` holds an encoder dir (ONNX or engine) rather than a text model's."""
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        return read_json(config, "config.json").get("format") == ENCODER_FORMAT
    except Exception:  # a malformed file is reported by whoever reads it properly
        return False


def read_encoder_config(path: Path, what: str) -> EncoderConfig:
    if not path.is_dir():
        raise InvalidConfig(f"{path} is not a directory", what)
    return EncoderConfig.from_dict(read_json(path / "config.json", what), f"{path}/config.json")
