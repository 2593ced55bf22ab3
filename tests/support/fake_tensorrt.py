"""A fake `tensorrt` (+ `tensorrt.plugin`) and cuda driver that record what kvforge asks of them, for GPU-less tests.

It mirrors the real APIs' names, signatures and the checks that would fail a real build (QDP signature
schemas, aliased plugin I/O needing its preview feature, dynamic inputs without profile shapes, shapes
outside a profile), so a test passing here exercises the same calls a GPU machine would make.
"""

from __future__ import annotations

import ctypes
import enum
import inspect
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

# --- what the fake records ------------------------------------------------------------------------------------


@dataclass
class PluginRecord:
    plugin_id: str
    tensor_names: list[str]
    attrs: dict[str, type]
    register_func: Any
    aot_impl_func: Any = None


@dataclass
class Recorder:
    plugins: dict[str, PluginRecord] = field(default_factory=dict)
    network_flags: int | None = None
    parsed_path: str | None = None
    plugin_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)  # node name -> attributes
    aliased_outputs: dict[str, str] = field(default_factory=dict)  # plugin output tensor -> aliased input tensor
    network_inputs: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    preview_features: dict[str, bool] = field(default_factory=dict)
    memory_pools: dict[str, int] = field(default_factory=dict)
    profiles: list[dict[str, tuple[tuple[int, ...], ...]]] = field(default_factory=list)
    serialized: bytes | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)  # execute_async_v3 snapshots


# --- tensorrt enums and dtypes --------------------------------------------------------------------------------

class DataType(enum.Enum):
    FLOAT = "float32"
    HALF = "float16"
    INT8 = "int8"
    INT32 = "int32"
    INT64 = "int64"
    UINT8 = "uint8"
    BOOL = "bool"
    FP8 = "fp8"


ONNX_TO_TRT = {onnx.TensorProto.FLOAT: DataType.FLOAT, onnx.TensorProto.FLOAT16: DataType.HALF,
               onnx.TensorProto.INT32: DataType.INT32, onnx.TensorProto.INT64: DataType.INT64,
               onnx.TensorProto.UINT8: DataType.UINT8, onnx.TensorProto.BOOL: DataType.BOOL}


def nptype(dtype: DataType) -> type:
    return {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8,
            DataType.INT32: np.int32, DataType.INT64: np.int64, DataType.UINT8: np.uint8,
            DataType.BOOL: np.bool_}[dtype]


class Logger:
    VERBOSE, INFO, WARNING, ERROR, INTERNAL_ERROR = range(5)

    def __init__(self, min_severity: int = 2) -> None:
        self.min_severity = min_severity


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1
    PREFER_AOT_PYTHON_PLUGINS = 2
    PREFER_JIT_PYTHON_PLUGINS = 3


class PreviewFeature(enum.Enum):
    PROFILE_SHARING_0806 = 0
    ALIASED_PLUGIN_IO_10_03 = 1


class MemoryPoolType(enum.Enum):
    WORKSPACE = 0


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


# --- tensorrt.plugin: symbolic expressions ----------------------------------------------------------------------

class SymIntExpr:
    """Expression tree over named dims; `evaluate(env)` gives its value for concrete shapes."""

    def __init__(self, value: Any = None) -> None:
        if isinstance(value, SymIntExpr):
            self.node: Any = value.node
        elif isinstance(value, int | str):
            self.node = value  # int constant or named dim
        else:
            raise TypeError(f"unsupported SymIntExpr value {value!r}")

    def _op(self, op: str, other: Any) -> SymIntExpr:
        if not isinstance(other, SymIntExpr | int):
            raise TypeError(f"unsupported operand {other!r}")
        other_node = other.node if isinstance(other, SymIntExpr) else other
        return type(self)._wrap((op, self.node, other_node))

    @classmethod
    def _wrap(cls, node: Any) -> SymIntExpr:
        expr = cls.__new__(cls)
        expr.node = node
        return expr

    def __add__(self, other: Any) -> SymIntExpr:
        return self._op("+", other)

    def __sub__(self, other: Any) -> SymIntExpr:
        return self._op("-", other)

    def __mul__(self, other: Any) -> SymIntExpr:
        return self._op("*", other)

    def __floordiv__(self, other: Any) -> SymIntExpr:
        return self._op("//", other)

    def evaluate(self, env: dict[str, int]) -> int:
        return _eval(self.node, env)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.node!r})"


