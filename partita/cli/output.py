"""Where the commands' results go: the console people read, warnings on stderr, and the files
they write, each checked before any work (a missing output folder is refused before a search,
not after). Files are written before anything is printed, so a closed pipe loses nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Iterable, Iterator

from rich.console import Console

from partita import fileio
from partita.errors import PartitaError
from partita.plan import Plan


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich exits with status 1 here; the CLI's handler decides (the work is done: exit 0)
        raise BrokenPipeError


# Wide enough for the plan table when output is piped to a file or a log.
console = _Console(highlight=False, width=None if sys.stdout.isatty() else 150)


def warn(message: str) -> None:
    """Something the user should know that does not stop the command: one line on stderr."""
    print(f"partita: warning: {message}", file=sys.stderr)


class Quiet:
    """A stand-in for the progress spinner when stdout carries JSON."""

    def __enter__(self) -> "Quiet":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, what: str) -> None:
        pass


def refuse_inputs(flag: str, path: Path, inputs: Iterable[str | Path]) -> None:
    """An output that is one of the command's own inputs would overwrite it: refused."""
    for given in inputs:
        if given and fileio.same_file(path, given):
            raise PartitaError(f"{flag} {path}: is the input {given}; writing there would overwrite it, "
                               f"choose another path")


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM during long work stops it as Ctrl-C does: the work unwinds (a file half-written
    is a temporary one, removed), one line says so, and the exit status is 143 (128 + 15)."""
    def stop(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_IGN)  # once: a second SIGTERM must not cut the unwinding short
        print(f"partita: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def writable_output(text: str, inputs: Iterable[str | Path] = (), flag: str = "-o") -> Path:
    """The -o path, refused before any work if the result could not be written there, or if it
    is one of ``inputs`` (the command's own input files)."""
    path = Path(text)
    refuse_inputs(flag, path, inputs)
    try:
        if path.is_dir():
            raise PartitaError(f"-o {text}: is a directory; give a file name, e.g. -o {path / 'plan.yaml'}")
        parent = path.parent
        if not parent.exists():
            raise PartitaError(f"-o {text}: no such directory {str(parent)!r}; create it first or write elsewhere")
        if not parent.is_dir():
            raise PartitaError(f"-o {text}: {str(parent)!r} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise PartitaError(f"-o {text}: no permission to write there; choose another path")
    except (OSError, ValueError):  # a name no file can have (too long, a NUL byte)
        raise PartitaError(f"-o {text!r}: not a path a file can be written to") from None
    return path


def save_plan(p: Plan, path: Path) -> None:
    try:
        p.save(path)
    except OSError as e:
        raise PartitaError(f"-o {path}: cannot write the plan ({e.strerror or e})") from None
