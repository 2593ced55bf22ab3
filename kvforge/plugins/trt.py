"""TensorRT plugins for the paged-KV ops: quickly deployable plugins (QDPs) whose AOT kernels come from NVRTC."""

# No `from __future__ import annotations` here: tensorrt.plugin inspects the *objects* in the decorated
# functions' annotations (issubclass(annotation, TensorDesc)), and postponed annotations would be strings.

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.plugins import ops

INSTALL_HINT = "pip install 'kvforge[tensorrt]' on a machine with an NVIDIA GPU"
KV_WRITE_ID = f"{ops.DOMAIN}::{ops.PAGED_KV_WRITE.name}"
ATTENTION_ID = f"{ops.DOMAIN}::{ops.PAGED_ATTENTION.name}"
# Node attributes the ONNX parser reads to map a node to a QDP and to prefer its AOT implementation
# (TensorRT samples/python/quickly_deployable_plugins README, "ONNX model with an AOT plugin").
PLUGIN_NAMESPACE_ATTR = "plugin_namespace"
AOT_ATTR = "aot"


# --- the one guarded import ---------------------------------------------------------------------------------

def require_tensorrt() -> ModuleType:
    """`tensorrt` with `tensorrt.plugin` loaded, or a one-line error naming the install command."""
    try:
        import tensorrt
        import tensorrt.plugin  # noqa: F401 - the QDP API is a submodule
    except ImportError:
        raise InvalidConfig(f"TensorRT is not installed ({INSTALL_HINT}); use --backend onnxruntime",
                            "backend") from None
    if not hasattr(tensorrt.plugin, "aot_impl"):
        version = getattr(tensorrt, "__version__", "?")
        raise InvalidConfig(f"TensorRT {version} lacks tensorrt.plugin.aot_impl (AOT plugins need TensorRT >= 10.9); "
                            "upgrade with pip install -U 'kvforge[tensorrt]'", "backend")
    return tensorrt


def tensorrt_importable() -> bool:
    try:
        require_tensorrt()
    except KvforgeError:
        return False
    return True


def require_cuda_driver() -> ModuleType:
    """cuda-python's driver bindings (`cuda.bindings.driver`), or a one-line error."""
    try:
        from cuda.bindings import driver
    except ImportError:
        raise InvalidConfig(f"cuda-python is not installed ({INSTALL_HINT})", "backend") from None
    return driver


def cuda_device_count() -> int:
    """Visible CUDA devices; 0 when cuda-python, the driver (libcuda) or a device is missing."""
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, count = driver.cuDeviceGetCount()
        return int(count) if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:  # ImportError, or RuntimeError "Failed to dlopen libcuda.so.1" on GPU-less machines
        return 0


def build_gpu_arch(device: int = 0) -> str:
    """`sm_XY` of the GPU TensorRT builds on (the AOT PTX is compiled for it; PTX JITs forward)."""
    driver = require_cuda_driver()
    err, = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise InvalidConfig(f"cannot initialise CUDA ({err}); is an NVIDIA GPU and driver present?", "backend")
    err, dev = driver.cuDeviceGet(device)
    attr = driver.CUdevice_attribute
    _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return f"sm_{major}{minor}"


# --- symbolic dims: kernel_specs' integer arithmetic, replayed on TensorRT shape expressions ------------------

