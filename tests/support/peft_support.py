"""PEFT adapters for tests: PEFT starts every lora_B at zero (an adapter that changes nothing), so tests draw them."""

from __future__ import annotations

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
