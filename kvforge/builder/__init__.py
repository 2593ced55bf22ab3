"""ONNX dir → engine dir: geometry validation, sizing and lowering per backend."""
