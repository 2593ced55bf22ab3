"""Runs a TensorRT engine on the GPU: device KV pools updated in place by the plugins, logits copied back."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kvforge.contract.engine_dir import (
    HIDDEN_STATES,
    HIDDEN_STATES_INDICES,
    LEGACY_LAST_TOKEN_IDS,
    LOGITS_INDICES,
    TRT_ENGINE_FILE,
    EngineDir,
)
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import ACTIVATION_INPUT
from kvforge.contract.paging import pages_for
from kvforge.plugins.ops import UNUSED_PAGE
from kvforge.plugins.reference import pool_numpy_dtype, rope_table
from kvforge.runtime.execution.backend import ForwardOutput, StepInputs, activation_values, last_token_indices

PREFILL_PROFILE, DECODE_PROFILE = 0, 1  # as built by kvforge.builder.trt_build


class CudaDriver:
    """cuda-python driver calls with their CUresult checked: each failure is one KvforgeError line."""

    def __init__(self, driver: ModuleType, device: int = 0, field: str = "engine_dir") -> None:
        self.cu = driver
        self.field = field  # what a failure names: the engine dir this driver serves
        self.call("cuInit", 0)
        self.device = self.call("cuDeviceGet", device)
        # The primary context is the one the CUDA runtime (and so TensorRT) uses on this device.
        self.context = self.call("cuDevicePrimaryCtxRetain", self.device)
        self.call("cuCtxSetCurrent", self.context)
        self.stream = self.call("cuStreamCreate", 0)

    def call(self, name: str, *args: Any) -> Any:
        err, *values = getattr(self.cu, name)(*args)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise KvforgeError(f"CUDA {name} failed: {err}", self.field)
        return values[0] if len(values) == 1 else tuple(values) or None

    @property
    def stream_handle(self) -> int:
        return int(self.stream)  # TensorRT takes cudaStream_t as an int

    def alloc(self, nbytes: int) -> int:
        return int(self.call("cuMemAlloc", max(nbytes, 1)))  # zero-byte allocations are invalid

    def upload(self, device_ptr: int, host: np.ndarray) -> None:
        """Async H2D on the runner's stream; `host` must stay alive until synchronize()."""
        if host.nbytes:
            self.call("cuMemcpyHtoDAsync", device_ptr, host.ctypes.data, host.nbytes, self.stream)

    def download(self, host: np.ndarray, device_ptr: int) -> None:
        if host.nbytes:
            self.call("cuMemcpyDtoHAsync", host.ctypes.data, device_ptr, host.nbytes, self.stream)

    def zero(self, device_ptr: int, nbytes: int) -> None:
        self.call("cuMemsetD8Async", device_ptr, 0, nbytes, self.stream)

    def synchronize(self) -> None:
        self.call("cuStreamSynchronize", self.stream)


