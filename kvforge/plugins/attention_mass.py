"""The CPU kernel's attention-mass output (issue 53) from Python: arm a watch on a sequence, read what its question
rows' softmax gave each position (kvforge/plugins/cpu/attention_mass.cc, loaded by ctypes like kvforge_rotate_keys)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from kvforge.contract.engine_dir import ATTENTION_CPU_KERNEL
from kvforge.contract.errors import InvalidConfig
from kvforge.plugins import cpu_kernel


@dataclass(slots=True)
class MassWatch:
    """An armed watch: the kernel adds into `mass` until it is read."""

    handle: int
    mass: np.ndarray = field(repr=False)


@dataclass(frozen=True, slots=True)
class MassReading:
    """What a watch summed: `mass[t]` is the probability the watched query rows gave position t, summed over query
    heads and layer calls; `rows` how many (query row, head, layer) softmaxes were added (the total is about that)."""

    mass: np.ndarray
    rows: int


class AttentionMassMeter:
    """Arms and reads watches through the built library's kvforge_attention_mass_arm/_disarm. The library must be
    the one ONNX Runtime loaded (the same path: one copy of its globals in the process)."""

    __slots__ = ("_arm", "_disarm", "_watches")

    def __init__(self, library: ctypes.CDLL) -> None:
        self._arm = library.kvforge_attention_mass_arm
        self._arm.restype = ctypes.c_int
        self._arm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]
        self._disarm = library.kvforge_attention_mass_disarm
        self._disarm.restype = ctypes.c_int64
        self._disarm.argtypes = [ctypes.c_int]
        self._watches: dict[int, MassWatch] = {}  # keeps each armed buffer alive while the kernel may write it

    def watch(self, page: int, page_index: int, query_from: int, positions: int) -> MassWatch | None:
        """Watch the rows whose page table holds `page` at `page_index` (a page only that sequence holds): their
        queries at positions >= `query_from` add into a buffer of `positions`. None when every watch is taken."""
        mass = np.zeros(positions, dtype=np.float32)
        handle = self._arm(mass.ctypes.data, positions, page, page_index, query_from)
        if handle < 0:
            return None
        self._watches[handle] = watch = MassWatch(handle, mass)
        return watch

    def read(self, watch: MassWatch) -> MassReading:
        """Disarm `watch` and return what it summed (also to drop a watch whose reading is not needed)."""
        rows = self._disarm(watch.handle)
        self._watches.pop(watch.handle, None)
        return MassReading(watch.mass, max(int(rows), 0))


@lru_cache(maxsize=4)
def _meter(library: str) -> AttentionMassMeter:
    return AttentionMassMeter(ctypes.CDLL(library))


def attention_mass_meter() -> tuple[AttentionMassMeter | None, str]:
    """(the meter, "") when the CPU kernel library is built and on, else (None, the one-line reason)."""
    if os.environ.get(cpu_kernel.SWITCH_ENV, "").lower() == "off":
        return None, f"{cpu_kernel.SWITCH_ENV}=off: attention runs as plain ONNX, which exposes no attention mass"
    path, reason = cpu_kernel.kernel_status()
    if path is None:
        return None, reason
    return _meter(str(path)), ""


def check_attention_mass(attention: str, kernel_writes_kv: bool) -> AttentionMassMeter:
    """`--documentRepair attention` needs this output: refused in one line naming the flag on an engine that attends
    without PagedAttentionRope (built with KVFORGE_CPU_KERNEL=off, or before the kernel wrote K/V; TensorRT) or where
    the kernel is off or cannot load now. A refusal, not a silent fallback: the policy would be first-page."""
    meter, reason = attention_mass_meter()
    if attention != ATTENTION_CPU_KERNEL or not kernel_writes_kv:
        reason = f"this engine attends with {attention}, not kvforge's PagedAttentionRope"
    if reason or meter is None:
        raise InvalidConfig(f"attention reads the question's attention from kvforge's CPU kernel, which this run does "
                            f"not use ({reason}); use first-page or overlap", "document_repair")
    return meter
