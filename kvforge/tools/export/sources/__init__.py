"""Weight sources: GGUF, HF safetensors, synthetic models, and the source interface (`base`)."""