def _eval(node: Any, env: dict[str, int]) -> int:
    if isinstance(node, int):
        return node
    if isinstance(node, str):
        return env[node]
    op, a, b = node
    a, b = _eval(a, env), _eval(b, env)
    if b < 0 or a < 0:
        raise ValueError(f"negative intermediate dim in {node!r}")  # TensorRT dims must stay non-negative
    return {"+": a + b, "-": a - b, "*": a * b, "//": a // b, "cdiv": -(-a // b), "max": max(a, b),
            "min": min(a, b)}[op]


class SymInt32(SymIntExpr):
    pass


class ShapeExpr(SymInt32):
    pass


def cdiv(first: Any, second: Any) -> ShapeExpr:
    if isinstance(first, int) and isinstance(second, int):
        raise ValueError("Both arguments cannot be 'int's")
    return ShapeExpr(first)._op("cdiv", second)  # type: ignore[return-value]


class SymExprs:
    def __init__(self, length: int) -> None:
        self._exprs: list[Any] = [None] * length

    @classmethod
    def from_tuple(cls, exprs: Any) -> SymExprs:
        inst = cls(0)
        inst._exprs = [e if isinstance(e, SymIntExpr) else SymIntExpr(e) for e in exprs]
        return inst

    def __iter__(self) -> Any:
        return iter(self._exprs)

    def __len__(self) -> int:
        return len(self._exprs)

    def __getitem__(self, index: int) -> Any:
        return self._exprs[index]


class SymIntExprs(SymExprs):
    pass


class ShapeExprs(SymExprs):
    pass


class KernelLaunchParams:
    _FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self) -> None:
        for name in self._FIELDS:
            object.__setattr__(self, name, SymInt32(0 if name == "shared_mem" else 1))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._FIELDS:
            raise AttributeError(f"KernelLaunchParams object has no attribute '{name}'")
        object.__setattr__(self, name, SymInt32(value))  # like the real class: wrapped in SymInt32


class TensorDesc:
    def __init__(self, shape_expr: ShapeExprs | None = None, dtype: DataType | None = None) -> None:
        self.shape_expr = shape_expr
        self.dtype = dtype
        self._aliased_to: TensorDesc | None = None

    def like(self) -> TensorDesc:
        return TensorDesc(self.shape_expr, self.dtype)

    def aliased(self) -> TensorDesc:
        desc = self.like()
        desc._aliased_to = self
        return desc

    def get_aliased(self) -> TensorDesc | None:
        return self._aliased_to

    @property
    def is_aliased(self) -> bool:
        return self._aliased_to is not None


def tensor_desc(shape: list[int | str], dtype: DataType) -> TensorDesc:
    """A TensorDesc whose dims are constants or named symbols (test helper)."""
    return TensorDesc(ShapeExprs.from_tuple([ShapeExpr(d) for d in shape]), dtype)


# --- tensorrt.plugin: registration ------------------------------------------------------------------------------

SERIALIZABLE = (int, float, bytes, bool, str)


class _Namespace(types.SimpleNamespace):
    pass


def _make_plugin_module(trt: types.ModuleType, recorder: Recorder) -> types.ModuleType:
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.op = _Namespace()

    def register(plugin_id: str, lazy_register: bool = False) -> Any:
        def decorator(func: Any) -> Any:
            namespace, name = plugin_id.split("::")
            ns = getattr(trtp.op, namespace, None) or _Namespace()
            if hasattr(ns, name):
                raise ValueError(f"'op' already has a defintion for '{name}'")
            tensors, attrs = _parse_register(func, trtp.TensorDesc)
            setattr(ns, name, func)
            setattr(trtp.op, namespace, ns)
            recorder.plugins[plugin_id] = PluginRecord(plugin_id, tensors, attrs, func)
            return func
        return decorator

    def aot_impl(plugin_id: str) -> Any:
        def decorator(func: Any) -> Any:
            if plugin_id not in recorder.plugins:
                raise ValueError(f"Plugin {plugin_id} is not registered")
            record = recorder.plugins[plugin_id]
            _validate_aot(func, record, trtp)
            record.aot_impl_func = func
            return func
        return decorator

    for name, value in {"register": register, "aot_impl": aot_impl, "TensorDesc": TensorDesc, "ShapeExpr": ShapeExpr,
                        "ShapeExprs": ShapeExprs, "SymInt32": SymInt32, "SymIntExprs": SymIntExprs,
                        "SymExprs": SymExprs, "KernelLaunchParams": KernelLaunchParams, "cdiv": cdiv}.items():
        setattr(trtp, name, value)
    return trtp


