"""One sequence driven through a lowered attention-only graph with the test binding its own pools (no runtime):
what the Gemma parity tests run their exported graphs with, on each attention path of the ONNX Runtime lowering."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kvforge.builder.lower_ort import lower_for_onnxruntime, new_rows_name
from kvforge.contract.engine_dir import PER_LAYER_INPUT
from kvforge.contract.model_config import ModelConfig
from kvforge.plugins.reference import rope_table
from kvforge.runtime.execution.backend import last_token_indices
from kvforge.tools.export.families.llama import pool_input_name
from support.ort_support import cpu_kernel_on, session_for

TOKENS_PER_PAGE, CAPACITY = 16, 1600
PATHS = ["kernel", "gqa", "op-by-op"]  # the CPU kernel, GroupQueryAttention, the op-by-op masks


def lowered_session(model: onnx.ModelProto, path: str) -> ort.InferenceSession:
    """`model` lowered (a copy) for one attention path, fp32 pools of CAPACITY tokens."""
    if path == "kernel" and not cpu_kernel_on():
        pytest.skip("the kvforge CPU kernel does not build here")
    lowered = lower_for_onnxruntime(onnx.ModelProto.FromString(model.SerializeToString()), kv_cache_dtype="fp32",
                                    tokens_per_page=TOKENS_PER_PAGE, num_pages=CAPACITY // TOKENS_PER_PAGE,
                                    cpu_kernel=path == "kernel", fused_attention=path != "op-by-op")
    return session_for(lowered)


@dataclass
class Row:
    """One sequence's pools (one per layer) and length: what a runner keeps between calls."""

    config: ModelConfig
    session: ort.InferenceSession
    embedding: np.ndarray
    pools: dict[int, np.ndarray] = field(default_factory=dict)
    length: int = 0
    per_layer: np.ndarray | None = None  # Gemma 4's per-layer table, looked up as the runtime does

    def __post_init__(self) -> None:
        c = self.config
        shape = (CAPACITY // TOKENS_PER_PAGE, 2, c.num_key_value_heads, TOKENS_PER_PAGE)
        self.pools = {layer: np.zeros((*shape, c.layer_head_dim(layer)), np.float32) for layer in c.attention_layer_ids}

    def step(self, ids: list[int]) -> np.ndarray:
        """One call continuing the row by `ids`; the last token's logits."""
        c = self.config
        table = np.arange(CAPACITY // TOKENS_PER_PAGE, dtype=np.int32)[None]
        feeds = {"inputs_embeds": self.embedding[ids][None].astype(np.float32),
                 "context_lengths": np.array([len(ids)], np.int32),
                 "kvcache_start_index": np.array([self.length], np.int32), "kv_page_table": table,
                 "rope_rotary_cos_sin": rope_table(CAPACITY, c.rotary_dim, c.rope_theta),
                 "logits_indices": last_token_indices([len(ids)], len(ids)),
                 **{pool_input_name(layer): pool for layer, pool in self.pools.items()}}
        if self.per_layer is not None:
            feeds[PER_LAYER_INPUT] = self.per_layer[ids][None].astype(np.float32)
        names = [o.name for o in self.session.get_outputs()]
        out = dict(zip(names, self.session.run(names, feeds), strict=True))
        for layer, pool in self.pools.items():  # scatter the new K/V rows into the pages, as the runner does
            rows = out[new_rows_name(pool_input_name(layer))][0]  # [S, 2, Hkv, D]
            for i in range(len(ids)):
                pos = self.length + i
                pool[pos // TOKENS_PER_PAGE, :, :, pos % TOKENS_PER_PAGE] = rows[i]
        self.length += len(ids)
        return out["logits"][0]

    def greedy(self, prompt: list[int], count: int, banned: int, chunk: int = 512) -> list[int]:
        """Prefill `prompt` in chunks (as the scheduler does), then `count` greedy tokens, never `banned` (end of
        sequence: transformers' min_new_tokens suppresses it too)."""
        for start in range(0, len(prompt), chunk):
            logits = self.step(prompt[start:start + chunk])
        tokens: list[int] = []
        while len(tokens) < count:
            if tokens:
                logits = self.step([tokens[-1]])
            tokens.append(int(np.argmax(np.where(np.arange(len(logits)) == banned, -np.inf, logits))))
        return tokens
