"""Running the model: the executor, the backend contract, its ONNX Runtime and TensorRT backends, KV storage,
recurrent state and snapshots."""
