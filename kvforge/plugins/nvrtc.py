"""Compiles the paged-KV CUDA kernels (kvforge/plugins/kernels/*.cu) with NVRTC into PTX or cubin, cached on disk."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kvforge.contract.errors import KvforgeError

KERNEL_DIR = Path(__file__).resolve().with_name("kernels")
INSTALL_HINT = "NVRTC not available: pip install 'kvforge[gpu]'"
PROGRAM_NAME = "kvforge_kernels.cu"  # the generated translation unit that #includes every .cu file
CACHE_ENV = "KVFORGE_NVRTC_CACHE"
EMITS = ("ptx", "cubin")
# Exact IEEE arithmetic: no --use_fast_math (it would flush E4M3/FP16 subnormals to zero and approximate
# the divisions); FMA contraction stays on, except where kv_write.cu pins the order with _rn intrinsics.
BASE_OPTIONS = ("-std=c++17",)

_ARCH_RE = re.compile(r"^sm_(\d{2,3})([af]?)$")
_ERROR_RE = re.compile(r"^(?P<file>[^\s()]+)\((?P<line>\d+)\): (?:catastrophic )?error: (?P<msg>.*)$")
_FUNC_RE = re.compile(r"(?:__global__|__device__)[^(;]*?\b(\w+)\s*\(")


@dataclass(frozen=True, slots=True)
class CompiledModule:
    """One NVRTC program holding every kernel: a PTX text or a cubin for one architecture."""

    image: bytes  # PTX text (no trailing NUL) or cubin ELF bytes
    emit: str  # "ptx" | "cubin"
    arch: str  # "sm_90"
    entries: tuple[str, ...]  # extern "C" kernels found in the image
    nvrtc_version: tuple[int, int]
    key: str  # sha256 over sources, options and NVRTC version
    from_cache: bool
    path: Path | None  # the cache file, if the cache was writable

    @property
    def ptx(self) -> str:
        if self.emit != "ptx":
            raise KvforgeError(f"module was compiled to {self.emit}, not PTX", "emit")
        return self.image.decode()


def _nvrtc() -> ModuleType:
    """The one guarded import of cuda-python's NVRTC bindings."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise KvforgeError(INSTALL_HINT) from exc
    return nvrtc


def _check(result: tuple, what: str) -> tuple:
    nvrtc = _nvrtc()
    err, rest = result[0], result[1:]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, name = nvrtc.nvrtcGetErrorString(err)
        raise KvforgeError(f"{what} failed: {name.decode()}", "nvrtc")
    return rest


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library cuda-python loads; raises KvforgeError when there is none."""
    nvrtc = _nvrtc()
    try:
        major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except RuntimeError as exc:  # cuda-bindings is there but libnvrtc.so could not be loaded
        raise KvforgeError(f"{INSTALL_HINT} ({exc})") from exc
    return int(major), int(minor)


def nvrtc_library_path() -> str | None:
    """Which libnvrtc the process has loaded (Linux), so a report can say exactly what compiled."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "libnvrtc" in path and "builtins" not in path:
                    return path
    except OSError:
        pass
    return None


def nvrtc_available() -> tuple[bool, str]:
    """(True, "NVRTC 13.0 (...)") or (False, why not) without raising."""
    try:
        major, minor = nvrtc_version()
    except KvforgeError as exc:
        return False, str(exc)
    from cuda.bindings import __version__ as bindings_version

    where = nvrtc_library_path()
    return True, f"NVRTC {major}.{minor} (cuda-bindings {bindings_version}{', ' + where if where else ''})"


def kernel_sources(kernel_dir: Path = KERNEL_DIR) -> dict[str, str]:
    """File name -> text of every .cu/.cuh file; the .cu files are the program's parts."""
    files = sorted([*kernel_dir.glob("*.cu"), *kernel_dir.glob("*.cuh")])
    if not any(f.suffix == ".cu" for f in files):
        raise KvforgeError("no .cu files to compile", str(kernel_dir))
    return {f.name: f.read_text(encoding="utf-8") for f in files}


def _options(arch: str, emit: str) -> list[str]:
    match = _ARCH_RE.match(arch)
    if not match:
        raise KvforgeError(f"expected an architecture like sm_90, got {arch!r}", "arch")
    if emit not in EMITS:
        raise KvforgeError(f"expected one of {', '.join(EMITS)}, got {emit!r}", "emit")
    target = f"compute_{match[1]}{match[2]}" if emit == "ptx" else arch
    return [f"--gpu-architecture={target}", *BASE_OPTIONS]


