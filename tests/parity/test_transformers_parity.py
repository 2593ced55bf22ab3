"""Parity against transformers: tiny random Llama/Qwen2/Qwen3 checkpoints, exported, built and run on ORT.

Each checkpoint is saved with save_pretrained, loaded back by the HF-dir source, exported to ONNX, lowered
by build_engine and driven through OrtBackend; the reference is the same checkpoint reloaded by
transformers (float32, eager attention). Covers full prefill, prefill + decode, chunked prefill over a
shuffled page list, ragged batches, and an fp16 KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from support.lazy_import import LazyModule

torch = LazyModule("torch", reason="transformers parity needs torch (pip install 'kvforge[dev]')")
transformers = LazyModule("transformers",
                                   reason="transformers parity needs transformers (pip install 'kvforge[dev]')")
tokenizers = pytest.importorskip("tokenizers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from kvforge.builder.build import BuildOptions, build_engine  # noqa: E402
from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR, load_engine_dir  # noqa: E402
from kvforge.runtime.execution.backend import StepInputs  # noqa: E402
from kvforge.runtime.execution.ort import OrtBackend  # noqa: E402
from kvforge.tools.export.sources.hf import load_hf_dir  # noqa: E402
from kvforge.tools.export.writer import write_onnx_dir  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.attention_path]  # run again on the fallback

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 64, 128, 2, 4, 2
BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=128, max_batch_size=2, tokens_per_page=16)
FP32_TOL, FP16_TOL, BATCH_TOL = 1e-4, 2e-2, 1e-5

# name -> (config class, model class, extra config kwargs). The RoPE thetas differ from the 10000 default so
# a theta that is dropped on the way to the engine shows up as a mismatch.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 10000.0, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 1000000.0, "head_dim": 32}),
}


# ----------------------------------------------------------------------------------------------- helpers

def _write_tokenizer(path: Path) -> None:
    """A trivial WordLevel tokenizer over the model's vocab: the HF-dir loader requires tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers' std-0.02 init gives near-flat logits; larger weights make the comparison bite."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied lm_head/embedding is listed once
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.2 * noise)


def _save_checkpoint(arch: str, path: Path, seed: int) -> None:
    config_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    _randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)


