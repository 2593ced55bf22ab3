"""The quantization quality bar: int8/int4 exports against float32."""
