"""The exported Mamba2 graph (lowered for ONNX Runtime) against transformers' Mamba2ForCausalLM on a tiny random
config: prefill, prefill-then-decode, chunked prefill continuing from the carried states, ragged rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from support.lazy_import import LazyModule

from kvforge.builder.lower_recurrent import lower_recurrent_ops
from kvforge.runtime.execution.backend import last_token_indices
from kvforge.tools.export.families.mamba2 import (
    Mamba2Geometry,
    build_mamba2_graph,
    conv_state_name,
    recurrent_state_name,
)

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

torch = LazyModule("torch")
transformers = LazyModule("transformers")
TOL = 1e-4


@pytest.fixture(scope="module")
def models() -> tuple[object, ort.InferenceSession, Mamba2Geometry]:
    torch.manual_seed(0)
    config = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                                       expand=2, state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
                                       tie_word_embeddings=False, use_conv_bias=True)
    hf = transformers.Mamba2ForCausalLM(config).eval()
    with torch.no_grad():  # move every parameter off its init value (ones, zeros) so each one matters
        for name, param in hf.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("conv1d.bias"):
                param.copy_(0.1 * torch.randn_like(param))
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    weights["model.embed_tokens.weight"] = weights.pop("backbone.embeddings.weight")
    geometry = Mamba2Geometry(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                              state_size=16, n_groups=2, conv_kernel=4, rms_norm_eps=config.layer_norm_epsilon)
    lowered = lower_recurrent_ops(build_mamba2_graph(geometry, weights))
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    return hf, session, geometry


def zero_states(geometry: Mamba2Geometry, batch: int) -> dict[str, np.ndarray]:
    states = {}
    for layer in range(geometry.num_hidden_layers):
        states[conv_state_name(layer)] = np.zeros((batch, geometry.conv_dim, geometry.conv_kernel - 1), np.float32)
        states[recurrent_state_name(layer)] = np.zeros(
            (batch, geometry.num_heads, geometry.head_dim, geometry.state_size), np.float32)
    return states


def run(models: tuple, rows: list[list[int]], states: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
    """One engine call over ragged rows; returns last-token logits and the carried states."""
    hf, session, geometry = models
    width = max(len(r) for r in rows)
    embedding = hf.backbone.embeddings.weight.detach().numpy()
    embeds = np.zeros((len(rows), width, geometry.hidden_size), np.float32)
    for i, ids in enumerate(rows):
        embeds[i, :len(ids)] = embedding[ids]
    feeds = {"inputs_embeds": embeds, "context_lengths": np.array([len(r) for r in rows], np.int32),
             "logits_indices": last_token_indices([len(r) for r in rows], width), **states}
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(names, feeds), strict=True))
    carried = {name.removeprefix("present_"): value for name, value in outputs.items() if name != "logits"}
    return outputs["logits"], carried


def reference(hf: object, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


def test_prefill_matches_transformers(models: tuple) -> None:
    ids = [3, 17, 5, 42, 8, 9, 21, 33, 1, 60, 7]
    logits, _ = run(models, [ids], zero_states(models[2], 1))
    np.testing.assert_allclose(logits[0], reference(models[0], ids), atol=TOL, rtol=0)


def test_long_prefill_in_chunks_matches_transformers(models: tuple) -> None:
    """100 tokens in one call: the lowered scan's chunked form (two 64-token chunks, the second padded)."""
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 64, 100)]
    logits, states = run(models, [ids], zero_states(models[2], 1))
    np.testing.assert_allclose(logits[0], reference(models[0], ids), atol=TOL, rtol=0)
    logits, _ = run(models, [[5]], states)
    np.testing.assert_allclose(logits[0], reference(models[0], ids + [5]), atol=TOL, rtol=0)


def test_prefill_then_decode_matches_transformers(models: tuple) -> None:
    ids = [3, 17, 5, 42, 8, 9, 21]
    _, states = run(models, [ids], zero_states(models[2], 1))
    for token in (11, 12, 40):
        logits, states = run(models, [[token]], states)
        ids = ids + [token]
        np.testing.assert_allclose(logits[0], reference(models[0], ids), atol=TOL, rtol=0)