class SymDim:
    """A runtime shape dim that `kernel_specs` launch functions compute on as if it were an int.

    Launch geometry is a function of shapes; in an AOT plugin TensorRT wants it as expressions of the input
    shape expressions, evaluated per call. Running the same integer code on SymDims records the expression
    once, so the launch math lives only in kernel_specs. Branching on a runtime dim cannot be recorded and
    raises instead of silently baking in one shape.
    """

    __slots__ = ("op", "args")

    def __init__(self, op: str, *args: Any) -> None:
        self.op, self.args = op, args

    @staticmethod
    def leaf(name: str, expr: Any = None) -> "SymDim":
        return SymDim("leaf", name, expr)

    def __add__(self, other: "int | SymDim") -> "int | SymDim":
        return _fold("add", self, other)

    def __radd__(self, other: int) -> "int | SymDim":
        return _fold("add", other, self)

    def __sub__(self, other: "int | SymDim") -> "int | SymDim":
        return _fold("sub", self, other)

    def __rsub__(self, other: int) -> "int | SymDim":
        return _fold("sub", other, self)

    def __mul__(self, other: "int | SymDim") -> "int | SymDim":
        return _fold("mul", self, other)

    def __rmul__(self, other: int) -> "int | SymDim":
        return _fold("mul", other, self)

    def __floordiv__(self, other: "int | SymDim") -> "int | SymDim":
        return _fold("floordiv", self, other)

    def __rfloordiv__(self, other: int) -> "int | SymDim":
        return _fold("floordiv", other, self)

    def __neg__(self) -> "int | SymDim":
        return _fold("sub", 0, self)

    def __pos__(self) -> "SymDim":
        return self

    def _branch(self, *_: Any) -> bool:
        raise TypeError(f"kernel_specs branches on the runtime dim {self!r}; an AOT plugin's launch geometry must "
                        "be arithmetic (+ - * // and ceil-div) of the shapes")

    __bool__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = __int__ = __index__ = _branch
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        if self.op == "leaf":
            return str(self.args[0])
        a, b = self.args
        return f"({a!r} {_SYMBOLS[self.op]} {b!r})"

    def evaluate(self, env: dict[str, int]) -> int:
        """The value for concrete leaf values (tests and host-side checks)."""
        if self.op == "leaf":
            return env[self.args[0]]
        a, b = (x.evaluate(env) if isinstance(x, SymDim) else x for x in self.args)
        return _INT_OPS[self.op](a, b)


_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "floordiv": "//"}
_INT_OPS = {"add": int.__add__, "sub": int.__sub__, "mul": int.__mul__, "floordiv": int.__floordiv__}


def _fold(op: str, a: "int | SymDim", b: "int | SymDim") -> "int | SymDim":
    if not isinstance(a, SymDim | int) or not isinstance(b, SymDim | int):
        return NotImplemented
    if isinstance(a, int) and isinstance(b, int):
        return _INT_OPS[op](a, b)
    # Identities only; SymDim's == raises (it is a branch), so constants are tested as ints.
    if isinstance(b, int) and ((op in ("add", "sub") and b == 0) or (op in ("mul", "floordiv") and b == 1)):
        return a
    if isinstance(a, int) and ((op == "add" and a == 0) or (op == "mul" and a == 1)):
        return b
    return SymDim(op, a, b)


def evaluate(value: "int | SymDim", env: dict[str, int]) -> int:
    return value.evaluate(env) if isinstance(value, SymDim) else value


def to_trt_expr(value: "int | SymDim", trtp: ModuleType) -> Any:
    """Lower to tensorrt.plugin expressions; `-(-a // b)` (ceil-div) becomes `trtp.cdiv`, so no negative
    intermediate dims reach TensorRT."""
    if isinstance(value, int):
        return value
    if value.op == "leaf":
        return value.args[0] if value.args[1] is None else value.args[1]
    ceil = _ceil_div_operands(value)
    if ceil is not None:
        num, den = (to_trt_expr(x, trtp) for x in ceil)
        return trtp.cdiv(num, den)
    a, b = (to_trt_expr(x, trtp) for x in value.args)
    if isinstance(a, int):  # int on the left: commute, or make the constant an expression
        if value.op in ("add", "mul"):
            a, b = b, a
        else:
            a = trtp.ShapeExpr(a)
    return {"add": a.__add__, "sub": a.__sub__, "mul": a.__mul__, "floordiv": a.__floordiv__}[value.op](b)


def _ceil_div_operands(value: SymDim) -> "tuple[int | SymDim, int | SymDim] | None":
    """(a, b) when `value` is 0 - ((0 - a) // b)."""
    def is_negation(x: object) -> bool:
        return isinstance(x, SymDim) and x.op == "sub" and isinstance(x.args[0], int) and x.args[0] == 0

    if not is_negation(value):
        return None
    inner = value.args[1]
    if not isinstance(inner, SymDim) or inner.op != "floordiv" or not is_negation(inner.args[0]):
        return None
    return inner.args[0].args[1], inner.args[1]