def _parse_register(func: Any, tensor_desc_cls: type) -> tuple[list[str], dict[str, type]]:
    """The checks tensorrt.plugin._validate._parse_register_inputs/_return make on a register function."""
    sig = inspect.signature(func)
    tensors, attrs = [], {}
    for name, param in sig.parameters.items():
        annotation = param.annotation
        if annotation is inspect.Parameter.empty or isinstance(annotation, str):
            raise ValueError(f"Argument {name} needs a real type annotation (got {annotation!r})")
        if param.default is not inspect.Parameter.empty:
            raise ValueError(f"Argument {name} has a default value")
        if inspect.isclass(annotation) and issubclass(annotation, tensor_desc_cls):
            if attrs:
                raise ValueError("TensorDescs args and attribute args cannot be interspersed")
            tensors.append(name)
        elif annotation in SERIALIZABLE:
            attrs[name] = annotation
        else:
            raise ValueError(f"Attribute '{name}' of type {annotation} is not a supported serializable type")
    ret = sig.return_annotation
    if not (inspect.isclass(ret) and issubclass(ret, tensor_desc_cls)) and typing.get_origin(ret) is not tuple:
        raise ValueError(f"Return argument is of type {ret}")
    return tensors, attrs


def _validate_aot(func: Any, record: PluginRecord, trtp: types.ModuleType) -> None:
    """The schema tensorrt.plugin checks: (inputs..., attrs in register order, outputs, tactic) -> 4-tuple."""
    sig = inspect.signature(func)
    expected = [*record.tensor_names, *record.attrs, "outputs", "tactic"]
    if list(sig.parameters) != expected:
        raise ValueError(f"aot_impl signature {list(sig.parameters)} does not match {expected}")
    for name, param in sig.parameters.items():
        if name in record.attrs and param.annotation is not inspect.Parameter.empty \
                and param.annotation != record.attrs[name]:
            raise ValueError(f"Attribute '{name}' annotation differs from registration")
    ret = sig.return_annotation
    args = typing.get_args(ret)
    if typing.get_origin(ret) is not tuple or len(args) != 4 or args[2] is not trtp.KernelLaunchParams \
            or not issubclass(args[3], trtp.SymExprs):
        raise ValueError(f"aot_impl return annotation {ret} is not tuple[str | bytes, str | bytes, "
                         "KernelLaunchParams, SymIntExprs]")


# --- tensorrt: network, parser, builder ------------------------------------------------------------------------

@dataclass
class FakeTensor:
    name: str
    shape: tuple[int, ...]
    dtype: DataType


class FakeNetwork:
    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.inputs: list[FakeTensor] = []
        self.outputs: list[FakeTensor] = []
        self.aliased_plugin_io = False

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_input(self, index: int) -> FakeTensor:
        return self.inputs[index]

    def get_output(self, index: int) -> FakeTensor:
        return self.outputs[index]


@dataclass
class FakeParserError:
    _desc: str
    _node_name: str
    _op: str
    _node: int = -1

    def desc(self) -> str:
        return self._desc

    def node_name(self) -> str:
        return self._node_name

    def node_operator(self) -> str:
        return self._op

    def node(self) -> int:
        return self._node


RESERVED_PLUGIN_ATTRS = {"plugin_namespace", "plugin_version", "aot"}