def test_chunked_prefill_continues_from_the_states(models: tuple) -> None:
    ids = [3, 17, 5, 42, 8, 9, 21, 33, 1, 60, 7, 19, 2]
    _, states = run(models, [ids[:5]], zero_states(models[2], 1))
    logits, _ = run(models, [ids[5:]], states)
    np.testing.assert_allclose(logits[0], reference(models[0], ids), atol=TOL, rtol=0)


def test_ragged_rows_keep_their_own_states(models: tuple) -> None:
    long, short = [3, 17, 5, 42, 8, 9, 21, 33], [50, 4, 6]
    logits, states = run(models, [long, short], zero_states(models[2], 2))
    np.testing.assert_allclose(logits[0], reference(models[0], long), atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[1], reference(models[0], short), atol=TOL, rtol=0)
    logits, _ = run(models, [[10], [11]], states)  # decode both rows from states taken at different lengths
    np.testing.assert_allclose(logits[1], reference(models[0], short + [11]), atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[0], reference(models[0], long + [10]), atol=TOL, rtol=0)


# --- export: the synthetic tiny-mamba2 and an HF checkpoint dir through llm_export's writer ---------------

def hf_twin(config: object) -> object:
    """transformers' Mamba2ForCausalLM for a kvforge mamba2 ModelConfig (weights loaded by the caller)."""
    return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_heads=config.recurrent_state_num_heads, head_dim=config.recurrent_state_head_dim,
        expand=config.intermediate_size // config.hidden_size, state_size=config.recurrent_state_size,
        n_groups=config.n_groups, conv_kernel=config.conv_kernel, layer_norm_epsilon=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, chunk_size=8)).eval()


def exported(onnx_dir: Path) -> tuple[ort.InferenceSession, Mamba2Geometry]:
    from kvforge.contract.files import read_json
    from kvforge.contract.model_config import ModelConfig
    from kvforge.tools.export.families.mamba2 import geometry

    config = ModelConfig.from_dict(read_json(onnx_dir / "config.json", "onnx_dir"))
    lowered = lower_recurrent_ops(onnx.load(onnx_dir / "model.onnx"))
    return ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]), geometry(config)


def test_synthetic_tiny_mamba2_exports_and_matches_transformers(tmp_path: Path) -> None:
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    loaded = synthetic_model("tiny-mamba2")
    write_onnx_dir(loaded, tmp_path / "onnx")
    written = json.loads((tmp_path / "onnx" / "config.json").read_text())
    assert written["model"] == "mamba2" and written["layer_types"] == ["mamba", "mamba"]
    assert written.get("lora_targets", []) == []  # the graph has no LoRA inputs, whatever --loraTargets says
    hf = hf_twin(loaded.config)
    state = {("backbone.embeddings.weight" if k == "model.embed_tokens.weight" else k): torch.tensor(v)
             for k, v in loaded.weights.items()}
    hf.load_state_dict(state, strict=True)
    session, geometry = exported(tmp_path / "onnx")
    ids = [40, 41, 70, 100, 5, 77, 90, 12, 33]
    logits, states = run((hf, session, geometry), [ids[:4]], zero_states(geometry, 1))
    logits, _ = run((hf, session, geometry), [ids[4:]], states)  # chunked
    np.testing.assert_allclose(logits[0], reference(hf, ids), atol=TOL, rtol=0)


