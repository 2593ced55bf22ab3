"""SmolVLM (Idefics3) parity with transformers, end to end: an image file and a prompt -> logits.

A tiny random Idefics3 checkpoint is saved with save_pretrained, exported by llm_export's HF path (text ONNX
dir + vision encoder ONNX dir), built by llm_build's two paths and run through the Engine loop with
--multimodalEngineDir semantics; the reference is transformers' Idefics3Processor (PIL backend) feeding
Idefics3ForConditionalGeneration, with image splitting (a 2x3 tile grid) and without.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.backends import RecordingBackend
from support.lazy_import import LazyModule

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.encoder_build import build_encoder_engine
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.file_loop import prepare_requests
from kvforge.runtime.inputs.request_file import parse_request_file
from kvforge.tools.export.families.idefics3_source import load_idefics3_dir, write_visual_onnx_dir
from kvforge.tools.export.sources.synthetic import IDEFICS3_SPECIAL_TOKENS, byte_level_tokenizer
from kvforge.tools.export.writer import write_onnx_dir

torch = LazyModule("torch", reason="transformers parity needs torch (pip install 'kvforge[dev]')")
transformers = LazyModule("transformers",
                          reason="transformers parity needs transformers (pip install 'kvforge[dev]')")
pytestmark = [pytest.mark.torch, pytest.mark.attention_path]  # run again on the fallback
TOL = 1e-4
PROMPT_BEFORE, PROMPT_AFTER = "<|im_start|>User:", "Describe it.<end_of_utterance>\nAssistant:"


# preprocessor_config.json per case: 48-pixel frames on a 64-pixel position table, so the fractional position
# bucketing is exercised too. Split: a 30x53 image -> 82x144 -> 96x144, 2 rows x 3 columns of tiles + global.
SPLIT = dict(do_image_splitting=True, size={"longest_edge": 144}, max_image_size={"longest_edge": 48})
UNSPLIT = dict(do_image_splitting=False, size={"longest_edge": 96}, max_image_size={"longest_edge": 48})
# SmolVLM's tokenizer has the tile markers as added tokens (Idefics3Processor looks them up).
ROW_COL_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))


def _checkpoint(path: Path, preprocessor: dict) -> None:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    path.mkdir()
    tok = byte_level_tokenizer()
    tok.add_special_tokens([*IDEFICS3_SPECIAL_TOKENS, *ROW_COL_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=50000.0),
        scale_factor=2, image_token_id=tok.token_to_id("<image>"))
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # std-0.02 init gives flat logits; larger weights make the comparison bite
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name and name.endswith("weight")
                        else 0.1 * noise if name.endswith("bias") else 0.15 * noise)
    model.save_pretrained(path)
    processor = Idefics3ImageProcessorPil(**preprocessor)
    (path / "preprocessor_config.json").write_text(json.dumps(processor.to_dict()))


def _reference_logits(checkpoint: Path, image: Path, tokens_per_image: int,
                      preprocessor: dict) -> tuple[list[int], np.ndarray]:
    from transformers import Idefics3ForConditionalGeneration, Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    image_processor = Idefics3ImageProcessorPil(**preprocessor)
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=tokens_per_image)
    inputs = processor(text=[PROMPT_BEFORE + "<image>" + PROMPT_AFTER], images=[[Image.open(image)]],
                       return_tensors="pt")
    model = Idefics3ForConditionalGeneration.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1].numpy()
    return inputs["input_ids"][0].tolist(), logits


@pytest.mark.parametrize(("preprocessor", "shape", "frames"), [(UNSPLIT, (37, 53), 1), (SPLIT, (30, 53), 7)],
                         ids=["unsplit", "split-2x3"])
def test_idefics3_image_file_to_logits_matches_transformers(tmp_path: Path, preprocessor: dict,
                                                            shape: tuple[int, int], frames: int) -> None:
    checkpoint = tmp_path / "hf"
    _checkpoint(checkpoint, preprocessor)
    image = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (*shape, 3), dtype=np.uint8)).save(image)
    loaded, visual = load_idefics3_dir(checkpoint, kv_cache_dtype="fp32")
    write_onnx_dir(loaded, tmp_path / "onnx")
    write_visual_onnx_dir(visual, tmp_path / "onnx" / "visual")
    build_engine(tmp_path / "onnx", tmp_path / "engine",
                 BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=1, tokens_per_page=16))
    build_encoder_engine(tmp_path / "onnx" / "visual", tmp_path / "visual", "auto", 4)
    capture = RecordingBackend.load(tmp_path / "engine")
    engine = Engine(tmp_path / "engine", EngineConfig(num_threads=2, multimodal_engine_dir=str(tmp_path / "visual")),
                    backend=capture)
    request_file = parse_request_file({"apply_chat_template": False, "top_k": 1, "max_generate_length": 1,
                                       "parse_special_tokens": True,  # the text parts are raw template markup
                                       "requests": [{"messages": [{"role": "user", "content": [
                                           {"type": "text", "text": PROMPT_BEFORE},
                                           {"type": "image", "image": image.name},
                                           {"type": "text", "text": PROMPT_AFTER}]}]}]})
    [prepared] = prepare_requests(engine, request_file, tmp_path)
    engine.add_request(prepared)
    while engine.has_unfinished():
        engine.step()
    ids, reference = _reference_logits(checkpoint, image, visual.config.tokens_per_image, preprocessor)
    assert visual.config.preprocessing.do_image_splitting == preprocessor["do_image_splitting"]
    assert prepared.prompt_ids == ids  # the placeholder expansion (tile markers included) is the processor's
    assert visual.config.tokens_per_image == 9 and len(prepared.media) == 1
    [span] = prepared.media
    assert len(span.embeds) == 9 * frames == ids.count(visual.config.image_token_id)
    image_positions = [i for i, t in enumerate(ids) if t == visual.config.image_token_id]
    assert (span.start, span.end) == (image_positions[0], image_positions[-1] + 1)  # the span holds every tile
    logits = capture.logits[-1][0]  # the last call's one sampled position
    assert np.abs(logits - reference).max() <= TOL * max(1.0, np.abs(reference).max())
    assert int(np.argmax(logits)) == int(np.argmax(reference))
