"""Qwen2-Audio parity with transformers, end to end: a WAV file and a prompt -> logits.

A tiny random Qwen2-Audio checkpoint is saved with save_pretrained, exported by llm_export's HF path (Qwen2 text
ONNX dir + audio encoder ONNX dir), built by llm_build's two paths and run through the Engine loop; the reference
is transformers' Qwen2AudioProcessor (WhisperFeatureExtractor, 128 mel bins) feeding
Qwen2AudioForConditionalGeneration. The features alone are compared too (miniaudio decode + numpy log-mel).
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
from support.backends import RecordingBackend
from support.lazy_import import LazyModule

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.encoder_build import build_encoder_engine
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.file_loop import prepare_requests
from kvforge.runtime.inputs.multimodal.audio import decode_audio, log_mel
from kvforge.runtime.inputs.request_file import parse_request_file
from kvforge.tools.export.families.qwen2_audio_source import load_qwen2_audio_dir, write_audio_onnx_dir
from kvforge.tools.export.sources.synthetic import QWEN2_AUDIO_SPECIAL_TOKENS, byte_level_tokenizer
from kvforge.tools.export.writer import write_onnx_dir

torch = LazyModule("torch", reason="transformers parity needs torch (pip install 'kvforge[dev]')")
transformers = LazyModule("transformers",
                          reason="transformers parity needs transformers (pip install 'kvforge[dev]')")
pytestmark = [pytest.mark.torch, pytest.mark.attention_path]  # run again on the fallback
TOL = 1e-4
BEFORE, AFTER = "<|im_start|>user\n", "What is it?<|im_end|>\n<|im_start|>assistant\n"


def write_wav(path: Path, seconds: float, rate: int = 22050, seed: int = 0) -> Path:
    """A tone plus noise at 22.05 kHz: decoding resamples it to 16 kHz."""
    t = np.arange(int(rate * seconds)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * np.random.default_rng(seed).standard_normal(t.size)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((x * 32767).astype("<i2").tobytes())
    return path


def _checkpoint(path: Path) -> None:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    path.mkdir()
    tok = byte_level_tokenizer()
    tok.add_special_tokens(list(QWEN2_AUDIO_SPECIAL_TOKENS))
    tok.save(str(path / "tokenizer.json"))
    config = Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                          num_mel_bins=128, max_source_positions=1500),
        text_config=dict(model_type="qwen2", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024),
        audio_token_index=tok.token_to_id("<|AUDIO|>"))
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # std-0.02 init gives flat logits; larger weights make the comparison bite
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name and name.endswith("weight")
                        else 0.1 * noise if name.endswith("bias") else 0.15 * noise)
    model.save_pretrained(path)


def test_log_mel_matches_whisper_feature_extractor(tmp_path: Path) -> None:
    from transformers import WhisperFeatureExtractor

    decoded = decode_audio(write_wav(tmp_path / "a.wav", 1.3), "audio")
    assert abs(len(decoded.pcm) - int(1.3 * 16000)) <= 1  # resampled to 16 kHz mono
    features, frames = log_mel(decoded.pcm, 128, 3000)
    reference = WhisperFeatureExtractor(feature_size=128)(decoded.pcm, sampling_rate=16000, return_tensors="np",
                                                          return_attention_mask=True, padding="max_length")
    assert np.abs(features - reference["input_features"][0]).max() < 1e-4
    assert frames == int(reference["attention_mask"].sum())


def test_qwen2_audio_file_to_logits_matches_transformers(tmp_path: Path) -> None:
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    checkpoint = tmp_path / "hf"
    _checkpoint(checkpoint)
    audio = write_wav(tmp_path / "clip.wav", 1.7, seed=3)
    loaded, encoder = load_qwen2_audio_dir(checkpoint, kv_cache_dtype="fp32")
    write_onnx_dir(loaded, tmp_path / "onnx")
    write_audio_onnx_dir(encoder, tmp_path / "onnx" / "audio")
    build_engine(tmp_path / "onnx", tmp_path / "engine",
                 BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=1, tokens_per_page=16))
    build_encoder_engine(tmp_path / "onnx" / "audio", tmp_path / "audio", "auto", 1)
    capture = RecordingBackend.load(tmp_path / "engine")
    engine = Engine(tmp_path / "engine", EngineConfig(num_threads=2, multimodal_engine_dir=str(tmp_path / "audio")),
                    backend=capture)
    request_file = parse_request_file({"apply_chat_template": False, "top_k": 1, "max_generate_length": 1,
                                       "parse_special_tokens": True,  # the text parts are raw template markup
                                       "requests": [{"messages": [{"role": "user", "content": [
                                           {"type": "text", "text": BEFORE + "<|audio_bos|>"},
                                           {"type": "audio", "audio": audio.name},
                                           {"type": "text", "text": "<|audio_eos|>" + AFTER}]}]}]})
    [prepared] = prepare_requests(engine, request_file, tmp_path)
    engine.add_request(prepared)
    while engine.has_unfinished():
        engine.step()

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    tokenizer.audio_bos_token, tokenizer.audio_token, tokenizer.audio_eos_token = QWEN2_AUDIO_SPECIAL_TOKENS
    processor = Qwen2AudioProcessor(WhisperFeatureExtractor(feature_size=128), tokenizer)
    pcm = decode_audio(audio, "audio").pcm
    inputs = processor(text=[BEFORE + "<|audio_bos|><|AUDIO|><|audio_eos|>" + AFTER], audio=[pcm],
                       sampling_rate=16000, return_tensors="pt")
    model = Qwen2AudioForConditionalGeneration.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        reference = model(**inputs).logits[0, -1].numpy()
    assert prepared.prompt_ids == inputs["input_ids"][0].tolist()  # the placeholder count is the processor's
    assert prepared.media[0].key.length == 42  # 1.7 s: 170 frames -> 85 after conv2 -> 42 after pooling
    ours = capture.logits[-1][0]  # the last call's one sampled position
    assert np.abs(ours - reference).max() <= TOL * max(1.0, np.abs(reference).max())
    assert int(np.argmax(ours)) == int(np.argmax(reference))
