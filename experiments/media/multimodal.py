"""Images or audio: TTFT cold vs warm (same item, new question), encoder time saved per cache hit, KV bytes per item.

Runs random-weight models (weights do not change the cost): images with SmolVLM-256M's shapes (SmolLM2-135M
text model, SigLIP-B/16 vision tower at 512 px tiles, 64 tokens per tile; `--tiny` for the 16-token test model),
split as SmolVLM's processor does (longest edge 4 tiles: the 640x480 photo takes 4x3 tiles + the global image,
832 placeholders; `--splitTiles 0` runs it unsplit, 64);
`--audio` with Qwen2-Audio's encoder shape (Whisper-large-v3, 30 s window; `--audioLayers` of its 32 layers,
the encoder's cost grows linearly with them) in front of the same SmolLM2-135M-shaped text model, on a 5 s
clip (125 tokens). TTFT is measured from the request (decode + preprocess + encode or cache hit + tokenize) to
its first token.

    python -m experiments.media.multimodal --threads 2 --repeats 3 --json out/bench_multimodal.json
    python -m experiments.media.multimodal --audio --audioLayers 8 --threads 2 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from experiments._common import write_json
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.encoder_build import build_encoder_engine
from kvforge.contract.geometry import kv_bytes_per_page
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.inputs.multimodal.processor import AUDIO_ENCODER_STAGE, VISION_ENCODER_STAGE
from kvforge.runtime.inputs.request_file import parse_request_file
from kvforge.tools.export.families.idefics3_source import write_visual_onnx_dir
from kvforge.tools.export.sources.synthetic import SMOLVLM_256M_TEXT, SMOLVLM_256M_VISION, synthetic_idefics3
from kvforge.tools.export.writer import write_onnx_dir

SYSTEM = "You are a helpful assistant that looks closely at the images it is shown."
QUESTIONS = ("Describe this picture in detail, please.", "What colours dominate in this picture?")
AUDIO_QUESTIONS = ("Transcribe this recording, please.", "Which instrument plays in this recording?")


def build_audio(root: Path, layers: int, tokens_per_page: int) -> tuple[Path, Path, dict]:
    from kvforge.tools.export.families.qwen2_audio_source import write_audio_onnx_dir
    from kvforge.tools.export.sources.synthetic import QWEN2_AUDIO_ENCODER, synthetic_qwen2_audio

    text, audio = synthetic_qwen2_audio(text=SMOLVLM_256M_TEXT, audio={**QWEN2_AUDIO_ENCODER, "encoder_layers": layers},
                                        name="qwen2-audio-encoder-shape")
    return build_dirs(root, text, "audio", lambda path: write_audio_onnx_dir(audio, path), tokens_per_page, 125)


def write_clip(path: Path, seconds: float, seed: int) -> Path:
    import wave

    t = np.arange(int(16000 * seconds)) / 16000
    x = 0.3 * np.sin(2 * np.pi * (220 + 50 * seed) * t) + 0.02 * np.random.default_rng(seed).standard_normal(t.size)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((x * 32767).astype("<i2").tobytes())
    return path


def build(root: Path, tiny: bool, tokens_per_page: int, split_tiles: int) -> tuple[Path, Path, dict]:
    text, visual = synthetic_idefics3(text=None if tiny else SMOLVLM_256M_TEXT,
                                      vision=None if tiny else SMOLVLM_256M_VISION,
                                      name="tiny-idefics3" if tiny else "smolvlm-256m-shape", split_tiles=split_tiles)
    return build_dirs(root, text, "visual", lambda path: write_visual_onnx_dir(visual, path), tokens_per_page,
                      visual.config.tokens_per_image)


def build_dirs(root: Path, text: Any, kind: str, write_encoder: Callable[[Path], None], tokens_per_page: int,
               tokens_per_item: int) -> tuple[Path, Path, dict]:
    """Text ONNX dir + encoder ONNX dir (`write_encoder`) under root/onnx, built into root/engine and root/KIND."""
    write_onnx_dir(text, root / "onnx")
    write_encoder(root / "onnx" / kind)
    build_engine(root / "onnx", root / "engine", BuildOptions(max_input_len=2048, max_kv_cache_capacity=4096,
                                                              max_batch_size=1, tokens_per_page=tokens_per_page))
    build_encoder_engine(root / "onnx" / kind, root / kind, "auto", 1)
    c = text.config
    return root / "engine", root / kind, {"tokens_per_image": tokens_per_item, "layers": c.num_hidden_layers,
                                          "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                                          "kv_cache_dtype": c.kv_cache_dtype}


def request(item: Path, question: str, kind: str = "image") -> dict:
    return {"top_k": 1, "max_generate_length": 1, "requests": [{"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": kind, kind: str(item)}, {"type": "text", "text": question}]}]}]}


def ttft_ms(engine: Engine, data: dict) -> float:
    started = time.perf_counter()
    [prepared] = [engine.inputs.process(r) for r in parse_request_file(data).requests]
    engine.add_request(prepared)
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the 16-token test model instead of SmolVLM-256M shapes")
    parser.add_argument("--tokensPerPage", type=int, default=64)
    parser.add_argument("--splitTiles", type=int, default=4,
                        help="image splitting: the longest edge in tiles (SmolVLM's processors: 4); 0 = unsplit")
    parser.add_argument("--audio", action="store_true", help="an audio item instead of an image")
    parser.add_argument("--audioLayers", type=int, default=8, help="encoder layers of the 32 Qwen2-Audio has")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.audio:
            engine_dir, visual_dir, shape = build_audio(root, args.audioLayers, args.tokensPerPage)
        else:
            engine_dir, visual_dir, shape = build(root, args.tiny, args.tokensPerPage, args.splitTiles)
        kind, questions = ("audio", AUDIO_QUESTIONS) if args.audio else ("image", QUESTIONS)
        rng = np.random.default_rng(0)
        rows = {"cold": [], "warm_both": [], "warm_kv_only": [], "warm_encoder_cache_only": [], "encoder_ms": []}
        for repeat in range(args.repeats):
            # a new item each repeat: the first request is cold everywhere
            if args.audio:
                item = write_clip(root / f"clip{repeat}.wav", 5.0, repeat)
            else:
                item = root / f"photo{repeat}.png"
                Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)).save(item)
            first, second = request(item, questions[0], kind), request(item, questions[1], kind)
            for label, reuse, budget in (("warm_both", True, 256 << 20), ("warm_kv_only", True, 0),
                                         ("warm_encoder_cache_only", False, 256 << 20)):
                engine = Engine(engine_dir, EngineConfig(num_threads=args.threads, enable_context_reuse=reuse,
                                                         multimodal_engine_dir=str(visual_dir),
                                                         encoder_cache_budget_bytes=budget))
                cold = ttft_ms(engine, first)
                rows[label].append(ttft_ms(engine, second))
                if label == "warm_both":
                    rows["cold"].append(cold)
                    stage = next(s for s in engine.profile()["stages"]
                                 if s["stage_id"] in (VISION_ENCODER_STAGE, AUDIO_ENCODER_STAGE))
                    rows["encoder_ms"].append(stage["average_time_per_run_ms"])
                    reused = engine.profile()["context_cache"]["reused_tokens"]
                    multimodal = engine.profile()["multimodal"]
                    if not args.audio:  # an image's placeholders: tokens per tile x (tiles + the global image)
                        shape["tokens_per_image"] = multimodal["total_image_tokens"] // multimodal["total_images"]
            print(f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in rows.items()), file=sys.stderr)
    med = {k: statistics.median(v) for k, v in rows.items()}
    kv_per_token = kv_bytes_per_page(shape["kv_heads"], shape["head_dim"], 1, shape["kv_cache_dtype"])
    figures = {
        "model": (f"Qwen2-Audio encoder shape, {args.audioLayers} of 32 layers + SmolLM2-135M shape" if args.audio
                  else "tiny-idefics3" if args.tiny else "SmolVLM-256M shapes (random weights)"),
        "threads": args.threads, "repeats": args.repeats, "tokens_per_page": args.tokensPerPage,
        **({} if args.audio else {"split_tiles": args.splitTiles}),
        "tokens_per_item": shape["tokens_per_image"],
        "ttft_ms": {k: round(v, 1) for k, v in med.items() if k != "encoder_ms"},
        "ttft_cold_over_warm": round(med["cold"] / med["warm_both"], 2),
        "ttft_cold_over_warm_kv_only": round(med["cold"] / med["warm_kv_only"], 2),
        "ttft_cold_over_warm_encoder_cache_only": round(med["cold"] / med["warm_encoder_cache_only"], 2),
        "encoder_ms_saved_per_cache_hit": round(med["encoder_ms"], 1),
        "reused_tokens_warm": reused,
        "kv_bytes_per_item": kv_per_token * shape["layers"] * shape["tokens_per_image"],
    }
    for key, value in figures.items():
        print(f"{key}: {value}")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