class OnnxParser:
    def __init__(self, network: FakeNetwork, logger: Logger, *, recorder: Recorder, trtp: Any) -> None:
        self.network, self.recorder, self.trtp = network, recorder, trtp
        self.errors: list[FakeParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> FakeParserError:
        return self.errors[index]

    def parse_from_file(self, path: str) -> bool:
        self.recorder.parsed_path = path
        model = onnx.load(path)  # external weights resolve next to the file, as TensorRT's parser does
        descs = {}
        for vi in model.graph.input:
            tensor = _fake_tensor(vi)
            self.network.inputs.append(tensor)
            self.recorder.network_inputs[tensor.name] = (tensor.dtype.value, tensor.shape)
            descs[vi.name] = tensor_desc([d if d >= 0 else f"{vi.name}.{i}" for i, d in enumerate(tensor.shape)],
                                         tensor.dtype)
        self.network.outputs = [_fake_tensor(vi) for vi in model.graph.output]
        for index, node in enumerate(model.graph.node):
            if node.domain not in ("", "ai.onnx") and not self._import_plugin(index, node, descs):
                return False
        return True

    def _import_plugin(self, index: int, node: onnx.NodeProto, descs: dict[str, TensorDesc]) -> bool:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        namespace = attrs.get("plugin_namespace", b"")
        namespace = namespace.decode() if isinstance(namespace, bytes) else namespace
        record = self.recorder.plugins.get(f"{namespace}::{node.op_type}")
        if record is None:
            self.errors.append(FakeParserError(f"Plugin not found, are the plugin name, version, and namespace "
                                               f"correct? ({namespace}::{node.op_type})", node.name, node.op_type,
                                               index))
            return False
        fields = {k: v for k, v in attrs.items() if k not in RESERVED_PLUGIN_ATTRS}
        if set(fields) != set(record.attrs):
            self.errors.append(FakeParserError(f"attributes {sorted(fields)} != plugin fields {sorted(record.attrs)}",
                                               node.name, node.op_type, index))
            return False
        self.recorder.plugin_nodes[node.name] = attrs
        inputs = [descs.get(name) or tensor_desc([f"{name}.0"], DataType.FLOAT) for name in node.input]
        out = record.register_func(*inputs, *(record.attrs[k](fields[k]) for k in record.attrs))
        aliased = out.get_aliased()
        if aliased is not None:
            self.network.aliased_plugin_io = True
            self.recorder.aliased_outputs[node.output[0]] = node.input[inputs.index(aliased)]
        descs[node.output[0]] = out
        return True


def _fake_tensor(vi: onnx.ValueInfoProto) -> FakeTensor:
    tensor_type = vi.type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
    return FakeTensor(vi.name, shape, ONNX_TO_TRT[tensor_type.elem_type])


class FakeProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[tuple[int, ...], ...]] = {}

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:  # noqa: A002 - TensorRT's names
        shapes = tuple(tuple(int(d) for d in s) for s in (min, opt, max))
        if len({len(s) for s in shapes}) != 1 or not all(a <= b <= c for a, b, c in zip(*shapes, strict=True)):
            raise ValueError(f"profile shapes of {input} are not min <= opt <= max: {shapes}")
        self.shapes[input] = shapes


class FakeBuilderConfig:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.profiles: list[FakeProfile] = []

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        self.recorder.memory_pools[pool.name] = pool_size

    def set_preview_feature(self, feature: PreviewFeature, enable: bool) -> None:
        self.recorder.preview_features[feature.name] = enable

    def add_optimization_profile(self, profile: FakeProfile) -> int:
        self.profiles.append(profile)
        self.recorder.profiles.append(dict(profile.shapes))
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger: Logger, *, recorder: Recorder) -> None:
        self.recorder = recorder

    def create_network(self, flags: int = 0) -> FakeNetwork:
        self.recorder.network_flags = flags
        return FakeNetwork(flags)

    def create_builder_config(self) -> FakeBuilderConfig:
        return FakeBuilderConfig(self.recorder)

    def create_optimization_profile(self) -> FakeProfile:
        return FakeProfile()

    def build_serialized_network(self, network: FakeNetwork, config: FakeBuilderConfig) -> bytes | None:
        """The checks behind real build failures, then a JSON 'engine' the fake runtime can load."""
        if network.aliased_plugin_io and not self.recorder.preview_features.get("ALIASED_PLUGIN_IO_10_03"):
            raise RuntimeError("Aliased I/O used by plugin but PreviewFeature::kALIASED_PLUGIN_IO_10_03 not enabled")
        if not config.profiles and any(-1 in t.shape for t in network.inputs):
            return None
        for index, profile in enumerate(config.profiles):
            for tensor in network.inputs:
                shapes = profile.shapes.get(tensor.name)
                if shapes is None:
                    if -1 in tensor.shape:
                        raise RuntimeError(f"profile {index} has no shape for dynamic input {tensor.name}")
                    continue
                for shape in shapes:
                    if len(shape) != len(tensor.shape) or any(d not in (-1, s) for d, s in zip(tensor.shape, shape,
                                                                                               strict=True)):
                        raise RuntimeError(f"profile {index} shape {shape} of {tensor.name} contradicts {tensor.shape}")
        engine = {"inputs": {t.name: [t.dtype.name, list(t.shape)] for t in network.inputs},
                  "outputs": {t.name: [t.dtype.name, list(t.shape)] for t in network.outputs},
                  "profiles": [{k: [list(s) for s in v] for k, v in p.shapes.items()} for p in config.profiles]}
        self.recorder.serialized = b"FAKETRT" + json.dumps(engine).encode()
        return self.recorder.serialized


