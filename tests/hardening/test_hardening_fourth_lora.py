"""The fourth hostile pass (issue 52 item 4 and "also seen"): `--loraCorrectionPages` bounded by the pool it
corrects, and an adapter named twice by `--loraCorrection`, each refused in one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.hardening_support import invoke
from support.peft_support import save_peft_adapter, save_tiny_llama

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import LORA_TARGETS
from kvforge.runtime.api import LLM
from kvforge.server.cli import app as serve_app

VOCAB, LAYERS = 128, 3
BUILD = BuildOptions(max_input_len=96, max_kv_cache_capacity=128, max_batch_size=2, tokens_per_page=16,
                     max_lora_rank=4, max_kv_pool_pages=20)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def corrected(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(an engine exported with the hidden states corrections need, a converted adapter for it)."""
    pytest.importorskip("torch", reason="the adapter is made with PEFT")
    pytest.importorskip("peft", reason="the adapter is made with PEFT")
    from kvforge.tools.export.lora import write_converted_adapter
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.writer import write_onnx_dir

    root = tmp_path_factory.mktemp("lora_bounds")
    save_tiny_llama(root / "hf", VOCAB, LAYERS)
    save_peft_adapter(root / "hf", root / "peft", ALL, None, 1)
    loaded = load_hf_dir(root / "hf", kv_cache_dtype="fp32")
    loaded.config.lora_targets = list(LORA_TARGETS)
    loaded.config.hidden_state_layers = list(range(LAYERS - 1))
    write_onnx_dir(loaded, root / "onnx")
    build_engine(root / "onnx", root / "engine", BUILD)
    write_converted_adapter(root / "peft", root / "onnx", root / "checker.safetensors")
    return root / "engine", str(root / "checker.safetensors")


def serve(engine: Path, adapter: str, *flags: str):  # -> Result
    return invoke(serve_app, "--engineDir", engine, "--loraWeights", f"checker={adapter}", "--enableContextReuse",
                  "--numThreads", "1", "--port", "0", *flags)


def test_correction_pages_past_the_pool_are_refused(corrected: tuple[Path, str]) -> None:
    engine, adapter = corrected
    with pytest.raises(KvforgeError) as info:
        LLM(engine, lora_weights={"checker": adapter}, lora_corrections=("checker",), lora_correction_pages=21,
            num_threads=1)
    assert info.value.field == "lora_correction_pages" and "20 pages x 1 corrected adapters = 20" in info.value.message
    llm = LLM(engine, lora_weights={"checker": adapter}, lora_corrections=("checker",), lora_correction_pages=20,
              num_threads=1)  # the bound itself is fine
    assert llm.engine.profile()["context_cache"]["resource_pools"]["adapter_corrections"]["capacity"] == 20
    llm.close()
    # Last: on the old code this allocated the slots' bookkeeping until the process ran out of memory.
    serve(engine, adapter, "--loraCorrection", "checker", "--loraCorrectionPages",
          str(10**12)).one_line_error("--loraCorrectionPages", "at most", "got 1000000000000")


def test_an_adapter_corrected_twice_is_refused(corrected: tuple[Path, str]) -> None:
    engine, adapter = corrected
    serve(engine, adapter, "--loraCorrection", "checker", "--loraCorrection",
          "checker").one_line_error("--loraCorrection", "'checker' more than once")
