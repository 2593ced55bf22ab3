"""Reading and writing files so nothing is lost or half-written: strict JSON, atomic outputs, staged dirs.

Every kvforge output goes through here. A file is written to a temporary sibling and renamed over the
target (`os.replace`, atomic on POSIX within one directory), so a reader sees the old file or the new
one, never a torn one, and a failed run leaves no output at all. A directory (ONNX dir, engine dir) is
built in a temporary sibling directory and swapped in at the end with one atomic exchange. Output paths
are checked before any expensive work: writable, and distinct from every input and from each other.

A directory that already exists is replaced only when it provably is kvforge's: its manifest (format,
kind, at least one file) lists every entry in it, and any subdirectory (an EAGLE3 draft's engine under
its base) passes the same test. Anything else in it is the user's, so the whole dir is refused.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from kvforge.contract.errors import KvforgeError
from kvforge.contract.formats import MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_KINDS
from kvforge.contract.validation import one_line

TEMP_MARK = ".kvforge-tmp-"  # in every temporary sibling's name: never a valid input, safe to delete


# ----------------------------------------------------------------------------------------------- JSON

class DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook` refusing repeated keys, which json.loads would otherwise resolve last-wins."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


class NonStandardConstant(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _reject_constant(name: str) -> Any:
    """`parse_constant` refusing NaN, Infinity and -Infinity, which RFC 8259 does not have (Python's json does)."""
    raise NonStandardConstant(name)


def loads_json(text: str | bytes, where: str, what: str = "", *, standard: bool = False) -> Any:
    """Parse JSON strictly (duplicate keys refused); every failure is one KvforgeError on `where`.

    `what` names the document in messages (a file path), defaulting to "JSON". `standard` also refuses NaN and
    Infinity (llm_serve's bodies: no other JSON parser a client knows accepts them; files kvforge wrote itself may
    hold NaN logprobs, so readers of those keep Python's reading).
    """
    shown = f" in {one_line(what)}" if what else ""
    try:
        return json.loads(text, object_pairs_hook=reject_duplicate_keys,
                          parse_constant=_reject_constant if standard else None)
    except NonStandardConstant as exc:
        raise KvforgeError(f"{exc.name}{shown} is not JSON (RFC 8259 has no NaN or Infinity): send a number or "
                           "null", where) from None
    except DuplicateKey as exc:
        raise KvforgeError(f"duplicate key {json.dumps(exc.key, ensure_ascii=True)}{shown}: every key may appear "
                           "once per object", where) from None
    except json.JSONDecodeError as exc:
        raise KvforgeError(f"malformed JSON{shown} at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                           where) from None
    except RecursionError:
        raise KvforgeError(f"malformed JSON{shown}: nested too deeply", where) from None
    except (ValueError, UnicodeDecodeError) as exc:  # an int literal past Python's limit, bad UTF-8 bytes
        raise KvforgeError(f"malformed JSON{shown}: {one_line(str(exc))}", where) from None


def read_limited(path: Path, limit: int, where: str) -> bytes:
    """A file's bytes, refusing more than `limit` (checked while reading: /dev/zero or a FIFO has no size).
    OSError propagates for the caller's own message."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise KvforgeError(f"{one_line(str(path))} is larger than {limit:,} bytes", where)
    return data


MAX_CONFIG_BYTES = 64 * 2**20  # config files are a few KiB; a chat template or tokenizer a few MiB


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Read a JSON object file strictly (duplicate keys refused) with one-line errors naming the file."""
    if not path.is_file():
        raise KvforgeError(f"missing file {one_line(str(path))}", what)
    try:
        raw = read_limited(path, MAX_CONFIG_BYTES, what)
    except OSError as exc:
        raise KvforgeError(f"cannot read {one_line(str(path))}: {one_line(exc.strerror or str(exc))}", what) from None
    data = loads_json(raw, what, str(path))
    if not isinstance(data, dict):
        raise KvforgeError(f"{one_line(str(path))} must hold a JSON object", what)
    return data


# ------------------------------------------------------------------------------------------- outputs

@contextmanager
def atomic_output(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Write `path` through a temporary sibling renamed into place on success; on failure nothing changes."""
    path = Path(path)
    if path.is_symlink():  # write through the link: the file it names is replaced, the link stays
        path = path.resolve()
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}{TEMP_MARK}", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if "b" not in mode else {})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())  # the data is on disk before the name points at it
        os.chmod(temp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_output(path) as handle:
        handle.write(text)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_output(path, "wb") as handle:
        handle.write(data)


def write_json(path: Path, data: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(data, indent=indent, ensure_ascii=False) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def staged_dir(final: Path, flag: str = "output_dir") -> Iterator[Path]:
    """Build a directory in a temporary sibling; on success it replaces `final`, on failure or interruption it
    is removed and `final` is untouched.

    `final` is checked again just before the swap (the build took minutes; someone may have written there),
    and the swap is one atomic exchange of the two names (Linux renameat2), so at every instant `final` is the
    old directory or the new one. Where the exchange is unavailable the swap is two renames, and a failure or
    interruption between them moves the old directory back or says exactly where both are.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}{TEMP_MARK}", dir=final.parent))
    keep_staging = False
    try:
        yield staging
        os.chmod(staging, 0o777 & ~_umask())
        for path in staging.iterdir():  # onnx and safetensors write some files 0600: outputs get the usual mode
            if path.is_file() and not path.is_symlink():
                os.chmod(path, 0o666 & ~_umask())
        check_output_dir(final, flag)
        if not final.exists():
            os.replace(staging, final)  # onto nothing (or an empty dir made meanwhile): nothing is lost
        elif not exchange_paths(staging, final):
            shutil.rmtree(_swap_by_renames(staging, final, flag), ignore_errors=True)
    except SwapFailed:
        keep_staging = True  # the message says where both dirs are
        raise
    finally:  # before the exchange `staging` is the new dir, after it the old one: either way it goes
        if not keep_staging:
            shutil.rmtree(staging, ignore_errors=True)


class SwapFailed(KvforgeError):
    """The two-rename swap failed half way and the old dir could not be moved back."""


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where the OS or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a filesystem without exchange (some FUSE, NFS)
        return False
    raise OSError(code, os.strerror(code), str(b))


def _swap_by_renames(staging: Path, final: Path, flag: str) -> Path:
    """The old dir aside, the new one in; if the second rename fails or is interrupted, the old one goes back.
    Returns the temporary dir now holding the old one."""
    aside = Path(tempfile.mkdtemp(prefix=f".{final.name}{TEMP_MARK}old-", dir=final.parent))
    os.replace(final, aside / final.name)
    try:
        os.replace(staging, final)
    except BaseException as exc:
        try:
            os.replace(aside / final.name, final)
        except OSError:
            raise SwapFailed(f"the swap was interrupted: the previous {one_line(str(final))} is at "
                               f"{one_line(str(aside / final.name))} and the new one at {one_line(str(staging))}; "
                               "move one of them back", flag) from exc
        raise
    return aside


# ---------------------------------------------------------------------------------------- path checks

def same_path(a: Path, b: Path) -> bool:
    """True when `a` and `b` name the same file: same resolved path, or the same inode (hard links)."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def overlaps(a: Path, b: Path) -> bool:
    """True when one path is, or lies inside, the other (after resolving links)."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or ra.is_relative_to(rb) or rb.is_relative_to(ra) or same_path(a, b)


def check_path_name(path: Path, flag: str) -> None:
    """A path's name must be text: bytes that are not UTF-8 (Python carries them as surrogate escapes) cannot
    be written into JSON outputs, profiles or reports, so they are refused before any work, not half way."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        raise KvforgeError(f"the path {one_line(shown)} is not valid UTF-8; rename it", flag) from None


def check_writable_dir(directory: Path, flag: str) -> None:
    """Files can be created in `directory`, tried by creating one: os.access says yes to root everywhere,
    and /proc, read-only mounts and full quotas are only found by trying."""
    shown = one_line(str(directory))
    if not directory.is_dir():
        raise KvforgeError(f"directory {shown} does not exist" if not directory.exists() else
                           f"{shown} is not a directory", flag)
    try:
        fd, probe = tempfile.mkstemp(prefix=f".probe{TEMP_MARK}", dir=directory)
    except OSError as exc:
        raise KvforgeError(f"cannot create files in directory {shown}: {one_line(exc.strerror or str(exc))}",
                           flag) from None
    os.close(fd)
    os.unlink(probe)


def kvforge_dir_holding(path: Path) -> tuple[Path, str] | None:
    """The nearest directory at or above `path` that kvforge wrote (its manifest.json is ours), with its kind;
    None when there is none. A file put there breaks that dir: it no longer matches its manifest, is refused
    on load and cannot be replaced by a rebuild."""
    current = Path(path).resolve()
    for directory in (current, *current.parents):
        manifest = directory / MANIFEST_FILE
        if not manifest.is_file():
            continue
        try:
            data = json.loads(read_limited(manifest, MAX_CONFIG_BYTES, "manifest"))
        except (OSError, ValueError, KvforgeError):
            continue  # not readable as ours: a user's manifest.json (a web app's) owns nothing here
        if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT and data.get("kind") in MANIFEST_KINDS:
            return directory, str(data["kind"])
    return None


def check_not_in_kvforge_dir(path: Path, flag: str) -> None:
    """Refuse an output of a command (a file or a work dir) inside an ONNX or engine dir: kvforge's dirs hold
    only what their manifest lists, and the command that wrote a dir is the only one that writes into it."""
    owner = kvforge_dir_holding(path if path.is_dir() else path.parent)
    if owner is not None:
        directory, kind = owner
        raise KvforgeError(f"{one_line(str(path))} is inside {one_line(str(directory))}, a kvforge {kind} dir; "
                           "write outside it (a file there would break it)", flag)


def check_work_dir(path: Path, flag: str) -> None:
    """A directory a command fills as it goes (--cacheDir, --workDir, llm_test's --outputDir): a writable dir,
    or one that can be made (its nearest existing ancestor is a writable dir), so a file in the way or an
    unwritable place is one line before any work. Nothing is created here."""
    check_path_name(path, flag)
    shown = one_line(str(path))
    if path.exists() and not path.is_dir():
        raise KvforgeError(f"{shown} exists and is not a directory", flag)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise KvforgeError(f"{one_line(str(existing))} is a file, so {shown} cannot be created", flag)
    check_not_in_kvforge_dir(path, flag)
    check_writable_dir(existing, flag)


def check_output_file(path: Path, flag: str) -> None:
    """`path` can be written atomically: its directory exists and is writable, it is not a directory, and
    an existing file there is writable (a read-only file is the user's and is left alone)."""
    check_path_name(path, flag)
    shown = one_line(str(path))
    if path.is_dir():
        raise KvforgeError(f"{shown} is a directory, expected a file path", flag)
    parent = path.parent
    if not parent.is_dir():
        raise KvforgeError(f"directory {one_line(str(parent))} does not exist", flag)
    check_not_in_kvforge_dir(path, flag)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KvforgeError(f"directory {one_line(str(parent))} is not writable", flag)
    check_writable_dir(parent, flag)
    if path.exists() and not path.is_file():  # a device or pipe would be replaced by the rename, not written
        raise KvforgeError(f"{shown} is not a regular file (a device, pipe or socket); write to a file", flag)
    if path.exists() and not os.access(path, os.W_OK):
        raise KvforgeError(f"{shown} exists and is read-only", flag)


def check_output_dir(path: Path, flag: str) -> None:
    """`path` can receive a staged directory: it is absent, an empty directory, or provably one kvforge wrote
    (`kvforge_dir_problem`); anything else is the user's and is refused, naming what is in the way."""
    check_path_name(path, flag)
    shown = one_line(str(path))
    if path.exists() and not path.is_dir():
        raise KvforgeError(f"{shown} exists and is not a directory", flag)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise KvforgeError(f"{one_line(str(parent))} is a file, so {shown} cannot be created", flag)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KvforgeError(f"directory {one_line(str(parent))} is not writable", flag)
    check_writable_dir(parent, flag)
    if path.is_dir() and any(path.iterdir()):
        problem = kvforge_dir_problem(path)
        if problem:
            raise KvforgeError(f"{shown} is not empty and was not written by kvforge ({problem}); choose a new "
                               "directory or empty it (it would be replaced)", flag)


MAX_NESTING = 2  # an engine dir holds at most its draft's engine dir


def kvforge_dir_problem(path: Path, depth: int = 0) -> str | None:
    """None when `path` is provably a kvforge ONNX or engine dir that may be replaced whole; else why not.

    Proof: a manifest of ours (format, a known kind, at least one file) that lists every regular file in
    the dir. An empty or foreign manifest vouches for nothing, a file it does not list was not written by
    kvforge, and a listed file whose size changed was edited; each keeps the dir from being deleted.
    """
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_bytes())
    except FileNotFoundError:
        return f"no {MANIFEST_FILE}"
    except (OSError, ValueError) as exc:
        return f"{MANIFEST_FILE} cannot be read: {one_line(str(exc))}"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or \
            manifest.get("kind") not in MANIFEST_KINDS:
        return f"{MANIFEST_FILE} is not a kvforge manifest"
    if not isinstance(files, dict) or not files:
        return f"its {MANIFEST_FILE} lists no files"
    for entry in sorted(path.iterdir()):
        name = one_line(entry.name)
        if entry.name == MANIFEST_FILE:
            continue
        if entry.is_symlink():
            return f"{name} is a link"
        if entry.is_dir():
            inner = kvforge_dir_problem(entry, depth + 1) if depth < MAX_NESTING else "nested too deeply"
            if inner:
                return f"{name}/: {inner}"
            continue
        listed = files.get(entry.name)
        if not isinstance(listed, dict):
            return f"{name} is not in its {MANIFEST_FILE}"
        if not entry.is_file() or entry.stat().st_size != listed.get("size"):
            return f"{name} was changed since kvforge wrote it"
    return None


def check_distinct(outputs: Mapping[str, Path | None], inputs: Mapping[str, Path | None],
                   outputs_are_dirs: bool = False) -> None:
    """No output is an input or another output. An output dir may not overlap an input at all; an output
    file may sit in an input directory only as a new file (replacing one there would change the input)."""
    outs = [(flag, Path(p)) for flag, p in outputs.items() if p is not None]
    ins = [(flag, Path(p)) for flag, p in inputs.items() if p is not None]
    for flag, path in outs + ins:
        check_path_name(path, flag)
    for i, (flag, path) in enumerate(outs):
        for other_flag, other in ins:
            clash = same_path(path, other) or path.resolve().is_relative_to(other.resolve()) and (
                outputs_are_dirs or path.exists()) or other.resolve().is_relative_to(path.resolve())
            if clash:
                raise KvforgeError(f"is the same path as (or overlaps) {other_flag}; it would overwrite an input",
                                   flag)
        for other_flag, other in outs[i + 1:]:
            if overlaps(path, other):
                raise KvforgeError(f"is the same path as (or overlaps) {other_flag}; one output would replace "
                                   "the other", flag)