# --- launch geometry from kernel_specs -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SymbolicLaunch:
    """kernel_specs.KernelLaunch with SymDim entries where the value depends on runtime shapes."""

    kernel: str
    grid: tuple
    block: tuple
    shared_bytes: int
    scalar_args: tuple

    def evaluate(self, env: dict[str, int]) -> dict[str, Any]:
        return {"kernel": self.kernel, "grid": tuple(evaluate(v, env) for v in self.grid),
                "block": tuple(self.block), "shared_bytes": self.shared_bytes,
                "scalar_args": tuple(evaluate(v, env) for v in self.scalar_args)}


def _symbolic(base: Any, probe: Any, grid: tuple, names: tuple[str, ...], runtime: dict[str, Any]) -> SymbolicLaunch:
    """Kernel, block, shared memory and constant scalars from a concrete launch (`base`); grid and the runtime
    scalars symbolic. `probe` is the same launch at other shapes: anything that moved with the shapes but is
    not symbolic here would be baked in wrongly, so it is refused."""
    pairs = zip(names, base.scalar_args, probe.scalar_args, strict=True)
    moved = [name for name, a, b in pairs if a != b and name not in runtime]
    if (base.kernel, base.block, base.shared_bytes) != (probe.kernel, probe.block, probe.shared_bytes) or moved:
        raise KvforgeError(f"{base.kernel}: launch fields {moved or 'kernel/block/shared memory'} depend on runtime "
                           "shapes that the AOT plugin does not express", "kvforge/plugins/kernel_specs.py")
    scalars = tuple(runtime.get(name, value) for name, value in zip(names, base.scalar_args, strict=True))
    return SymbolicLaunch(base.kernel, tuple(grid), tuple(base.block), base.shared_bytes, scalars)


def kv_write_symbolic_launch(batch: Any, seq_len: Any, pages_per_seq: Any, capacity: Any, *, num_kv_heads: int,
                             head_dim: int, tokens_per_page: int, kv_cache_dtype: str) -> SymbolicLaunch:
    """The kv-write launch as expressions of the runtime shapes (ints in, ints out, too)."""
    from kvforge.plugins import kernel_specs as ks

    def at(b: int, s: int, p: int, c: int) -> Any:
        return ks.kv_write_launch(b, s, num_kv_heads, head_dim, tokens_per_page, p, c, kv_cache_dtype)

    grid = ks.grid_expressions("kv_write", batch=batch, seq_len=seq_len, num_q_heads=num_kv_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim)
    runtime = {"seq_len": seq_len, "pages_per_seq": pages_per_seq, "capacity": capacity}
    return _symbolic(at(1, 1, 1, 1), at(2, 3, 2, 3), grid, ks.KV_WRITE_SCALAR_ARGS, runtime)


def attention_symbolic_launch(batch: Any, seq_len: Any, pages_per_seq: Any, *, num_q_heads: int, num_kv_heads: int,
                              head_dim: int, tokens_per_page: int, scale: float,
                              kv_cache_dtype: str) -> SymbolicLaunch:
    """The attention launch as expressions of the runtime shapes.

    An AOT plugin embeds one kernel for every shape its profiles allow, so this is the tiled ("prefill")
    kernel, correct for any seq_len; kernel_specs' "auto" would switch to the decode kernel at seq_len 1,
    a choice only a runtime (or a per-profile tactic) can make.
    """
    from kvforge.plugins import kernel_specs as ks

    def at(b: int, s: int, p: int) -> Any:
        return ks.attention_launch(b, s, num_q_heads, num_kv_heads, head_dim, tokens_per_page, p, kv_cache_dtype,
                                   scale=scale, variant="prefill")

    grid = ks.grid_expressions("prefill", batch=batch, seq_len=seq_len, num_q_heads=num_q_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim)
    runtime = {"seq_len": seq_len, "pages_per_seq": pages_per_seq}
    return _symbolic(at(1, 1, 1), at(2, 3, 2), grid, ks.ATTENTION_SCALAR_ARGS, runtime)


# --- calling convention ----------------------------------------------------------------------------------------

