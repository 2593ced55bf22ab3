"""Decode an audio file to 16 kHz mono PCM (miniaudio) and compute Whisper log-mel features in numpy (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.inputs.multimodal.image import media_digest

SAMPLE_RATE = 16000
N_FFT, HOP = 400, 160
SUPPORTED_AUDIO = (".wav", ".mp3", ".flac")
MEL_SUFFIX = ".safetensors"  # precomputed features: the seed's mel path
# Audio is bounded by what the encoder takes: one window of num_frames mel frames per item (Qwen2-Audio: 3000
# frames of 10 ms, WhisperFeatureExtractor's 30 s chunk), so every sample past it would be decoded only to be
# dropped (transformers truncates there silently; here the request is told). One window, not several: the
# encoder engine has one window per item, and its 750 rows already take most of a typical maxInputLen. The
# duration is read from the header first (a 1-hour WAV was decoded to 230 MB of PCM before being cut to 30 s),
# then decoding streams in chunks and stops past the bound, for headers that understate their length.
DEFAULT_MAX_AUDIO_SECONDS = 30.0  # when no encoder says (Qwen2-Audio's window)
DECODE_CHUNK_FRAMES = 16384
_RESAMPLE_SLACK = HOP  # a resampled stream may hold a few samples more than its header's duration


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    pcm: np.ndarray  # [samples] float32 mono at 16 kHz
    digest: bytes  # media identity over the PCM samples (with shape and dtype)


@dataclass(frozen=True, slots=True)
class MelFeatures:
    """A precomputed `.safetensors` item: Whisper log-mel frames padded to the window, and how many hold audio."""

    features: np.ndarray  # [mel bins, window frames] float32
    frames: int
    digest: bytes  # media identity over the feature tensor (with shape and dtype) and the valid frame count


def load_mel(path: Path, num_mel_bins: int, num_frames: int, where: str) -> MelFeatures:
    """`input_features` [(1,) mel bins, window frames] and `feature_attention_mask` [(1,) window frames], as
    Qwen2AudioProcessor / WhisperFeatureExtractor return them (saved with safetensors)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not path.is_file():
        raise KvforgeError(f"audio file not found: {path}", where)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise KvforgeError(f"cannot read mel features from {path}: {exc}", where) from None
    features, mask = tensors.get("input_features"), tensors.get("feature_attention_mask")
    if features is None or mask is None:
        raise KvforgeError(f"{path} must hold input_features and feature_attention_mask tensors", where)
    features = np.asarray(features, dtype=np.float32).reshape(features.shape[-2:]) if features.ndim == 3 \
        else np.asarray(features, dtype=np.float32)
    if features.shape != (num_mel_bins, num_frames) or mask.size != num_frames:
        raise KvforgeError(f"input_features must be [{num_mel_bins}, {num_frames}] and feature_attention_mask "
                           f"[{num_frames}] for this encoder, got {list(features.shape)} and {list(mask.shape)}",
                           where)
    frames = int(np.count_nonzero(mask))
    digest = media_digest(np.concatenate([features.reshape(-1), np.array([frames], dtype=np.float32)]))
    return MelFeatures(np.ascontiguousarray(features), frames, digest)


def decode_audio(path: Path, where: str, max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS) -> DecodedAudio:
    """An audio file (WAV, MP3, FLAC) as 16 kHz mono PCM, refused from its header when longer than `max_seconds`
    (before any sample is decoded) and while decoding past it."""
    import miniaudio

    if not path.is_file():
        raise KvforgeError(f"audio file not found: {path}", where)
    if path.suffix.lower() not in SUPPORTED_AUDIO:
        raise KvforgeError(f"unsupported audio format {path.suffix or '(no extension)'}; supported: "
                           f"{', '.join(SUPPORTED_AUDIO)}, or {MEL_SUFFIX} log-mel features", where)
    try:
        _check_duration(miniaudio.get_file_info(str(path)), max_seconds, where)
        stream = miniaudio.stream_file(str(path), output_format=miniaudio.SampleFormat.FLOAT32, nchannels=1,
                                       sample_rate=SAMPLE_RATE, frames_to_read=DECODE_CHUNK_FRAMES)
        pcm = read_stream(stream, max_seconds, where)
    except miniaudio.DecodeError as exc:
        raise KvforgeError(f"cannot decode audio {path}: {exc}", where) from None
    if pcm.size == 0:
        raise KvforgeError(f"{path} holds no audio samples", where)
    return DecodedAudio(pcm, media_digest(pcm))


