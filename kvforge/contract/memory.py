"""How much memory this machine can give an engine: llm_build refuses a plan beyond its RAM, the runtime refuses
pools, weights and snapshot budgets beyond what is available when it loads (a pool is touched as it fills, so an
oversized one would be killed by the kernel half way through a run, or fail to allocate with a MemoryError)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kvforge.contract.errors import InvalidConfig

GIB = 2**30


def machine_memory_bytes() -> int | None:
    """Physical memory, or the cgroup's limit when lower (a container); None when unknown."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    for limit_file in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit_file.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
        break
    return total


def available_memory_bytes() -> int | None:
    """Memory this process can still take: the kernel's MemAvailable (free plus reclaimable cache), or the
    cgroup's limit minus its usage when that is lower; None when unknown."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        usage = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return available
    if limit.isdigit() and usage.isdigit():
        room = max(0, int(limit) - int(usage))
        available = room if available is None else min(available, room)
    return available


def _gib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < GIB else f"{n / GIB:,.1f} GiB"


def check_fits_memory(needs: Mapping[str, int], have: int | None, have_what: str, field: str, remedy: str) -> None:
    """Refuse when the parts in `needs` (label → bytes) add up to more than `have`; one line listing them."""
    total = sum(needs.values())
    if have is None or total <= have:
        return
    parts = ", ".join(f"{label} {_gib(size)}" for label, size in needs.items() if size)
    raise InvalidConfig(f"needs {total:,} bytes of memory ({parts}) but this machine has {_gib(have)} "
                        f"{have_what}; {remedy}", field)


def check_pool_fits_memory(pool_bytes: int, field: str = "max_kv_pool_pages", hint: str = "",
                           weight_bytes: int = 0) -> None:
    """Refuse a KV pool that, beside the weights, is larger than the machine's memory: it could never fill."""
    check_fits_memory({"KV pool": pool_bytes, "weights": weight_bytes}, machine_memory_bytes(), "in all", field,
                      f"use a smaller --maxKVPoolPages{hint}")
