"""Reading and writing files so nothing is lost or half-written: strict JSON, atomic outputs, staged dirs.

Every kvforge output goes through here. A file is written to a temporary sibling and renamed over the
target (`os.replace`, atomic on POSIX within one directory), so a reader sees the old file or the new
one, never a torn one, and a failed run leaves no output at all. A directory (ONNX dir, engine dir) is
built in a temporary sibling directory and swapped in at the end. Output paths are checked before
any expensive work: writable, and distinct from every input and from each other.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from kvforge.contract.errors import KvforgeError
from kvforge.contract.formats import EXPORT_FORMAT, MANIFEST_FILE
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


def loads_json(text: str | bytes, where: str, what: str = "") -> Any:
    """Parse JSON strictly (duplicate keys refused); every failure is one KvforgeError on `where`.

    `what` names the document in messages (a file path), defaulting to "JSON".
    """
    shown = f" in {one_line(what)}" if what else ""
    try:
        return json.loads(text, object_pairs_hook=reject_duplicate_keys)
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
def staged_dir(final: Path) -> Iterator[Path]:
    """Build a directory in a temporary sibling; on success it replaces `final` (checked with
    `check_output_dir` first), on failure or interruption it is removed and `final` is untouched.

    The swap is two renames: the old directory aside, the new one in. A crash between them leaves no
    directory at `final`, never a half-written one.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}{TEMP_MARK}", dir=final.parent))
    try:
        yield staging
        os.chmod(staging, 0o777 & ~_umask())
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}{TEMP_MARK}old-", dir=final.parent))
            os.replace(final, old / final.name)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


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


def check_output_file(path: Path, flag: str) -> None:
    """`path` can be written atomically: its directory exists and is writable, it is not a directory, and
    an existing file there is writable (a read-only file is the user's and is left alone)."""
    shown = one_line(str(path))
    if path.is_dir():
        raise KvforgeError(f"{shown} is a directory, expected a file path", flag)
    parent = path.parent
    if not parent.is_dir():
        raise KvforgeError(f"directory {one_line(str(parent))} does not exist", flag)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KvforgeError(f"directory {one_line(str(parent))} is not writable", flag)
    if path.exists() and not path.is_file():  # a device or pipe would be replaced by the rename, not written
        raise KvforgeError(f"{shown} is not a regular file (a device, pipe or socket); write to a file", flag)
    if path.exists() and not os.access(path, os.W_OK):
        raise KvforgeError(f"{shown} exists and is read-only", flag)


def check_output_dir(path: Path, flag: str, replaceable: Mapping[str, str] | None = None) -> None:
    """`path` can receive a staged directory: it is absent, an empty directory, or one kvforge wrote
    (a `manifest.json`, or a config.json of ours from before manifests); anything else is the user's."""
    shown = one_line(str(path))
    if path.exists() and not path.is_dir():
        raise KvforgeError(f"{shown} exists and is not a directory", flag)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KvforgeError(f"directory {one_line(str(parent))} is not writable", flag)
    if path.is_dir() and any(path.iterdir()) and not _written_by_kvforge(path):
        raise KvforgeError(f"{shown} is not empty and was not written by kvforge; choose a new directory or "
                           "empty it (it would be replaced)", flag)


def _written_by_kvforge(path: Path) -> bool:
    if (path / MANIFEST_FILE).is_file():
        return True
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8")).get("format") == EXPORT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_distinct(outputs: Mapping[str, Path | None], inputs: Mapping[str, Path | None],
                   outputs_are_dirs: bool = False) -> None:
    """No output is an input or another output. An output dir may not overlap an input at all; an output
    file may sit in an input directory only as a new file (replacing one there would change the input)."""
    outs = [(flag, Path(p)) for flag, p in outputs.items() if p is not None]
    ins = [(flag, Path(p)) for flag, p in inputs.items() if p is not None]
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
