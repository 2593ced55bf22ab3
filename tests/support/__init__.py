"""Test doubles shared by the component tests (model-free backends, fake tokenizers)."""
