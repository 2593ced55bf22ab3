"""A small ONNX graph writer: auto-named values and constants, so graph code reads like the math."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 19  # Cast to FLOAT8E4M3FN needs 19; TensorRT's parser accepts it


class GraphWriter:
    """Appends nodes to a growing list; `op` returns the output name(s) of the node it adds."""

    def __init__(self, prefix: str = "") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counter = itertools.count()
        self._prefix = prefix
        self._constants: dict[tuple, str] = {}

    def fresh(self, hint: str) -> str:
        return f"{self._prefix}{hint}_{next(self._counter)}"

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, name: str | None = None,
           outputs: Sequence[str] | None = None, domain: str = "", **attrs: object) -> str | list[str]:
        outs = list(outputs) if outputs else [self.fresh(name or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(name or op_type),
                                           domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def weight(self, name: str, array: np.ndarray) -> str:
        # np.ascontiguousarray would turn a 0-d scalar into shape (1,)
        self.initializers.append(numpy_helper.from_array(np.array(array, order="C", copy=True), name))
        return name

    def const(self, value: object, dtype: np.dtype | type = np.int64) -> str:
        """A deduplicated small constant (shapes, axes, scalars)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self.weight(self.fresh("const"), array)
        return self._constants[key]

    # Shorthands for the ops graph code uses most.
    def matmul(self, a: str, b: str) -> str:
        return self.op("MatMul", [a, b])

    def add(self, a: str, b: str) -> str:
        return self.op("Add", [a, b])

    def mul(self, a: str, b: str) -> str:
        return self.op("Mul", [a, b])

    def reshape(self, x: str, shape: Sequence[int] | str) -> str:
        return self.op("Reshape", [x, shape if isinstance(shape, str) else self.const(list(shape))])

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        return self.op("Transpose", [x], perm=list(perm))

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", [x, self.const(list(axes))])

    def split_halves(self, x: str, outputs: Sequence[str] | None = None) -> list[str]:
        """Two equal halves along the last axis."""
        return self.op("Split", [x], n_out=2, outputs=outputs, axis=-1, num_outputs=2)

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", [x], to=to)

    def dim(self, x: str, axis: int) -> str:
        """A 1-D int64 tensor holding x.shape[axis]."""
        return self.op("Shape", [x], start=axis, end=axis + 1)

    def rms_norm(self, x: str, weight: str, eps: float) -> str:
        # The Pow/ReduceMean/Sqrt/Div pattern is what onnxruntime fuses into SimplifiedLayerNormalization.
        variance = self.op("ReduceMean", [self.op("Pow", [x, self.const(2.0, np.float32)]),
                                          self.const([-1])], keepdims=1)
        denom = self.op("Sqrt", [self.add(variance, self.const(eps, np.float32))])
        return self.mul(self.op("Div", [x, denom]), weight)


def value_info(name: str, elem_type: int, shape: Sequence[int | str | None]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, list(shape))


FLOAT = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16
INT32 = TensorProto.INT32
INT64 = TensorProto.INT64
BOOL = TensorProto.BOOL
UINT8 = TensorProto.UINT8
FLOAT8E4M3FN = TensorProto.FLOAT8E4M3FN
