"""Builds (on first use, cached on disk) and loads kvforge's ONNX Runtime CPU custom-op library."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvforge.contract.errors import KvforgeError

SOURCE = Path(__file__).resolve().with_name("cpu") / "register.cc"  # holds RegisterCustomOps
# Every translation unit of the library, compiled together: one file per op (each per-target op is compiled once per
# Highway target inside, foreach_target.h), the registration and the run-time choice of target.
SOURCES = (SOURCE, *(SOURCE.with_name(name) for name in ("paged_attention.cc", "paged_attention_rope.cc",
                                                          "attention_mass.cc", "matmul_blocks.cc", "swiglu.cc",
                                                          "cpu_target.cc")))
# Included by the sources: part of the build key, never compiled alone.
HEADERS = tuple(SOURCE.with_name(name) for name in ("attention.h", "ort_op.h", "vector_exp.h", "cpu_target.h"))
KERNEL_FILES = (*SOURCES, *HEADERS)  # what the library is built from: its key, its freshness, its presence
LIBRARY_NAME = "libkvforge_cpu_ops.so"
SWITCH_ENV = "KVFORGE_CPU_KERNEL"  # "off" forces the pure-ONNX fallback
TARGET_ENV = "KVFORGE_CPU_TARGET"  # a compiled Highway target's name (avx2, sse4...) forces it; unset: the best here
CACHE_ENV = "KVFORGE_CACHE_DIR"
INCLUDE_ENV = "KVFORGE_ORT_INCLUDE_DIR"
CXX_ENV = "CXX"
# The ONNX Runtime headers ship in no wheel; this npm package (a Unity plugin) carries the full public set.
HEADERS_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
HEADERS_TARBALL_URL = ("https://registry.npmjs.org/com.github.asus4.onnxruntime/-/"
                       "com.github.asus4.onnxruntime-0.4.9.tgz")
HEADERS_MEMBER_DIR = ("package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/"
                      "onnxruntime.framework/Headers/")
HEADERS_CACHE_NAME = "ort-headers-0.4.9"
# -fvisibility=hidden: only RegisterCustomOps is exported; -fno-math-errno lets std::exp in the scalar tails
# vectorise. No -ffast-math: masked scores are -inf and must stay exact. No -march=native: Google Highway (Debian
# libhwy-dev) compiles each kernel for every target in TARGET_FLAGS and picks the best this CPU runs at load, so a
# library built on one x86-64 machine runs at full speed on any other.
# SSSE3 is left out (SSE4 covers every x86-64 CPU still sold: one build less), and so is SVE for now: the kernels
# keep register blocks as arrays of vectors, which SVE's sizeless types cannot be (aarch64 gets NEON).
TARGET_FLAGS = ("-DHWY_WANT_AVX3_DL",  # AVX3_DL (Ice Lake, Zen 4 on): its AVX512_BF16 prefill panels
                "-DHWY_DISABLED_TARGETS=(HWY_SSSE3|HWY_SVE|HWY_SVE2|HWY_SVE_256|HWY_SVE2_128)")
CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-math-errno", "-Wall", "-Wextra",
             *TARGET_FLAGS, f"-I{SOURCE.parent}")
LINK_FLAGS = ("-lhwy",)  # hwy::SupportedTargets and the chosen-target state
HIGHWAY_PACKAGE = "libhwy-dev"
DIGEST_SUFFIX = ".sha256"  # "HEX SIZE" of the library, written by its build and checked before every load
DAMAGED = "damaged cache entry"  # in register()'s reason when the cached library itself is what to fix
_API_VERSION_RE = re.compile(rb"#define\s+ORT_API_VERSION\s+(\d+)")


def cache_root() -> Path:
    base = os.environ.get(CACHE_ENV)
    return (Path(base) if base else Path.home() / ".cache" / "kvforge") / "cpu-kernels"


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialises fetch and build across processes (concurrent pytest workers share the cache)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _has_headers(directory: Path) -> bool:
    return (directory / "onnxruntime_c_api.h").is_file()


def _download(url: str, target: Path) -> None:
    print(f"kvforge: fetching the ONNX Runtime headers ({HEADERS_PACKAGE}, ~150 MB) from {url}", file=sys.stderr)
    with urllib.request.urlopen(url, timeout=60) as response, open(target, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0)
        done, reported = 0, -1
        while chunk := response.read(1 << 20):
            out.write(chunk)
            done += len(chunk)
            percent = done * 100 // total if total else -1
            if percent // 10 != reported // 10:
                reported = percent
                print(f"kvforge: headers download {done >> 20} MB" + (f" ({percent}%)" if total else ""),
                      file=sys.stderr)


def _fetch_tarball(workdir: Path) -> Path:
    """The npm package tarball in workdir: `npm pack` when npm is installed, else the registry URL."""
    npm = shutil.which("npm")
    if npm:
        print(f"kvforge: fetching the ONNX Runtime headers with npm pack {HEADERS_PACKAGE} (~150 MB)",
              file=sys.stderr)
        done = subprocess.run([npm, "pack", HEADERS_PACKAGE, "--silent"], cwd=workdir, capture_output=True,
                              text=True, timeout=1800)
        tarballs = list(workdir.glob("*.tgz"))
        if done.returncode == 0 and tarballs:
            return tarballs[0]
        print(f"kvforge: npm pack failed ({done.stderr.strip()[-200:]}); downloading directly", file=sys.stderr)
    target = workdir / "package.tgz"
    _download(HEADERS_TARBALL_URL, target)
    return target


def _extract_headers(tarball: Path, target: Path) -> None:
    """Only the header folder, flattened into target (no other file of the package is kept)."""
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive:
            if not (member.isfile() and member.name.startswith(HEADERS_MEMBER_DIR)):
                continue
            name = member.name[len(HEADERS_MEMBER_DIR):]
            if "/" in name or not name.endswith(".h"):
                continue
            source = archive.extractfile(member)
            if source is not None:
                (target / name).write_bytes(source.read())


def _fetched_headers() -> Path:
    root = cache_root()
    final = root / HEADERS_CACHE_NAME
    if _has_headers(final):
        return final
    with _locked(root):
        if _has_headers(final):  # another process fetched them while we waited
            return final
        with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as work:
            staging = Path(work) / "headers"
            staging.mkdir()
            tarball = _fetch_tarball(Path(work))
            _extract_headers(tarball, staging)
            tarball.unlink()
            if not _has_headers(staging):
                raise KvforgeError(f"{HEADERS_PACKAGE} has no onnxruntime_c_api.h under {HEADERS_MEMBER_DIR}")
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
    return final


def include_dir() -> Path:
    """ONNX Runtime headers: $KVFORGE_ORT_INCLUDE_DIR, else the cached copy, else fetched once from npm."""
    configured = os.environ.get(INCLUDE_ENV)
    if configured:
        if not _has_headers(Path(configured)):
            raise KvforgeError(f"{INCLUDE_ENV}={configured} has no onnxruntime_c_api.h")
        return Path(configured)
    return _fetched_headers()


def header_api_version(headers: Path) -> int:
    found = _API_VERSION_RE.search((headers / "onnxruntime_c_api.h").read_bytes())
    if not found:
        raise KvforgeError(f"no ORT_API_VERSION in {headers / 'onnxruntime_c_api.h'}")
    return int(found.group(1))


def _compiler() -> str:
    cxx = os.environ.get(CXX_ENV) or shutil.which("g++") or shutil.which("c++")
    if not cxx or not shutil.which(cxx):
        raise KvforgeError("no C++ compiler (g++) on PATH")
    return cxx


def _compiler_version(cxx: str) -> str:
    done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else cxx


def _highway_version(cxx: str) -> str:
    """Highway's version as the compiler sees it (part of the build key); raises when its headers are missing."""
    probe = "#include <hwy/highway.h>\nHWY_MAJOR HWY_MINOR HWY_PATCH\n"
    done = subprocess.run([cxx, "-E", "-P", "-x", "c++", "-"], input=probe, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise KvforgeError(f"no Google Highway headers (hwy/highway.h) for {cxx}: install the Debian package "
                           f"{HIGHWAY_PACKAGE} (`make system-packages` as root)")
    return done.stdout.strip().splitlines()[-1]


def build_key(cxx: str, headers: Path, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    sources = tuple(source.read_bytes() for source in KERNEL_FILES)
    # The compiled targets (TARGET_FLAGS within `flags`, Highway's version, the architecture), never the build host's
    # CPU: the library chooses among them at run time.
    for part in (*sources, _compiler_version(cxx).encode(), _highway_version(cxx).encode(), os.uname().machine.encode(),
                 str(header_api_version(headers)).encode(), " ".join(flags).encode()):
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()[:20]


def digest_path(library: Path) -> Path:
    """Where the size and SHA-256 recorded when `library` was built live: beside it."""
    return library.with_name(library.name + DIGEST_SUFFIX)


def _file_digest(path: Path) -> tuple[int, str]:
    with open(path, "rb") as handle:
        return os.fstat(handle.fileno()).st_size, hashlib.file_digest(handle, "sha256").hexdigest()


def record_digest(library: Path) -> None:
    """Write `library`'s size and SHA-256 beside it (atomically), as its build does."""
    size, digest = _file_digest(library)
    record = digest_path(library)
    partial = record.with_name(f".{record.name}.{os.getpid()}")
    partial.write_text(f"{digest} {size}\n", encoding="ascii")
    os.replace(partial, record)


def library_problem(library: Path) -> str | None:
    """None when `library` is what its build recorded; else why not. Loading a truncated library dies of SIGBUS
    and a corrupted one of SIGSEGV, so a cached file is trusted by its recorded digest, never by its name."""
    if not library.is_file():
        return "not built"
    try:
        recorded = digest_path(library).read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return f"no {digest_path(library).name} recorded beside it"
    try:
        size, digest = _file_digest(library)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if recorded != [digest, str(size)]:
        return f"{size} bytes that do not match the size and digest recorded when it was built"
    return None


def _compile(cxx: str, headers: Path, flags: tuple[str, ...], target: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".build-", suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        command = [cxx, *flags, f"-I{headers}", *map(str, SOURCES), *LINK_FLAGS, "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            first_error = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr[-300:])
            if "-lhwy" in first_error or "hwy/" in first_error:
                first_error += f" (Google Highway: install the Debian package {HIGHWAY_PACKAGE})"
            raise KvforgeError(f"building the CPU kernel failed: {first_error.strip()}")
        digest_path(target).unlink(missing_ok=True)  # no moment where a new library sits beside an old record
        os.replace(partial, target)  # atomic: a concurrent loader sees the old file or the complete new one
        record_digest(target)
    finally:
        partial.unlink(missing_ok=True)


@lru_cache(maxsize=8)
def _plan(source_mtime_ns: int, environment: tuple[str, ...], flags: tuple[str, ...]) -> tuple[str, Path, Path]:
    """(compiler, headers, library path): memoised, a compiler's version is a subprocess."""
    del source_mtime_ns, environment  # memo key only: a changed source, header dir, cache dir or compiler rebuilds
    cxx = _compiler()
    headers = include_dir()
    return cxx, headers, cache_root() / build_key(cxx, headers, flags) / LIBRARY_NAME


def _built(cxx: str, headers: Path, flags: tuple[str, ...], target: Path) -> Path:
    """`target` checked against its recorded digest on every use (a few ms); built, or rebuilt when damaged."""
    if library_problem(target) is None:
        return target
    with _locked(target.parent):
        problem = library_problem(target)
        if problem is not None:
            if digest_path(target).is_file():  # damaged, not merely from before digests were recorded
                print(f"kvforge: rebuilding the CPU kernel: the cached {target} is damaged ({problem})",
                      file=sys.stderr)
            _compile(cxx, headers, flags, target)
    return target


def _sources_mtime_ns() -> int:
    return max(source.stat().st_mtime_ns for source in KERNEL_FILES)


def library_path(extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library, built on first use; raises KvforgeError saying why it cannot be built or why
    KVFORGE_CPU_TARGET's value is refused. `extra_flags` builds a variant (a test's)."""
    if os.environ.get(SWITCH_ENV, "").lower() == "off":
        raise KvforgeError(f"{SWITCH_ENV}=off: using the pure-ONNX attention fallback")
    missing = [source for source in KERNEL_FILES if not source.is_file()]
    if missing:
        raise KvforgeError(f"kernel source missing: {missing[0]}")
    environment = tuple(os.environ.get(name, "") for name in (INCLUDE_ENV, CACHE_ENV, CXX_ENV))
    flags = CXX_FLAGS + tuple(extra_flags)
    cxx, headers, target = _plan(_sources_mtime_ns(), environment, flags)
    built = _built(cxx, headers, flags, target)
    # A forced target is checked against the library's own list (loading it: only then, since a loaded file that a
    # later write damages in place kills the process); ONNX Runtime loads the same copy next.
    if os.environ.get(TARGET_ENV):
        problem = _call_str(built, "kvforge_cpu_target_problem")
        if problem:
            raise KvforgeError(problem)
    return built


def _call_str(library: Path, name: str) -> str:
    """One of the library's `const char* f(void)` entries (ctypes: it links no ONNX Runtime); the same loaded copy
    as ONNX Runtime's, so what it reports is what the ops run."""
    function = getattr(ctypes.CDLL(str(library)), name)
    function.restype = ctypes.c_char_p
    function.argtypes = []
    return (function() or b"").decode()


def compiled_targets(library: Path) -> list[str]:
    """The Highway targets compiled into `library`, best first (x86: avx3_dl avx3 avx2 sse4 emu128)."""
    return _call_str(library, "kvforge_cpu_compiled_targets").split()


def runnable_targets(library: Path) -> list[str]:
    """The compiled targets this CPU runs, best first: what KVFORGE_CPU_TARGET may name here."""
    return _call_str(library, "kvforge_cpu_runnable_targets").split()


def chosen_target(library: Path) -> str:
    """The target the kernels run now: KVFORGE_CPU_TARGET's, else the best this CPU runs ("" when refused)."""
    return _call_str(library, "kvforge_cpu_chosen_target")


# The kernel's vector loops step 16 floats at a time over a head (kvforge/plugins/cpu/paged_attention.cc refuses
# others).
MAX_HEAD_DIM = 512  # Gemma 4's global layers


def supports_head_dim(head_dim: int) -> bool:
    """Whether the kernel attends over heads of this width (multiples of 16 up to MAX_HEAD_DIM: 64, 80, 128...)."""
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0


def kernel_status() -> tuple[Path | None, str]:
    """(library path, "") when the kernel is usable, else (None, one-line reason); never raises."""
    try:
        return library_path(), ""
    except KvforgeError as exc:
        return None, str(exc).splitlines()[0]
    except Exception as exc:  # a network, disk or subprocess failure: fall back, with the reason
        return None, f"CPU kernel unavailable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# kvforge_rotate_keys's dtype codes (the kernel's PoolType order) and the numpy dtype each storage arrives in.
ROTATE_DTYPES = {"fp16": (0, np.dtype(np.float16)), "fp8": (1, np.dtype(np.uint8)), "fp32": (2, np.dtype(np.float32))}


@lru_cache(maxsize=4)
def _rotate_function(source_mtime_ns: int, environment: tuple[str, ...]) -> Callable[..., int] | None:
    """kvforge_rotate_keys from the built library, loaded once (ctypes; the library links no ONNX Runtime)."""
    del source_mtime_ns, environment  # memo key only, as in _plan
    path, _ = kernel_status()
    if path is None:
        return None
    function = ctypes.CDLL(str(path)).kvforge_rotate_keys
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_int, ctypes.c_int]
    return function


def rotate_keys(stored_k: np.ndarray, delta: int, cos_sin: np.ndarray, kv_cache_dtype: str) -> np.ndarray | None:
    """The kernel library's reference.rotate_keys (the same bytes, a new array), or None when the kernel is off or
    unavailable or the arguments are ones it does not take: the caller then runs the numpy reference, which also
    gives the errors for a bad table or delta."""
    if os.environ.get(SWITCH_ENV, "").lower() == "off" or kv_cache_dtype not in ROTATE_DTYPES:
        return None
    code, storage = ROTATE_DTYPES[kv_cache_dtype]
    rotary, head_dim = cos_sin.shape[-1], stored_k.shape[-1]
    if (cos_sin.dtype != np.float32 or stored_k.dtype != storage or cos_sin.ndim != 2 or rotary % 2
            or rotary > head_dim or stored_k.size == 0 or abs(delta) >= cos_sin.shape[0]
            or not all(source.is_file() for source in SOURCES)):
        return None
    environment = tuple(os.environ.get(name, "") for name in (INCLUDE_ENV, CACHE_ENV, CXX_ENV))
    function = _rotate_function(_sources_mtime_ns(), environment)
    if function is None:
        return None
    moved = np.array(stored_k, order="C", copy=True)  # rotated in place: the caller's array stays as it was
    row = np.ascontiguousarray(cos_sin[abs(delta)])
    if function(moved.ctypes.data, moved.size // head_dim, head_dim, rotary, row.ctypes.data,
                1 if delta >= 0 else -1, code) != 0:
        raise KvforgeError(f"kvforge_rotate_keys refused a {kv_cache_dtype} rotation of {rotary} of {head_dim} dims")
    return moved


# The SIMD features a figure's reader needs to place the CPU (the rest of /proc/cpuinfo's flags say nothing of speed).
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "asimdhp", "sve", "sve2", "i8mm",
              "bf16")


def cpu_description(with_kernel: bool = True) -> dict[str, object]:
    """What a figure came from: the CPU's model name, its SIMD features and the kernel target that runs (None when
    the kernel is unavailable here, with `kernel_reason` saying why; not asked, and never built, without
    `with_kernel`). Never raises."""
    model, flags = os.uname().machine, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and model == os.uname().machine:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    path, reason = kernel_status() if with_kernel else (None, "not used")
    target = None
    if path is not None:
        try:
            target = chosen_target(path) or None
        except (OSError, AttributeError) as exc:
            reason = f"the library reports no target: {exc}"
    return {"cpu_model": model, "simd": [flag for flag in SIMD_FLAGS if flag in flags], "kernel_target": target,
            "kernel_reason": reason}


def describe_cpu(description: dict[str, object]) -> str:
    """cpu_description's one line: "AMD EPYC; SIMD avx2 fma f16c; kernel target avx2"."""
    target = description.get("kernel_target") or f"none ({description.get('kernel_reason')})"
    simd = " ".join(str(flag) for flag in description.get("simd") or []) or "none listed"  # type: ignore[union-attr]
    return f"{description.get('cpu_model')}; SIMD {simd}; kernel target {target}"


def register(options: object) -> str:
    """Registers the library on an onnxruntime.SessionOptions: "" when done, else the one-line reason it is not
    (unavailable here, or this ONNX Runtime refuses it: too old for the headers' API version)."""
    path, reason = kernel_status()
    if path is None:
        return reason
    try:
        options.register_custom_ops_library(str(path))  # type: ignore[attr-defined]
    except Exception as exc:  # onnxruntime raises its own Fail type
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (f"onnxruntime refused the library: {first}; the {DAMAGED}: delete {path.parent} and kvforge "
                "rebuilds it on next use")
    return ""


def main() -> int:
    path, reason = kernel_status()
    if path is None:
        print(f"kvforge CPU kernel not available: {reason}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
