"""Reading and writing Partita's files, bounded and whole.

Every YAML and JSON file Partita reads comes through ``read_bytes``: a regular file (not a
folder, a device such as ``/dev/zero``, or a FIFO, which would block or never end) of at most
``MAX_FILE_BYTES`` (16 MiB, far above any real spec, plan or profile; ``MAX_LOG_BYTES`` for a
run's ``metrics.jsonl``). JSON is nested at most ``MAX_DEPTH`` deep. YAML's own bounds (aliases,
depth) live with its loader in ``partita.specio``.

Every file Partita writes goes through ``write_text``: to a temporary name in the same folder,
flushed to disk, then renamed over the target, so a full disk or an interrupted write leaves the
old file as it was. A target that exists and is not a regular file (``/dev/stdout``, a FIFO) is
written in place. Each refusal is a ``PartitaError`` of one line naming the file.

    text = read_text("plan.yaml")
    write_text("plan.yaml", text)
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from partita.errors import PartitaError

MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_LOG_BYTES = 1024 * 1024 * 1024  # metrics.jsonl: a line per step and rank, over long runs
MAX_DEPTH = 64  # nested mappings and lists; Partita's deepest file (a plan) nests 5


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def read_bytes(path: str | Path, limit: int = MAX_FILE_BYTES) -> bytes:
    """A regular file's bytes, at most ``limit`` of them; anything else is one line naming it."""
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then tells what it is
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise PartitaError(f"{p}: no such file") from None
    except (OSError, ValueError) as e:  # no permission, a NUL or too long a name
        raise PartitaError(f"{p}: cannot read ({e.strerror if isinstance(e, OSError) else type(e).__name__})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PartitaError(f"{p}: cannot read ({_kind(mode)}, not a regular file)")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise PartitaError(f"{p}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if size > limit:
        raise PartitaError(f"{p}: larger than {_mib(limit)}, the most Partita reads from one file")
    return b"".join(chunks)


def _mib(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB"


def read_text(path: str | Path, limit: int = MAX_FILE_BYTES) -> str:
    """A file's text (UTF-8), bounded as ``read_bytes``."""
    data = read_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PartitaError(f"{path}: cannot read (not UTF-8 text at byte {e.start})") from None


def parse_json(text: str | bytes, where: str = "<string>", line: int | None = None) -> Any:
    """JSON, nested at most ``MAX_DEPTH`` deep; a syntax error names file, line and column
    (``line``: the text is that line of the file)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PartitaError(f"{where}:{line or e.lineno}:{e.colno}: malformed JSON ({e.msg})") from None
    except RecursionError:
        raise PartitaError(f"{where}: malformed JSON (nested deeper than {MAX_DEPTH})") from None
    except (ValueError, TypeError):  # an integer longer than Python's 4300 digits; bytes not UTF-8
        raise PartitaError(f"{where}: malformed JSON (a number too long to read, or not UTF-8)") from None
    check_depth(data, where, "JSON")
    return data


def load_json(path: str | Path) -> Any:
    return parse_json(read_text(path), str(path))


def load_jsonl(path: str | Path, limit: int = MAX_LOG_BYTES) -> list[Any]:
    """One JSON value a line (blank lines skipped); a bad line is named by its number."""
    records = []
    for n, line in enumerate(read_text(path, limit).splitlines(), 1):
        if line.strip():
            records.append(parse_json(line, str(path), line=n))
    return records


def check_depth(data: Any, where: str, what: str) -> None:
    """Refuse data nested deeper than ``MAX_DEPTH`` (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_DEPTH:
            raise PartitaError(f"{where}: malformed {what} (nested deeper than {MAX_DEPTH})")
        stack.extend((c, depth + 1) for c in children)


def write_text(path: str | Path, text: str | bytes) -> None:
    """Write a file whole or not at all: a temporary name beside it, then a rename over it.
    A full disk is ``no space left on device writing PATH``; the old file stays as it was."""
    p = Path(path)
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        target = Path(os.path.realpath(p))  # through a symlink: replace the file, keep the link
        try:
            mode = os.stat(target).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            if stat.S_ISDIR(mode):
                raise PartitaError(f"{p}: is a directory; give a file name")
            _write_in_place(target, data)  # /dev/stdout, a FIFO: nothing to rename over
            return
        _write_and_rename(target, data, mode)
    except OSError as e:
        raise write_error(p, e) from None


def write_error(path: str | Path, e: OSError) -> PartitaError:
    """The one line for a write that failed."""
    if e.errno == errno.ENOSPC:
        return PartitaError(f"no space left on device writing {path}")
    if e.errno == errno.EDQUOT:
        return PartitaError(f"disk quota exceeded writing {path}")
    if e.errno == errno.EROFS:
        return PartitaError(f"read-only file system writing {path}")
    return PartitaError(f"cannot write {path} ({e.strerror or e})")


def _write_in_place(target: Path, data: bytes) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_TRUNC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _write_and_rename(target: Path, data: bytes, mode: int | None) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:  # a full disk, Ctrl-C: the temporary file goes, the target is untouched
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (through links and ``..``); False when either is missing."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False
