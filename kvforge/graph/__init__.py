"""ONNX graph writing shared by the exporter and the builder's lowering (writer, RoPE)."""
