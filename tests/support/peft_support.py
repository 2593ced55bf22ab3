"""PEFT adapters for tests: PEFT starts every lora_B at zero (an adapter that changes nothing), so tests draw them."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def randomize_lora_b(model: Any, std: float, seed: int | None = None) -> None:
    """Every lora_B of a PEFT model drawn from N(0, std) (torch's generator seeded with `seed` first, if given)."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, std)


def save_tiny_llama(hf_dir: Path, vocab: int, layers: int) -> Any:
    """A random float32 llama (seed 0; weights drawn from N(0, 0.2), so that answers depend on them) saved to `hf_dir`
    with a word-level tokenizer, as llm_export reads a checkpoint; returns the transformers model."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(hf_dir, safe_serialization=True)
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(hf_dir / "tokenizer.json"))
    return model


def save_peft_adapter(hf_dir: Path, out_dir: Path, targets: list[str], invocation: list[int] | None,
                      seed: int) -> Any:
    """PEFT's LoRA (rank 4, alpha 12; activated from `invocation` on where given) over a fresh load of `hf_dir`, its
    lora_B drawn from N(0, 0.3) with `seed`, saved to `out_dir`; returns the PEFT model."""
    import peft
    import transformers

    fresh = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, task_type="CAUSAL_LM",
                             alora_invocation_tokens=invocation)
    model = peft.get_peft_model(fresh, config).eval()
    randomize_lora_b(model, 0.3, seed)
    model.save_pretrained(out_dir)
    return model
