"""Kernels and lowerings: the CPU attention and matmul kernels, recurrent prefill, paged against dense."""