def _load_reference(path: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    return model.float().eval()


def _hf_logits(model: torch.nn.Module, ids: Sequence[int]) -> np.ndarray:
    """Logits [T, V] at every position of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([list(ids)], dtype=torch.long)).logits[0].float().numpy()


@dataclass
class Engine:
    runner: OrtBackend
    embedding: np.ndarray  # [V, H] from the engine dir, as the runtime would look tokens up
    num_pages: int

    def step(self, rows: Sequence[Sequence[int]], starts: Sequence[int], pages: Sequence[Sequence[int]],
             pad_rng: np.random.Generator | None = None) -> np.ndarray:
        """One engine call over ragged rows of new token ids; padding (finite garbage if pad_rng) must not matter."""
        width = max(len(r) for r in rows)
        embeds = np.zeros((len(rows), width, self.embedding.shape[1]), dtype=np.float32)
        if pad_rng is not None:
            embeds[:] = pad_rng.normal(0.0, 10.0, embeds.shape)
        for b, ids in enumerate(rows):
            embeds[b, :len(ids)] = self.embedding[list(ids)]
        return self.runner.forward(StepInputs(embeds, np.array([len(r) for r in rows], dtype=np.int32),
                                              np.asarray(starts, dtype=np.int32), [list(p) for p in pages])).logits

    def run_chunks(self, ids: Sequence[int], chunks: Sequence[int], pages: Sequence[int]) -> list[np.ndarray]:
        """Feeds one sequence chunk by chunk; returns each call's last-token logits [V]."""
        assert sum(chunks) == len(ids)
        out, pos = [], 0
        for n in chunks:
            out.append(self.step([ids[pos:pos + n]], [pos], [pages])[0])
            pos += n
        return out

    def poison_pool(self, seed: int) -> None:
        """Fill every page with finite garbage: attention must never read a slot it did not write."""
        rng = np.random.default_rng(seed)
        for layer in self.runner.kv_store.layers:  # in place: the runner binds OrtValues over this memory
            layer[...] = rng.normal(0.0, 30.0, layer.shape).astype(layer.dtype)


def _build(checkpoint: Path, out: Path, kv_cache_dtype: str) -> Engine:
    write_onnx_dir(load_hf_dir(checkpoint, kv_cache_dtype=kv_cache_dtype), out / "onnx")
    build_engine(out / "onnx", out / "engine", BUILD)
    engine = load_engine_dir(out / "engine")
    embedding = safetensors_numpy.load_file(str(engine.file(EMBEDDING_FILE)))[EMBEDDING_TENSOR]
    result = Engine(OrtBackend(engine, num_threads=2), embedding, engine.build.max_kv_pool_pages)
    result.poison_pool(seed=7)
    return result


def _check(record_property, label: str, got: np.ndarray, want: np.ndarray, tol: float) -> float:
    diff = float(np.abs(np.asarray(got, dtype=np.float64) - want).max())
    record_property(label, f"{diff:.3e}")
    assert np.isfinite(got).all(), f"{label}: non-finite logits"
    assert diff <= tol, f"{label}: max |engine - transformers| = {diff:.3e} > {tol:g}"
    return diff


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    arch = request.param
    path = tmp_path_factory.mktemp(f"hf-{arch}")
    _save_checkpoint(arch, path, seed=list(ARCHS).index(arch) + 1)
    return arch, path, _load_reference(path)


@pytest.fixture(scope="module")
def fp32_engine(checkpoint, tmp_path_factory) -> Engine:
    arch, path, _ = checkpoint
    return _build(path, tmp_path_factory.mktemp(f"fp32-{arch}"), "fp32")


# ------------------------------------------------------------------------------------------------- tests

def test_checkpoint_round_trips_config(checkpoint, fp32_engine) -> None:
    arch, _, model = checkpoint
    config, runner = model.config, fp32_engine.runner
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._attn_implementation == "eager"
    assert len(runner.kv_store.layers) == config.num_hidden_layers
    assert fp32_engine.embedding.shape == (VOCAB, HIDDEN)
    np.testing.assert_array_equal(fp32_engine.embedding, model.get_input_embeddings().weight.detach().numpy())
    assert runner.kv_store.layers[0].shape[2:] == (KV_HEADS, BUILD.tokens_per_page, ARCHS[arch][2].get("head_dim", 16))


def test_full_prefill(checkpoint, fp32_engine, record_property) -> None:
    _, _, model = checkpoint
    ids = _tokens(10, 40)
    want = _hf_logits(model, ids)
    assert want[-1].std() > 0.5, "reference logits are nearly flat; the comparison would not bite"
    got = fp32_engine.step([ids], [0], [[9, 4, 13]])[0]
    _check(record_property, "full_prefill", got, want[-1], FP32_TOL)


def test_prefill_then_decode(checkpoint, fp32_engine, record_property) -> None:
    _, _, model = checkpoint
    ids = _tokens(11, 40)
    want = _hf_logits(model, ids)
    got = fp32_engine.run_chunks(ids, [25] + [1] * 15, [2, 0, 15])
    positions = [24] + list(range(25, 40))
    _check(record_property, "prefill_then_decode", np.stack(got), want[positions], FP32_TOL)


def test_chunked_prefill_over_shuffled_pages(checkpoint, fp32_engine, record_property) -> None:
    """Chunks cross page boundaries, end exactly on one, and run to the full 128-token capacity."""
    _, _, model = checkpoint
    capacity = BUILD.max_kv_cache_capacity
    ids = _tokens(12, capacity)
    want = _hf_logits(model, ids)
    pages = np.random.default_rng(3).permutation(fp32_engine.num_pages)[:capacity // BUILD.tokens_per_page]
    assert np.any(np.diff(pages) != 1), "page list should be non-contiguous"
    chunks = [17, 9, 6, 8, 64, 20, 1, 1, 1, 1]
    got = fp32_engine.run_chunks(ids, chunks, pages.tolist())
    ends = np.cumsum(chunks) - 1
    _check(record_property, "chunked_prefill", np.stack(got), want[ends], FP32_TOL)


def test_ragged_batch_matches_rows_alone(checkpoint, fp32_engine, record_property) -> None:
    """Two rows of different lengths and starts in each call: prefill, a continuation chunk, decodes."""
    _, _, model = checkpoint
    seqs = [_tokens(13, 34), _tokens(14, 21)]
    schedules = [[23, 7, 1, 1, 1, 1], [11, 6, 1, 1, 1, 1]]
    batch_pages, alone_pages = [[6, 1, 11], [14, 3]], [[8, 12, 0], [5, 10]]
    pad_rng = np.random.default_rng(5)

    batched: list[list[np.ndarray]] = [[], []]
    pos = [0, 0]
    for step in range(len(schedules[0])):
        rows = [seqs[b][pos[b]:pos[b] + schedules[b][step]] for b in range(2)]
        logits = fp32_engine.step(rows, pos, batch_pages, pad_rng=pad_rng)
        for b in range(2):
            batched[b].append(logits[b])
            pos[b] += schedules[b][step]

    for b in range(2):
        alone = fp32_engine.run_chunks(seqs[b], schedules[b], alone_pages[b])
        _check(record_property, f"ragged_row{b}_vs_alone", np.stack(batched[b]), np.stack(alone), BATCH_TOL)
        want = _hf_logits(model, seqs[b])[np.cumsum(schedules[b]) - 1]
        _check(record_property, f"ragged_row{b}_vs_hf", np.stack(batched[b]), want, FP32_TOL)


def test_fp16_kv_cache_teacher_forced_decode(checkpoint, tmp_path_factory, record_property) -> None:
    arch, path, model = checkpoint
    engine = _build(path, tmp_path_factory.mktemp(f"fp16-{arch}"), "fp16")
    assert engine.runner.kv_store.layers[0].dtype == np.float16
    ids = _tokens(15, 40)
    want = _hf_logits(model, ids)
    got = np.stack(engine.run_chunks(ids, [1] * 40, [7, 2, 12]))
    _check(record_property, "fp16_teacher_forced", got, want, FP16_TOL)
    mismatched = np.flatnonzero(got.argmax(-1) != want.argmax(-1))
    assert mismatched.size == 0, f"greedy argmax differs from transformers at positions {mismatched.tolist()}"