def decode_audio_bytes(data: bytes, where: str, max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS) -> DecodedAudio:
    """decode_audio for bytes sent inline (WAV, MP3 or FLAC, told apart by miniaudio from their headers), with the
    same bounds. Samples equal decode_audio's, so the same sound sent inline or by path has one identity."""
    import miniaudio

    try:
        _check_duration(_memory_info(data), max_seconds, where)
        stream = miniaudio.stream_memory(data, output_format=miniaudio.SampleFormat.FLOAT32, nchannels=1,
                                         sample_rate=SAMPLE_RATE, frames_to_read=DECODE_CHUNK_FRAMES)
        pcm = read_stream(stream, max_seconds, where)
    except miniaudio.DecodeError as exc:
        raise KvforgeError(f"cannot decode the audio (WAV, MP3 or FLAC): {exc}", where) from None
    if pcm.size == 0:
        raise KvforgeError("the audio holds no samples", where)
    return DecodedAudio(pcm, media_digest(pcm))


def _memory_info(data: bytes):  # -> miniaudio.SoundFileInfo
    """The header of inline audio, by its magic bytes as miniaudio's own detection goes (else MP3, which has
    none fixed: an ID3 tag or a frame sync)."""
    import miniaudio

    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return miniaudio.wav_get_info(data)
    if data[:4] == b"fLaC":
        return miniaudio.flac_get_info(data)
    return miniaudio.mp3_get_info(data)


def _check_duration(info, max_seconds: float, where: str) -> None:  # info: miniaudio.SoundFileInfo
    if info.sample_rate > 0 and info.num_frames / info.sample_rate > max_seconds:
        raise KvforgeError(f"the audio is {info.num_frames / info.sample_rate:.1f} s long, longer than the "
                           f"{max_seconds:g} s this encoder takes (cut it, or send it in parts)", where)


def read_stream(stream, max_seconds: float, where: str) -> np.ndarray:  # stream: miniaudio's chunk generator
    """Decoded chunks concatenated, stopping once they pass `max_seconds` (a header that understated)."""
    limit = int(max_seconds * SAMPLE_RATE) + _RESAMPLE_SLACK
    chunks, total = [], 0
    for chunk in stream:
        chunks.append(np.frombuffer(chunk, dtype=np.float32).copy())
        total += len(chunks[-1])
        if total > limit:
            stream.close()
            raise KvforgeError(f"the audio is longer than the {max_seconds:g} s this encoder takes (cut it, or "
                               "send it in parts)", where)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


def mel_filter_bank(num_mels: int, sampling_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """[n_fft/2 + 1, num_mels] triangular filters on the Slaney mel scale with Slaney area normalisation,
    0-8 kHz (the filters WhisperFeatureExtractor uses)."""
    def hz_to_mel(hz: np.ndarray) -> np.ndarray:
        hz = np.asarray(hz, dtype=np.float64)
        mel = 3.0 * hz / 200.0
        log_region = hz >= 1000.0
        return np.where(log_region, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * 27.0 / np.log(6.4), mel)

    def mel_to_hz(mel: np.ndarray) -> np.ndarray:
        hz = 200.0 * mel / 3.0
        return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), hz)

    fft_freqs = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), num_mels + 2))
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges[2:num_mels + 2] - edges[:num_mels]))