def trt_kernel_params(schema: ops.OpSchema, num_scalars: int, aliases: dict[str, str]) -> list[str]:
    """The parameter list TensorRT's AOT launcher passes: input pointers, the extra scalar args, then output
    pointers (tensorrt.plugin.aot_impl docs: extra args sit "after the tensor inputs and before the tensor
    outputs"). An aliased output names its input, since both are the same buffer."""
    inputs = [aliases.get(name, name) for name in schema.inputs]
    outputs = [aliases.get(name, name) for name in schema.outputs]
    return [*inputs, *(f"scalar{i}" for i in range(num_scalars)), *outputs]


def kernel_params(tensor_args: tuple[str, ...], num_scalars: int, aliases: dict[str, str]) -> list[str]:
    """The parameter list a kernel_specs kernel declares: its tensor pointers, then its int32 scalars."""
    return [*(aliases.get(name, name) for name in tensor_args), *(f"scalar{i}" for i in range(num_scalars))]


def check_calling_convention(schema: ops.OpSchema, tensor_args: tuple[str, ...], num_scalars: int,
                             aliases: dict[str, str]) -> None:
    """Refuse a build whose kernel would read its arguments from the wrong slots (no error, just garbage).

    A trailing pointer TensorRT passes beyond the kernel's declared parameters is harmless: cuLaunchKernel
    reads only as many kernelParams entries as the kernel image declares.
    """
    passed = trt_kernel_params(schema, num_scalars, aliases)
    declared = kernel_params(tensor_args, num_scalars, aliases)
    if passed[:len(declared)] != declared:
        raise KvforgeError(f"kernel parameters of {schema.name} are ({', '.join(declared)}) but TensorRT's AOT "
                           f"launcher passes ({', '.join(passed)}); declare the outputs after the scalars",
                           "kvforge/plugins/kernel_specs.py")


KV_WRITE_ALIASES = {"past_key_values": "pool", "present_key_values": "pool"}
ATTENTION_ALIASES = {"present_key_values": "pool"}


# --- PTX ------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def kernels_ptx(arch: str) -> bytes:
    """PTX of every kvforge kernel for `arch` ("sm_90"), compiled once per build (both plugins share it)."""
    from kvforge.plugins import nvrtc
    available, why = nvrtc.nvrtc_available()
    if not available:
        raise InvalidConfig(f"cannot compile the paged-KV kernels: {why}", "backend")
    # PTX text without a trailing NUL, like the str.encode() of the TensorRT AOT samples.
    return nvrtc.compile_kernels(arch, emit="ptx").image


# --- registration ----------------------------------------------------------------------------------------------

def kv_cache_dtype_of(trt: ModuleType, dtype: Any) -> str:
    """The pool's storage dtype as kernel_specs names it: FP8 pools are bytes (uint8) in the graph."""
    if dtype == trt.float16:
        return "fp16"
    if dtype == trt.uint8 or dtype == getattr(trt, "fp8", object()):
        return "fp8"
    raise KvforgeError(f"the TensorRT kernels store the KV pool as fp16 or fp8, not {dtype}", "kv_cache_dtype")


def register_plugins(arch: str | None = None) -> None:
    """Register both QDPs with TensorRT; calling again is a no-op. `arch` overrides the PTX target."""
    trt = require_tensorrt()
    trtp = trt.plugin
    if _registered(trtp, ops.PAGED_KV_WRITE.name) and _registered(trtp, ops.PAGED_ATTENTION.name):
        return
    ptx = _ptx_source(arch)
    if not _registered(trtp, ops.PAGED_KV_WRITE.name):
        _register_kv_write(trt, trtp, ptx)
    if not _registered(trtp, ops.PAGED_ATTENTION.name):
        _register_attention(trt, trtp, ptx)


def _registered(trtp: ModuleType, name: str) -> bool:
    # `trtp.op.<namespace>.<name>` is the registry tensorrt.plugin.register fills; a second register raises.
    namespace = getattr(trtp.op, ops.DOMAIN, None)
    return namespace is not None and getattr(namespace, name, None) is not None


def _ptx_source(arch: str | None) -> Callable[[], bytes]:
    # Compiled lazily from inside aot_impl: TensorRT calls it during the build, on the build GPU.
    return lambda: kernels_ptx(arch or build_gpu_arch())