def default_cache_dir() -> Path:
    """$KVFORGE_NVRTC_CACHE, else ~/.cache/kvforge/nvrtc."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "kvforge" / "nvrtc"


def _cache_key(sources: dict[str, str], options: list[str], version: tuple[int, int]) -> str:
    digest = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sources.items()}
    blob = json.dumps({"sources": digest, "options": options, "nvrtc": list(version)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _entries(image: bytes, emit: str) -> tuple[str, ...]:
    if emit == "ptx":
        names = re.findall(rb"\.entry\s+(\w+)", image)
    else:  # cubin: kernel names sit in the ELF string tables (".text.<name>", ".nv.info.<name>", the symbol)
        names = re.findall(rb"(?<![A-Za-z0-9_])(kvforge_[A-Za-z0-9_]+)", image)
    return tuple(sorted({n.decode() for n in names}))


def _enclosing_function(text: str, line: int) -> str | None:
    """Best effort: the kernel or device function around a 1-based source line."""
    lines = text.splitlines()
    here = lines[line - 1] if 0 < line <= len(lines) else ""
    entry = re.search(r"\b(kvforge_\w+)", here)
    if entry:
        return entry[1]
    for candidate in reversed(lines[: max(line, 0)]):
        match = _FUNC_RE.search(candidate)
        if match:
            return match[1]
    return None


def _compile_error(log: str, sources: dict[str, str]) -> KvforgeError:
    """One line: which .cu file and line, in which function, and NVRTC's first error message."""
    for raw in log.splitlines():
        match = _ERROR_RE.match(raw.strip())
        if not match:
            continue
        name, line, msg = match["file"], int(match["line"]), match["msg"].strip()
        func = _enclosing_function(sources.get(name, ""), line)
        where = f" in {func}" if func else ""
        return KvforgeError(f"NVRTC error{where}: {msg}", f"kvforge/plugins/kernels/{name}:{line}")
    first = next((raw.strip() for raw in log.splitlines() if raw.strip()), "no log")
    return KvforgeError(f"NVRTC compilation failed: {first}", "kvforge/plugins/kernels")


def _compile(sources: dict[str, str], options: list[str], emit: str) -> bytes:
    nvrtc = _nvrtc()
    units = [name for name in sources if name.endswith(".cu")]
    program = "".join(f'#include "{name}"\n' for name in units)
    names = list(sources)
    (prog,) = _check(
        nvrtc.nvrtcCreateProgram(program.encode(), PROGRAM_NAME.encode(), len(names),
                                 [sources[n].encode() for n in names], [n.encode() for n in names]),
        "nvrtcCreateProgram")
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise _compile_error(log.rstrip(b"\0").decode(errors="replace"), sources)
        get_size, get = ((nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if emit == "ptx"
                         else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
        (size,) = _check(get_size(prog), "nvrtcGet" + emit.upper() + "Size")
        image = b" " * size
        _check(get(prog, image), "nvrtcGet" + emit.upper())
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return image.rstrip(b"\0") if emit == "ptx" else image


def compile_kernels(arch: str = "sm_90", *, emit: str = "ptx", cache_dir: Path | None = None,
                    kernel_dir: Path = KERNEL_DIR) -> CompiledModule:
    """Compile every kernel into one module for `arch` ("sm_90"): PTX for compute_90 or a cubin for sm_90.

    The result is cached under `cache_dir` (default $KVFORGE_NVRTC_CACHE or ~/.cache/kvforge/nvrtc), keyed by
    sha256 of the sources, the options and the NVRTC version. Compile errors raise a one-line KvforgeError
    naming the .cu file and line."""
    options = _options(arch, emit)
    sources = kernel_sources(kernel_dir)
    version = nvrtc_version()
    key = _cache_key(sources, options, version)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / f"kvforge_kernels-{arch}-{key[:32]}.{emit}"
    if path.is_file():
        image = path.read_bytes()
        return CompiledModule(image, emit, arch, _entries(image, emit), version, key, True, path)
    image = _compile(sources, options, emit)
    try:  # a read-only or missing home must not stop a compile
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(image)
        os.replace(tmp, path)  # atomic: concurrent compiles never see half a file
    except OSError:
        path = None
    return CompiledModule(image, emit, arch, _entries(image, emit), version, key, False, path)


def main(argv: list[str] | None = None) -> int:
    """`python kvforge/plugins/nvrtc.py --arch sm_90 --out kernels.ptx`: prebuild an image (e.g. for a GPU machine
    whose NVRTC is missing or newer than its driver)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--emit", choices=EMITS, default="ptx")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        module = compile_kernels(args.arch, emit=args.emit)
    except KvforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.out:
        args.out.write_bytes(module.image)
    print(f"{len(module.entries)} kernels, {len(module.image)} bytes of {module.emit} for {module.arch} "
          f"(NVRTC {module.nvrtc_version[0]}.{module.nvrtc_version[1]}{', cached' if module.from_cache else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
