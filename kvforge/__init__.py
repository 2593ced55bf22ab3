"""kvforge: ONNX LLM engine builder and runner with content-addressed KV-cache reuse."""

__version__ = "0.1.0"
