"""llm_export: weights (GGUF, HF safetensors, synthetic) → ONNX dir with paged-KV custom ops."""