# --- tensorrt: runtime ------------------------------------------------------------------------------------------

class FakeEngine:
    def __init__(self, spec: dict[str, Any], recorder: Recorder) -> None:
        self.spec, self.recorder = spec, recorder
        self.names = [*spec["inputs"], *spec["outputs"]]

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode.INPUT if name in self.spec["inputs"] else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> DataType:
        entry = self.spec["inputs"].get(name) or self.spec["outputs"][name]
        return DataType[entry[0]]

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        return [tuple(s) for s in self.spec["profiles"][profile_index][name]]

    def create_execution_context(self) -> FakeContext:
        return FakeContext(self)


class FakeContext:
    """Records each call; its 'kernel' marks the new tokens' KV slots as the PagedKVWrite plugin would."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.profile = 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        self.profile = profile_index
        self.shapes.clear()  # switching profiles invalidates the input shapes
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        low, _, high = self.engine.spec["profiles"][self.profile][name]
        if len(shape) != len(low) or not all(a <= s <= b for a, s, b in zip(low, shape, high, strict=True)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, memory: int) -> bool:
        self.addresses[name] = int(memory)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        """Inputs as set; outputs as built, a dynamic leading dim taken from the first input (encoder engines)."""
        if name in self.engine.spec["inputs"]:
            return self.shapes[name]
        first = self.shapes[next(iter(self.engine.spec["inputs"]))]
        shape = self.engine.spec["outputs"][name][1]
        return tuple(first[0] if i == 0 and d == -1 else d for i, d in enumerate(shape))

    def execute_async_v3(self, stream_handle: int) -> bool:
        inputs = self.engine.spec["inputs"]
        missing = [n for n in self.engine.names if n not in self.addresses] + \
                  [n for n in inputs if n not in self.shapes]
        if missing:
            raise RuntimeError(f"unbound tensors: {missing}")
        if "kv_page_table" not in inputs:
            return self._encoder_kernel()
        read = {n: self._read(n) for n in ("context_lengths", "kvcache_start_index", "kv_page_table",
                                           "logits_indices", "last_token_ids") if n in inputs}
        self.engine.recorder.calls.append({"profile": self.profile, "shapes": dict(self.shapes),
                                           "addresses": dict(self.addresses), **read})
        self._mark_new_tokens(read)
        return True

    def _encoder_kernel(self) -> bool:
        """An encoder engine: record the inputs as uploaded; every output row of item i holds i + 1."""
        read = {n: self._read(n) for n in self.engine.spec["inputs"]}
        self.engine.recorder.calls.append({"profile": self.profile, "shapes": dict(self.shapes), "inputs": read})
        for name in self.engine.spec["outputs"]:
            shape = self.get_tensor_shape(name)
            out = np.empty(shape, nptype(self.engine.get_tensor_dtype(name)))
            out[...] = (np.arange(shape[0]) + 1).reshape(-1, *[1] * (len(shape) - 1))
            ctypes.memmove(self.addresses[name], out.ctypes.data, out.nbytes)
        return True

    def _read(self, name: str) -> np.ndarray:
        dtype = nptype(self.engine.get_tensor_dtype(name))
        shape = self.shapes[name]
        out = np.empty(shape, dtype)
        ctypes.memmove(out.ctypes.data, self.addresses[name], out.nbytes)
        return out

    def _mark_new_tokens(self, read: dict[str, np.ndarray]) -> None:
        """Write 1 + position into K of each new token, in the *input* pool buffer (in place)."""
        for name in self.engine.spec["inputs"]:
            if not name.startswith("past_key_values_"):
                continue
            dtype = nptype(self.engine.get_tensor_dtype(name))
            pages, _, heads, tokens, dim = self.shapes[name]
            pool = np.ctypeslib.as_array(ctypes.cast(self.addresses[name], ctypes.POINTER(ctypes.c_uint8)),
                                         shape=(pages * 2 * heads * tokens * dim * np.dtype(dtype).itemsize,))
            pool = pool.view(dtype).reshape(pages, 2, heads, tokens, dim)
            for b, (start, length) in enumerate(zip(read["kvcache_start_index"], read["context_lengths"],
                                                    strict=True)):
                for pos in range(int(start), int(start) + int(length)):
                    page = read["kv_page_table"][b, pos // tokens]
                    if page >= 0:
                        pool[page, 0, :, pos % tokens, :] = 1 + pos


class Runtime:
    def __init__(self, logger: Logger, *, recorder: Recorder) -> None:
        self.recorder = recorder

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> FakeEngine | None:
        data = bytes(serialized_engine)
        if not data.startswith(b"FAKETRT"):
            return None
        return FakeEngine(json.loads(data[len(b"FAKETRT"):]), self.recorder)


# --- module assembly --------------------------------------------------------------------------------------------

def make_fake_tensorrt(recorder: Recorder) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.13.0-fake"
    trt.__path__ = []  # a package, so `import tensorrt.plugin` resolves through sys.modules
    for name, value in {"DataType": DataType, "Logger": Logger, "NetworkDefinitionCreationFlag":
                        NetworkDefinitionCreationFlag, "PreviewFeature": PreviewFeature,
                        "MemoryPoolType": MemoryPoolType, "TensorIOMode": TensorIOMode, "nptype": nptype}.items():
        setattr(trt, name, value)
    for alias, member in {"float32": DataType.FLOAT, "float16": DataType.HALF, "int32": DataType.INT32,
                          "int64": DataType.INT64, "uint8": DataType.UINT8, "fp8": DataType.FP8,
                          "bool": DataType.BOOL}.items():
        setattr(trt, alias, member)
    trt.plugin = _make_plugin_module(trt, recorder)
    trt.Builder = lambda logger: Builder(logger, recorder=recorder)
    trt.OnnxParser = lambda network, logger: OnnxParser(network, logger, recorder=recorder, trtp=trt.plugin)
    trt.Runtime = lambda logger: Runtime(logger, recorder=recorder)
    return trt


def install(monkeypatch: Any) -> Recorder:
    """Put a fresh fake `tensorrt` and `tensorrt.plugin` in sys.modules for one test."""
    recorder = Recorder()
    trt = make_fake_tensorrt(recorder)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trt.plugin)
    return recorder


# --- a fake cuda.bindings.driver over host memory ------------------------------------------------------------------

class FakeCudaDriver:
    """cuda-python driver calls over numpy buffers: 'device pointers' are host addresses, copies are memmoves."""

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray] = {}
        self.ok = self.CUresult.CUDA_SUCCESS

    def cuInit(self, flags: int) -> tuple:  # noqa: N802 - cuda-python's names
        return (self.ok,)

    def cuDeviceGet(self, ordinal: int) -> tuple:  # noqa: N802
        return self.ok, ordinal

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:  # noqa: N802
        return self.ok, object()

    def cuCtxSetCurrent(self, ctx: Any) -> tuple:  # noqa: N802
        return (self.ok,)

    def cuStreamCreate(self, flags: int) -> tuple:  # noqa: N802
        return self.ok, 7

    def cuStreamSynchronize(self, stream: Any) -> tuple:  # noqa: N802
        return (self.ok,)

    def cuStreamDestroy(self, stream: Any) -> tuple:  # noqa: N802
        return (self.ok,)

    def cuMemAlloc(self, bytesize: int) -> tuple:  # noqa: N802
        buffer = np.full(bytesize, 0xAB, dtype=np.uint8)  # garbage, like fresh device memory
        self.buffers[buffer.ctypes.data] = buffer
        return self.ok, buffer.ctypes.data

    def cuMemFree(self, dptr: int) -> tuple:  # noqa: N802
        self.buffers.pop(int(dptr))
        return (self.ok,)

    def _check(self, ptr: int, nbytes: int) -> None:
        if not any(base <= ptr and ptr + nbytes <= base + b.nbytes for base, b in self.buffers.items()):
            raise AssertionError(f"device access [{ptr:#x}, +{nbytes}) outside any allocation")

    def cuMemcpyHtoDAsync(self, dst: int, src: int, nbytes: int, stream: Any) -> tuple:  # noqa: N802
        self._check(int(dst), nbytes)
        ctypes.memmove(int(dst), src, nbytes)
        return (self.ok,)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, nbytes: int, stream: Any) -> tuple:  # noqa: N802
        self._check(int(src), nbytes)
        ctypes.memmove(dst, int(src), nbytes)
        return (self.ok,)

    def cuMemsetD8Async(self, dst: int, value: int, count: int, stream: Any) -> tuple:  # noqa: N802
        self._check(int(dst), count)
        ctypes.memset(int(dst), value, count)
        return (self.ok,)
