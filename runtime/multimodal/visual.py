"""The visual engine of a multimodal engine dir: preprocessed pixels in, one embedding row per placeholder out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.multimodal import (
    ENCODER_INPUT,
    ENCODER_OUTPUT,
    VISUAL,
    VISUAL_ENGINE_FILE,
    EncoderConfig,
    read_encoder_config,
)
from kvforge.runtime.multimodal.image import idefics3_pixel_values

FIELD = "multimodal_engine_dir"


class VisualEncoder:
    __slots__ = ("config", "session")

    def __init__(self, engine_dir: Path, num_threads: int = 0) -> None:
        self.config: EncoderConfig = read_encoder_config(engine_dir, FIELD)
        if self.config.kind != VISUAL:
            raise InvalidConfig(f"{engine_dir} holds a {self.config.kind} encoder, not a visual one", FIELD)
        if not self.config.backend:
            raise InvalidConfig(f"{engine_dir} is an encoder ONNX dir, not an engine dir; build it with llm_build",
                                FIELD)
        if not (engine_dir / VISUAL_ENGINE_FILE).is_file():
            raise InvalidConfig(f"multimodal engine dir {engine_dir} is missing {VISUAL_ENGINE_FILE}; rebuild it",
                                FIELD)
        options = ort.SessionOptions()
        if num_threads:
            options.intra_op_num_threads = num_threads
        self.session = ort.InferenceSession(str(engine_dir / VISUAL_ENGINE_FILE), options,
                                            providers=["CPUExecutionProvider"])

    def preprocess(self, pixels: np.ndarray) -> np.ndarray:
        return idefics3_pixel_values(pixels, self.config.preprocessing)

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """[N, C, S, S] -> [N, tokens_per_image, text hidden], in calls of at most max_batch_size images."""
        step = max(self.config.max_batch_size, 1)
        parts = [self.session.run([ENCODER_OUTPUT], {ENCODER_INPUT: pixel_values[i:i + step]})[0]
                 for i in range(0, len(pixel_values), step)]
        return np.concatenate(parts).astype(np.float32, copy=False)
