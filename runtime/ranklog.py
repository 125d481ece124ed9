"""Each rank's output in its own log file under the run directory, and the one line a failed
rank leaves for the launcher.

``partita launch`` names a folder in ``PARTITA_LOG_DIR`` (``runs/NAME/logs`` beside
``metrics.jsonl``). Every rank started under it points its standard output and error (file
descriptors 1 and 2, so Python's tracebacks, torch's warnings and gloo's or NCCL's own messages
too) at ``rank-R.log`` there, before torch is imported (``to_log_file``); rank 0 keeps a stream to
the console it had, for its progress lines. A rank that stops on a refusal (a ``PartitaError``: a
full disk, input it cannot train) writes that one line to ``rank-R.error`` (``record_error``), so
the launcher prints it once instead of every rank printing its own. Without ``PARTITA_LOG_DIR``
(``torchrun`` started by hand) a rank writes to the console as any program does.

No torch here: the worker imports this first, and the launcher reads the files it names.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from partita import fileio
from partita.errors import PartitaError

LOG_DIR = "PARTITA_LOG_DIR"  # the environment variable naming the ranks' log folder


def log_path(log_dir: str | Path, rank: int | str) -> Path:
    return Path(log_dir) / f"rank-{rank}.log"


def error_path(log_dir: str | Path, rank: int | str) -> Path:
    return Path(log_dir) / f"rank-{rank}.error"


def to_log_file() -> TextIO | None:
    """With ``PARTITA_LOG_DIR`` set, send this process's descriptors 1 and 2 to its rank's log
    file (created afresh) and return a line-buffered stream to the console it had; None (and
    nothing changed) without it, or where the file cannot be opened (the console is better than
    no output at all)."""
    log_dir = os.environ.get(LOG_DIR)
    if not log_dir:
        return None
    rank = os.environ.get("RANK", "0")
    try:
        fd = os.open(log_path(log_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    except OSError:
        return None
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    console = os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return os.fdopen(console, "w", buffering=1)


def record_error(message: str) -> None:
    """Leave this rank's one-line refusal for the launcher (nothing without ``PARTITA_LOG_DIR``).
    A disk too full for even this line leaves none; the launcher then names the exit code."""
    log_dir = os.environ.get(LOG_DIR)
    if not log_dir:
        return
    try:
        fileio.write_text(error_path(log_dir, os.environ.get("RANK", "0")), message.strip() + "\n")
    except PartitaError:
        pass


def read_error(log_dir: str | Path, rank: int) -> str | None:
    """The line rank ``rank`` left (``record_error``), if any."""
    if not error_path(log_dir, rank).is_file():
        return None
    try:
        lines = fileio.read_text(error_path(log_dir, rank)).strip().splitlines()
    except PartitaError:
        return None
    return lines[0] if lines else None


def clear(log_dir: str | Path) -> None:
    """Remove an earlier run's rank logs and errors from ``log_dir``, so none passes for this run's."""
    folder = Path(log_dir)
    if folder.is_dir():
        for stale in (*folder.glob("rank-*.log"), *folder.glob("rank-*.error")):
            stale.unlink(missing_ok=True)
