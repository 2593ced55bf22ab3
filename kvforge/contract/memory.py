"""How much memory this machine can give a KV pool: llm_build refuses a plan beyond it, the runtime re-checks."""

from __future__ import annotations

import os
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


def check_pool_fits_memory(pool_bytes: int, field: str = "max_kv_pool_pages", hint: str = "") -> None:
    """Refuse a KV pool larger than the machine's memory: it would be killed by the kernel as it fills."""
    available = machine_memory_bytes()
    if available is not None and pool_bytes > available:
        raise InvalidConfig(f"the KV pool needs {pool_bytes:,} bytes ({pool_bytes / GIB:,.1f} GiB) but this machine "
                            f"has {available / GIB:,.1f} GiB; use a smaller --maxKVPoolPages{hint}", field)