def test_hf_mamba2_checkpoint_dir_exports_and_matches_transformers(tmp_path: Path, models: tuple) -> None:
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer
    from kvforge.tools.export.writer import write_onnx_dir

    hf = models[0]
    checkpoint = tmp_path / "hf"
    hf.save_pretrained(checkpoint, safe_serialization=True)
    byte_level_tokenizer().save(str(checkpoint / "tokenizer.json"))
    loaded = load_hf_dir(checkpoint)
    assert loaded.config.model == "mamba2" and loaded.config.recurrent_state_num_heads == 8
    write_onnx_dir(loaded, tmp_path / "onnx")
    session, geometry = exported(tmp_path / "onnx")
    ids = [3, 17, 5, 42, 8, 9, 21]
    _, states = run((hf, session, geometry), [ids], zero_states(geometry, 1))
    logits, _ = run((hf, session, geometry), [[11]], states)  # prefill then decode
    np.testing.assert_allclose(logits[0], reference(hf, ids + [11]), atol=TOL, rtol=0)


def test_llm_build_lowers_a_recurrent_export_and_llm_inference_runs_it(
        run_cli, tmp_path: Path) -> None:
    from support.cli_checks import assert_one_line_error

    from kvforge.contract.geometry import recurrent_bytes_per_slot
    from kvforge.tools.export.sources.synthetic import synthetic_model

    export = run_cli(["llm_export", "--synthetic", "tiny-mamba2", "--outputDir", tmp_path / "onnx"])
    assert export.returncode == 0, export.stderr
    build = run_cli(["llm_build", "--onnxDir", tmp_path / "onnx", "--engineDir", tmp_path / "engine",
                     "--reuseRecords", "4"])
    assert build.returncode == 0, build.stderr
    config = synthetic_model("tiny-mamba2").config
    slot = recurrent_bytes_per_slot(2, 8, 16, 16, config.conv_dim, 4)
    built = json.loads((tmp_path / "engine" / "config.json").read_text())["builder_config"]
    assert built["layer_types"] == ["mamba", "mamba"] and built["recurrent_snapshot_bytes_per_slot"] == slot
    assert built["partial_kv_snapshot_bytes_per_slot"] == 0
    text = " ".join(build.stderr.split())
    assert f"recurrent snapshot slot: {slot:,} bytes" in text
    assert f"--contextCacheRecurrentSnapshotPoolBytes {4 * slot}" in text
    assert "KV pool" not in text  # no attention layers, no pool
    lowered = onnx.load(tmp_path / "engine" / "model.onnx")
    assert not any(n.domain == "kvforge" for n in lowered.graph.node)
    # A pool that would hold a sequence (64 pages of 128 tokens), so the retained-pages gate is what refuses it.
    pages = run_cli(["llm_build", "--onnxDir", tmp_path / "onnx", "--engineDir", tmp_path / "engine2",
                     "--tokensPerPage", "128", "--maxKVPoolPages", "64"])
    assert_one_line_error(pages, "--maxKVPoolPages", "no attention layers")  # the seed's retained-pages gate
    request = tmp_path / "in.json"
    request.write_text(json.dumps({"requests": [{"messages": [{"role": "user", "content": "hi"}]}]}))
    inference = run_cli(["llm_inference", "--engineDir", tmp_path / "engine", "--inputFile", request,
                         "--outputFile", tmp_path / "out.json"])
    assert inference.returncode == 0, inference.stderr  # the engine loop runs recurrent engines (state rows)
    assert json.loads((tmp_path / "out.json").read_text())["responses"][0]["output_text"] is not None


def test_unknown_layer_types_are_refused_in_one_line(run_cli, tmp_path: Path, tiny_engine_dir: Path) -> None:
    from support.cli_checks import assert_one_line_error

    engine = tmp_path / "engine_with_unknown_layers"
    shutil.copytree(tiny_engine_dir, engine)
    data = json.loads((engine / "config.json").read_text())
    data["layer_types"] = ["mamba"] * data["num_hidden_layers"]
    (engine / "config.json").write_text(json.dumps(data))
    request = tmp_path / "in.json"
    request.write_text(json.dumps({"requests": [{"messages": [{"role": "user", "content": "hi"}]}]}))
    inference = run_cli(["llm_inference", "--engineDir", engine, "--inputFile", request,
                         "--outputFile", tmp_path / "out.json"])
    assert_one_line_error(inference, "layer_types")
