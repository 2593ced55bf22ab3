"""LoRA adapters: their cost, and the corrected-adapter experiment."""