class DeviceKVStore:
    """The KV pools on the GPU, one buffer per layer [num_pages, 2, Hkv, T, D]; KVStore's host-facing methods.

    The engine's PagedKVWrite plugin writes new tokens in place, so forward() never touches the pool here;
    read_tokens/write_tokens serve the legacy system-prompt cache by copying whole pages over PCIe.
    """

    def __init__(self, cuda: CudaDriver, num_layers: int, num_pages: int, num_kv_heads: int, tokens_per_page: int,
                 head_dim: int, kv_cache_dtype: str) -> None:
        self.cuda = cuda
        self.tokens_per_page = tokens_per_page
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = pool_numpy_dtype(kv_cache_dtype)
        self.page_shape = (2, num_kv_heads, tokens_per_page, head_dim)
        self.page_bytes = int(np.prod(self.page_shape)) * self.dtype.itemsize
        self.layer_bytes = self.page_bytes * num_pages
        self.layers = [cuda.alloc(self.layer_bytes) for _ in range(num_layers)]  # device pointers
        self.layer_group: list[str | None] = [None] * num_layers  # one page group: no sliding-window group here
        for ptr in self.layers:
            cuda.zero(ptr, self.layer_bytes)  # like the numpy pool: unwritten slots read as zeros
        cuda.synchronize()

    @property
    def nbytes(self) -> int:
        return self.layer_bytes * len(self.layers)

    def locate(self, page_ids: list[int], start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        positions = np.arange(start, stop)
        return np.asarray(page_ids, dtype=np.int64)[positions // self.tokens_per_page], positions % self.tokens_per_page

    def read_tokens(self, page_ids: list[int], num_tokens: int) -> list[np.ndarray]:
        """Stored rows [n, 2, Hkv, D] of positions [0, num_tokens) per layer (storage dtype)."""
        pages = self._pages(page_ids, num_tokens)
        slots = np.arange(num_tokens)
        rows = []
        for layer in range(len(self.layers)):
            host = self._download_pages(layer, pages)
            rows.append(host[slots // self.tokens_per_page, :, :, slots % self.tokens_per_page, :])
        return rows

    def write_tokens(self, page_ids: list[int], stored_rows: list[np.ndarray]) -> None:
        """Write rows from read_tokens back at positions [0, n): read-modify-write of the pages they touch."""
        num_tokens = len(stored_rows[0])
        pages = self._pages(page_ids, num_tokens)
        slots = np.arange(num_tokens)
        for layer, rows in enumerate(stored_rows):
            host = self._download_pages(layer, pages)
            host[slots // self.tokens_per_page, :, :, slots % self.tokens_per_page, :] = rows
            for index, page in enumerate(pages):
                self.cuda.upload(self._page_ptr(layer, page), host[index])
            self.cuda.synchronize()

    def copy_positions(self, page_ids: list[int], sources: list[int], targets: list[int]) -> None:
        """Move rows within one sequence (KVStore.copy_positions) by read-modify-write of the pages they touch (only
        tree verification moves rows, and it runs on onnxruntime engines only for now)."""
        pages = sorted({int(page_ids[p // self.tokens_per_page]) for p in [*sources, *targets]})
        stored = {page: self.read_page(page) for page in pages}
        rows = [[stored[int(page_ids[p // self.tokens_per_page])][layer][:, :, p % self.tokens_per_page].copy()
                 for p in sources] for layer in range(len(self.layers))]
        for layer in range(len(self.layers)):
            for row, p in zip(rows[layer], targets, strict=True):
                stored[int(page_ids[p // self.tokens_per_page])][layer][:, :, p % self.tokens_per_page] = row
        for page in pages:
            self.write_page(page, stored[page])

    def read_page(self, page: int) -> list[np.ndarray]:
        """One page per layer, downloaded (host copies; snapshots of a device pool are staged on the host)."""
        return [self._download_pages(layer, [page])[0] for layer in range(len(self.layers))]

    def write_page(self, page: int, stored: list[np.ndarray]) -> None:
        for layer, rows in enumerate(stored):
            self.cuda.upload(self._page_ptr(layer, page), np.ascontiguousarray(rows))
        self.cuda.synchronize()

    def _pages(self, page_ids: list[int], num_tokens: int) -> list[int]:
        return [int(p) for p in page_ids[:pages_for(num_tokens, self.tokens_per_page)]]

    def _page_ptr(self, layer: int, page: int) -> int:
        return self.layers[layer] + page * self.page_bytes  # a page is contiguous in the pool layout

    def _download_pages(self, layer: int, pages: list[int]) -> np.ndarray:
        host = np.empty((len(pages), *self.page_shape), dtype=self.dtype)
        for index, page in enumerate(pages):
            self.cuda.download(host[index], self._page_ptr(layer, page))
        self.cuda.synchronize()
        return host


def _require_trt_and_cuda() -> tuple[ModuleType, ModuleType]:
    from kvforge.plugins.trt import require_cuda_driver, require_tensorrt
    trt = require_tensorrt()
    return trt, require_cuda_driver()


class TrtBackend:
    """Backend over llm.engine: profile 0 for prefill calls (S > 1), profile 1 for decode (S == 1)."""

    states = None  # attention layers only: recurrent families build for onnxruntime (kvforge/builder/build.py)

    def __init__(self, engine: EngineDir, device: int = 0) -> None:
        trt, driver = _require_trt_and_cuda()
        model, build = engine.model, engine.build
        self.trt, self.build, self.vocab_size = trt, build, model.vocab_size
        self.cuda = CudaDriver(driver, device)
        self.engine = self._deserialize(trt, engine)
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise KvforgeError("TensorRT could not create an execution context (out of GPU memory?)", "engine_dir")
        self.kv_store = DeviceKVStore(self.cuda, model.num_hidden_layers, build.max_kv_pool_pages,
                                 model.num_key_value_heads, build.tokens_per_page, model.head_dim,
                                 model.kv_cache_dtype)
        self.inputs = [n for n in self._io_names() if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        # Engines built before logits_indices take last_token_ids [B] and return [B, V]: they keep running calls
        # that want each row's last token (see OrtBackend), verify calls are refused with "rebuild".
        self._legacy_last_token = LEGACY_LAST_TOKEN_IDS in self.inputs
        self._hidden_width = (len(model.hidden_state_layers) * model.hidden_size
                              if HIDDEN_STATES in self._io_names() else 0)
        self.max_positions = self._max_positions()
        self.buffers = self._allocate_inputs(model.hidden_size, model.vocab_size)
        self.rope_shape = (build.max_kv_cache_capacity, model.head_dim)
        self._upload_once(self.buffers["rope_rotary_cos_sin"],
                          rope_table(build.max_kv_cache_capacity, model.head_dim, model.rope_theta))
        self._profile, self._batch = -1, 0
        self._host: list[np.ndarray] = []  # staged host arrays, kept alive until the stream syncs

    # -- setup ----------------------------------------------------------------------------------------------

    @staticmethod
    def _deserialize(trt: ModuleType, engine: EngineDir) -> Any:
        data = engine.file(TRT_ENGINE_FILE).read_bytes()
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        # AOT plugin kernels are inside the engine: no plugin registration is needed to deserialize.
        cuda_engine = runtime.deserialize_cuda_engine(data)
        if cuda_engine is None:
            raise KvforgeError(f"TensorRT cannot load {engine.file(TRT_ENGINE_FILE)}; it was built by another "
                               "TensorRT version or for another GPU: rebuild it with llm_build", "engine_dir")
        return cuda_engine

    def _io_names(self) -> list[str]:
        return [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]

    def _np_dtype(self, name: str) -> np.dtype:
        return np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name)))

    def _max_positions(self) -> int:
        """The most logits rows one call may ask for: the largest logits_indices any profile allows (the prefill
        one, where verify rows run); maxBatchSize on an engine from before logits_indices."""
        if self._legacy_last_token:
            return self.build.max_batch_size
        return int(self.engine.get_tensor_profile_shape(LOGITS_INDICES, PREFILL_PROFILE)[2][0])

    def _allocate_inputs(self, hidden: int, vocab: int) -> dict[str, int]:
        """One device buffer per non-pool tensor, sized for the largest shape any profile allows."""
        b = self.build
        positions = LEGACY_LAST_TOKEN_IDS if self._legacy_last_token else LOGITS_INDICES
        sizes = {"inputs_embeds": b.max_batch_size * b.max_input_len * hidden,
                 "context_lengths": b.max_batch_size, "kvcache_start_index": b.max_batch_size,
                 positions: self.max_positions, "kv_page_table": b.max_batch_size * b.max_pages_per_seq,
                 "rope_rotary_cos_sin": b.max_kv_cache_capacity * self.kv_store.page_shape[-1],
                 "logits": self.max_positions * vocab}
        if self._hidden_width:
            hidden_rows = self.max_positions
            if HIDDEN_STATES_INDICES in self.inputs:  # every position of the largest call
                hidden_rows = b.max_batch_size * b.max_input_len
                sizes[HIDDEN_STATES_INDICES] = hidden_rows
            sizes[HIDDEN_STATES] = hidden_rows * self._hidden_width
        if ACTIVATION_INPUT in self.inputs:
            sizes[ACTIVATION_INPUT] = b.max_batch_size
        for name in self.inputs:
            if name.startswith("lora_"):
                sizes[name] = int(np.prod(self.engine.get_tensor_profile_shape(name, PREFILL_PROFILE)[2]))
        unknown = [n for n in self.inputs if n not in sizes and not n.startswith("past_key_values_")]
        if unknown:
            raise KvforgeError(f"engine input(s) {', '.join(unknown)} are not part of the kvforge engine contract; "
                               "rebuild the engine with this kvforge", "engine_dir")
        return {name: self.cuda.alloc(count * self._np_dtype(name).itemsize) for name, count in sizes.items()}

    def _upload_once(self, ptr: int, host: np.ndarray) -> None:
        self.cuda.upload(ptr, np.ascontiguousarray(host, dtype=self._np_dtype("rope_rotary_cos_sin")))
        self.cuda.synchronize()

    # -- one call -------------------------------------------------------------------------------------------

    def forward(self, step: StepInputs) -> ForwardOutput:
        batch, seq = step.inputs_embeds.shape[:2]
        positions = step.positions()
        self._check_limits(batch, seq, len(positions))
        self._select_profile(PREFILL_PROFILE if seq > 1 else DECODE_PROFILE)
        self._batch = batch
        lengths = step.context_lengths.astype(np.int32)
        self._bind("inputs_embeds", step.inputs_embeds)
        self._bind("context_lengths", lengths)
        self._bind("kvcache_start_index", step.kvcache_start_index)
        self._bind("kv_page_table", self._page_table(step.page_ids))
        if self._legacy_last_token:
            if not np.array_equal(positions, last_token_indices(lengths, seq)):
                raise KvforgeError(f"this engine was built before {LOGITS_INDICES} and returns logits at each row's "
                                   "last token only (no speculative verify); rebuild it with llm_build",
                                   "engine_dir")
            self._bind(LEGACY_LAST_TOKEN_IDS, lengths - 1)
        else:
            self._bind(LOGITS_INDICES, positions)
        self._bind_static("rope_rotary_cos_sin", self.rope_shape)
        self._bind_lora(step.lora_tensors)
        activation = activation_values(step.adapter_start, batch, ACTIVATION_INPUT in self.inputs)
        if activation is not None:
            self._bind(ACTIVATION_INPUT, activation)
        self._bind_pools()
        # Output shapes follow the input shapes: logits [N, V], hidden_states [N, layers * H].
        logits = np.empty((len(positions), self.vocab_size), self._np_dtype("logits"))
        self.context.set_tensor_address("logits", self.buffers["logits"])
        hidden = None
        if self._hidden_width:
            hidden_positions = step.hidden_positions()
            if HIDDEN_STATES_INDICES in self.inputs:
                self._bind(HIDDEN_STATES_INDICES, hidden_positions)
            hidden = np.empty((len(hidden_positions), self._hidden_width), self._np_dtype(HIDDEN_STATES))
            self.context.set_tensor_address(HIDDEN_STATES, self.buffers[HIDDEN_STATES])
        if not self.context.execute_async_v3(self.cuda.stream_handle):
            raise KvforgeError("TensorRT failed to enqueue the engine call", "engine_dir")
        self.cuda.download(logits, self.buffers["logits"])
        if hidden is not None:
            self.cuda.download(hidden, self.buffers[HIDDEN_STATES])
        self.cuda.synchronize()
        self._host.clear()
        return ForwardOutput(logits.astype(np.float32, copy=False),
                             None if hidden is None else hidden.astype(np.float32, copy=False))

    def close(self) -> None:
        """Free the device buffers and the stream (the pools included); the runner is unusable afterwards."""
        self.cuda.synchronize()
        for ptr in (*self.buffers.values(), *self.kv_store.layers):
            self.cuda.call("cuMemFree", ptr)
        self.buffers, self.kv_store.layers = {}, []
        self.cuda.call("cuStreamDestroy", self.cuda.stream)

    def _check_limits(self, batch: int, seq: int, positions: int) -> None:
        if batch > self.build.max_batch_size or seq > self.build.max_input_len:
            raise KvforgeError(f"call of {batch} x {seq} tokens exceeds the engine's maxBatchSize "
                               f"{self.build.max_batch_size} / maxInputLen {self.build.max_input_len}", "engine_dir")
        if positions > self.max_positions:
            raise KvforgeError(f"call asks for logits at {positions} positions; this engine returns at most "
                               f"{self.max_positions} per call", "engine_dir")

    def _select_profile(self, profile: int) -> None:
        if profile != self._profile:
            # Switching invalidates the input shapes, which _bind sets again on every call anyway.
            if not self.context.set_optimization_profile_async(profile, self.cuda.stream_handle):
                raise KvforgeError(f"TensorRT cannot select optimization profile {profile}", "engine_dir")
            self._profile = profile

    def _page_table(self, page_ids: list[list[int]]) -> np.ndarray:
        """[B, P] with every page of the row, the new tokens' too: the plugin writes them on the GPU."""
        table = np.full((len(page_ids), self.build.max_pages_per_seq), UNUSED_PAGE, dtype=np.int32)
        for row, pages in enumerate(page_ids):
            table[row, :len(pages)] = pages
        return table

    def _bind(self, name: str, host: np.ndarray) -> None:
        staged = np.ascontiguousarray(host, dtype=self._np_dtype(name))
        self._host.append(staged)
        self.cuda.upload(self.buffers[name], staged)
        self._set_shape(name, staged.shape)
        self.context.set_tensor_address(name, self.buffers[name])

    def _bind_static(self, name: str, shape: tuple[int, ...]) -> None:
        self._set_shape(name, shape)
        self.context.set_tensor_address(name, self.buffers[name])

    def _bind_lora(self, tensors: dict[str, np.ndarray] | None) -> None:
        for name in self.inputs:
            if not name.startswith("lora_"):
                continue
            if tensors is not None:
                self._bind(name, tensors[name])
                continue
            # No adapters: rank 0, so (x @ [B, in, 0]) @ [B, 0, out] adds exact zeros; the buffer is just an address.
            *rows, first, last = self.engine.get_tensor_profile_shape(name, self._profile)[2]
            matrix = (first, 0) if name.startswith("lora_A") else (0, last)
            self._bind_static(name, (self._batch, *matrix) if rows else matrix)

    def _bind_pools(self) -> None:
        for layer, ptr in enumerate(self.kv_store.layers):
            self._set_shape(f"past_key_values_{layer}", (self.build.max_kv_pool_pages, *self.kv_store.page_shape))
            # The plugin's output aliases its input: both names bind the same buffer, updated in place.
            self.context.set_tensor_address(f"past_key_values_{layer}", ptr)
            self.context.set_tensor_address(f"present_key_values_{layer}", ptr)

    def _set_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if not self.context.set_input_shape(name, tuple(int(d) for d in shape)):
            raise KvforgeError(f"shape {tuple(shape)} of {name} is outside the engine's optimization profile "
                               f"{self._profile}", "engine_dir")


class TrtEncoderSession:
    """A TensorRT encoder engine (visual.engine / audio.engine) behind onnxruntime's `session.run(outputs, feeds)`,
    so the encoders run either backend unchanged. One profile (items 1..maxBatchSize); a device buffer per tensor,
    grown to the largest call seen. Written against TensorRT's Python API; verified only against a fake."""

    def __init__(self, path: Path, field: str, device: int = 0) -> None:
        trt, driver = _require_trt_and_cuda()
        self.trt, self.field = trt, field
        self.cuda = CudaDriver(driver, device, field)
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise KvforgeError(f"TensorRT cannot load {path}; it was built by another TensorRT version or for another "
                               "GPU: rebuild it with llm_build", field)
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise KvforgeError("TensorRT could not create an execution context (out of GPU memory?)", field)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes)

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise KvforgeError(f"the encoder engine needs input(s) {', '.join(missing)}; rebuild it with this "
                               "kvforge", self.field)
        staged = [self._bind_input(name, feeds[name]) for name in self.inputs]  # alive until the sync below
        results = {}
        for name in self.outputs:
            out = np.empty(tuple(self.context.get_tensor_shape(name)), self._dtype(name))
            self.context.set_tensor_address(name, self._buffer(name, out.nbytes))
            results[name] = out
        if not self.context.execute_async_v3(self.cuda.stream_handle):
            raise KvforgeError("TensorRT failed to enqueue the encoder call", self.field)
        for name, out in results.items():
            self.cuda.download(out, self.buffers[name][0])
        self.cuda.synchronize()
        del staged
        return [results[name] for name in output_names]

    def close(self) -> None:
        self.cuda.synchronize()
        for ptr, _ in self.buffers.values():
            self.cuda.call("cuMemFree", ptr)
        self.buffers = {}
        self.cuda.call("cuStreamDestroy", self.cuda.stream)

    def _bind_input(self, name: str, value: np.ndarray) -> np.ndarray:
        host = np.ascontiguousarray(value, dtype=self._dtype(name))
        ptr = self._buffer(name, host.nbytes)
        self.cuda.upload(ptr, host)
        if not self.context.set_input_shape(name, tuple(int(d) for d in host.shape)):
            raise KvforgeError(f"shape {host.shape} of {name} is outside the encoder engine's profile; rebuild it "
                               "with a larger --maxBatchSize", self.field)
        self.context.set_tensor_address(name, ptr)
        return host

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if nbytes > size:
            if ptr:
                self.cuda.synchronize()  # the previous call may still read it
                self.cuda.call("cuMemFree", ptr)
            ptr, size = self.cuda.alloc(nbytes), max(nbytes, 1)
            self.buffers[name] = (ptr, size)
        return ptr

    def _dtype(self, name: str) -> np.dtype:
        return np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name)))