def _register_kv_write(trt: ModuleType, trtp: ModuleType, ptx: Callable[[], bytes]) -> None:
    TensorDesc = trtp.TensorDesc  # noqa: N806 - the annotations must be the real class objects

    def paged_kv_write(key: TensorDesc, value: TensorDesc, rope_rotary_cos_sin: TensorDesc,
                       context_lengths: TensorDesc, kvcache_start_index: TensorDesc, kv_page_table: TensorDesc,
                       past_key_values: TensorDesc, num_kv_heads: int, head_dim: int,
                       tokens_per_page: int) -> TensorDesc:
        return past_key_values.aliased()  # in place: the pool output is the pool input's buffer

    trtp.register(KV_WRITE_ID)(paged_kv_write)

    def paged_kv_write_aot(key, value, rope_rotary_cos_sin, context_lengths, kvcache_start_index, kv_page_table,
                           past_key_values, num_kv_heads: int, head_dim: int, tokens_per_page: int, outputs,
                           tactic) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        from kvforge.plugins import kernel_specs
        launch = kv_write_symbolic_launch(
            SymDim.leaf("batch", key.shape_expr[0]), SymDim.leaf("seq_len", key.shape_expr[1]),
            SymDim.leaf("pages_per_seq", kv_page_table.shape_expr[1]),
            SymDim.leaf("capacity", rope_rotary_cos_sin.shape_expr[0]), num_kv_heads=num_kv_heads,
            head_dim=head_dim, tokens_per_page=tokens_per_page,
            kv_cache_dtype=kv_cache_dtype_of(trt, past_key_values.dtype))
        check_calling_convention(ops.PAGED_KV_WRITE, kernel_specs.KV_WRITE_TENSOR_ARGS, len(launch.scalar_args),
                                 KV_WRITE_ALIASES)
        return _aot_result(trtp, launch, ptx())

    trtp.aot_impl(KV_WRITE_ID)(paged_kv_write_aot)


def _register_attention(trt: ModuleType, trtp: ModuleType, ptx: Callable[[], bytes]) -> None:
    TensorDesc = trtp.TensorDesc  # noqa: N806

    def paged_attention(query: TensorDesc, present_key_values: TensorDesc, context_lengths: TensorDesc,
                        kvcache_start_index: TensorDesc, kv_page_table: TensorDesc, num_q_heads: int,
                        num_kv_heads: int, head_dim: int, tokens_per_page: int, scale: float) -> TensorDesc:
        return query.like()  # [B, S, Hq*D] in the query's dtype

    trtp.register(ATTENTION_ID)(paged_attention)

    def paged_attention_aot(query, present_key_values, context_lengths, kvcache_start_index, kv_page_table,
                            num_q_heads: int, num_kv_heads: int, head_dim: int, tokens_per_page: int,
                            scale: float, outputs, tactic,
                            ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        from kvforge.plugins import kernel_specs
        launch = attention_symbolic_launch(
            SymDim.leaf("batch", query.shape_expr[0]), SymDim.leaf("seq_len", query.shape_expr[1]),
            SymDim.leaf("pages_per_seq", kv_page_table.shape_expr[1]), num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, tokens_per_page=tokens_per_page, scale=scale,
            kv_cache_dtype=kv_cache_dtype_of(trt, present_key_values.dtype))
        check_calling_convention(ops.PAGED_ATTENTION, kernel_specs.ATTENTION_TENSOR_ARGS, len(launch.scalar_args),
                                 ATTENTION_ALIASES)
        return _aot_result(trtp, launch, ptx())

    trtp.aot_impl(ATTENTION_ID)(paged_attention_aot)


def _aot_result(trtp: ModuleType, launch: SymbolicLaunch, ptx: bytes) -> tuple:
    """(kernel name, PTX, KernelLaunchParams, SymIntExprs) as tensorrt.plugin.aot_impl must return them."""
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = (to_trt_expr(v, trtp) for v in launch.grid)
    params.block_x, params.block_y, params.block_z = (to_trt_expr(v, trtp) for v in launch.block)
    params.shared_mem = to_trt_expr(launch.shared_bytes, trtp)
    # Each extra arg must be a SymInt32 (the launcher type-checks them); ints become constant expressions.
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(to_trt_expr(v, trtp)) for v in launch.scalar_args])
    return launch.kernel.encode(), ptx, params, extra