def log_mel(pcm: np.ndarray, num_mels: int, num_frames: int) -> tuple[np.ndarray, int]:
    """Whisper features of `pcm` zero-padded (or cut) to num_frames × HOP samples: [num_mels, num_frames] float32,
    and the number of frames that hold audio (what transformers' feature_attention_mask sums to)."""
    samples = num_frames * HOP
    valid = min(len(pcm), samples)
    padded = np.zeros(samples, dtype=np.float64)
    padded[:valid] = pcm[:valid]
    framed = np.pad(padded, N_FFT // 2, mode="reflect")  # centred frames
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    count = 1 + (len(framed) - N_FFT) // HOP
    index = np.arange(N_FFT)[None, :] + HOP * np.arange(count)[:, None]
    power = np.abs(np.fft.rfft(framed[index] * window, axis=1)) ** 2  # [frames, bins]
    mel = np.maximum(mel_filter_bank(num_mels).T @ power.T, 1e-10)
    spec = np.log10(mel)[:, :-1]
    spec = np.maximum(spec, spec.max() - 8.0)
    return ((spec + 4.0) / 4.0).astype(np.float32), -(-valid // HOP)


class AudioEncoder:
    """A Whisper-style audio engine: 30 s of log-mel frames per call; each item keeps the rows of its own frames."""

    __slots__ = ("config", "session")
    kind = "audio"
    stage = "audio_encoder"

    def __init__(self, engine_dir: Path, config, num_threads: int = 0) -> None:  # config: AudioEncoderConfig
        from kvforge.contract.multimodal import AUDIO_ENGINE_FILE, AUDIO_TRT_ENGINE_FILE
        from kvforge.runtime.inputs.multimodal.encoder_session import encoder_session

        self.config = config
        self.session = encoder_session(engine_dir, config, AUDIO_ENGINE_FILE, AUDIO_TRT_ENGINE_FILE, num_threads)

    @property
    def token_id(self) -> int:
        return self.config.audio_token_id

    @property
    def marker(self) -> str:
        return self.config.audio_token

    def layout(self, item: DecodedAudio | MelFeatures) -> int:
        """What the placeholder text depends on: the row count alone."""
        return self.rows(item)

    def placeholder_text(self, rows: int) -> str:
        return self.config.audio_token * rows

    @property
    def max_seconds(self) -> float:
        """The audio one item may hold: the encoder's window (see DEFAULT_MAX_AUDIO_SECONDS)."""
        return self.config.num_frames * HOP / SAMPLE_RATE

    def decode(self, source: Path | bytes, where: str) -> DecodedAudio | MelFeatures:
        if isinstance(source, bytes):
            return decode_audio_bytes(source, where, self.max_seconds)
        path = source
        if path.suffix.lower() == MEL_SUFFIX:
            return load_mel(path, self.config.num_mel_bins, self.config.num_frames, where)
        return decode_audio(path, where, self.max_seconds)

    def rows(self, item: DecodedAudio | MelFeatures) -> int:
        if isinstance(item, MelFeatures):
            return frame_rows(item.frames)
        return audio_rows(min(len(item.pcm), self.config.num_frames * HOP))

    def encode(self, items: list[DecodedAudio | MelFeatures]) -> list[np.ndarray]:
        outputs = []
        for item in items:  # one call per item: each is padded to the full 30 s window anyway
            if isinstance(item, MelFeatures):
                features, frames = item.features, item.frames
            else:
                features, frames = log_mel(item.pcm, self.config.num_mel_bins, self.config.num_frames)
            rows = self.session.run(["audio_embeds"], {"input_features": features[None],
                                                       "feature_lengths": np.array([frames], dtype=np.int64)})[0]
            outputs.append(np.ascontiguousarray(rows[0, :self.rows(item)], dtype=np.float32))
        return outputs


def audio_rows(num_samples: int) -> int:
    """Placeholder rows for `num_samples` PCM samples (valid mel frames, halved by conv2, halved by pooling)."""
    return frame_rows(-(-num_samples // HOP))


def frame_rows(frames: int) -> int:
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1
