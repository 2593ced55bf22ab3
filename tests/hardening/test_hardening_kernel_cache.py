"""The CPU kernel cache trusts a library by its recorded digest, never by its name (issue 42, point 6).

Every test works on a copy of the library in a temporary cache dir (KVFORGE_CACHE_DIR), never on the shared one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnxruntime as ort
import pytest
from support.ort_support import cpu_kernel_on

from kvforge.plugins import cpu_kernel

pytestmark = pytest.mark.skipif(not cpu_kernel_on(), reason="the CPU kernel cannot be built here")


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The library copied (with its digest record) into a cache dir of this test's own; returns the copy."""
    real = cpu_kernel.library_path()
    headers = cpu_kernel.include_dir()  # the shared headers are only read, never written
    monkeypatch.setenv(cpu_kernel.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_kernel.INCLUDE_ENV, str(headers))
    copy = cpu_kernel.cache_root() / real.parent.name / real.name
    copy.parent.mkdir(parents=True)
    shutil.copy2(real, copy)
    shutil.copy2(cpu_kernel.digest_path(real), cpu_kernel.digest_path(copy))
    assert cpu_kernel.library_path() == copy  # the same build key: the copy is the one used
    return copy


def test_a_built_library_has_its_digest_recorded(private_cache: Path) -> None:
    assert cpu_kernel.digest_path(private_cache).is_file()
    assert cpu_kernel.library_problem(private_cache) is None


# A variant that compiles in seconds (one target, unoptimised; the full library is ~25 s of one core): the rebuild is
# what is checked, not the code rebuilt.
QUICK_BUILD = ("-O0", "-DHWY_COMPILE_ONLY_STATIC=1")


def test_a_truncated_library_is_detected_and_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernel.INCLUDE_ENV, str(cpu_kernel.include_dir()))
    monkeypatch.setenv(cpu_kernel.CACHE_ENV, str(tmp_path / "cache"))
    library = cpu_kernel.library_path(QUICK_BUILD)
    whole = library.read_bytes()
    library.write_bytes(whole[: len(whole) // 2])  # what a full disk or a killed copy leaves
    assert "do not match" in (cpu_kernel.library_problem(library) or "")
    assert cpu_kernel.library_path(QUICK_BUILD) == library  # rebuilt in place, not loaded (that would be a SIGBUS)
    assert cpu_kernel.library_problem(library) is None
    assert library.stat().st_size > len(whole) // 2


def test_a_bit_flipped_library_is_detected(private_cache: Path) -> None:
    data = bytearray(private_cache.read_bytes())
    data[len(data) // 3] ^= 0x10
    private_cache.write_bytes(bytes(data))
    assert private_cache.stat().st_size == len(data)  # same size: only the digest can tell
    assert "do not match" in (cpu_kernel.library_problem(private_cache) or "")


def test_a_library_without_a_record_is_not_trusted(private_cache: Path) -> None:
    cpu_kernel.digest_path(private_cache).unlink()
    assert "recorded" in (cpu_kernel.library_problem(private_cache) or "")


def test_a_library_that_fails_to_load_names_the_cache_entry(private_cache: Path) -> None:
    private_cache.write_bytes(b"\x7fELF but not a library")
    cpu_kernel.record_digest(private_cache)  # as if built this way: past the digest, onnxruntime itself refuses it
    reason = cpu_kernel.register(ort.SessionOptions())
    assert cpu_kernel.DAMAGED in reason and str(private_cache.parent) in reason and "delete" in reason
