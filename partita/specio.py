"""Strict, versioned YAML for Partita's frozen dataclasses.

Every spec and plan is a frozen, keyword-only dataclass with a ``to_dict`` and a
``from_dict``. This module holds what they share: reading YAML with errors that name the
file and line, refusing unknown keys (listing the valid ones), checking field types, and
fingerprints of the data a plan was made from.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from partita.errors import PartitaError


def read_text(path: str | Path) -> str:
    """A file's text; a missing or unreadable file is one line naming it."""
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise PartitaError(f"{p}: no such file") from None
    except (OSError, ValueError) as e:  # a folder, no permission, not UTF-8, a NUL or too long a name
        raise PartitaError(f"{p}: cannot read ({type(e).__name__})") from None


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file; a missing file or a syntax error is one line naming file and line."""
    return parse_yaml(read_text(path), str(path))


def parse_yaml(text: str, where: str = "<string>") -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise PartitaError(f"{where}{line}: malformed YAML ({_one_line(e.problem or e.context)})") from None
    except yaml.YAMLError as e:
        raise PartitaError(f"{where}: malformed YAML ({_one_line(e)})") from None
    except (ValueError, TypeError, AttributeError, LookupError, OverflowError) as e:
        # PyYAML's constructors let some bad scalars out as Python errors: a date that is no
        # date (2001-13-45), "!!int abc", "!!int" with no value, "!!timestamp x".
        raise PartitaError(f"{where}: malformed YAML ({type(e).__name__}: {_one_line(e)})") from None
    except RecursionError:
        raise PartitaError(f"{where}: malformed YAML (nested too deeply)") from None


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


def save_yaml(data: Mapping[str, Any], path: str | Path) -> None:
    """Write YAML, then re-read it and compare, so a file we write is one we can read."""
    p = Path(path)
    text = dump_yaml(data)
    p.write_text(text)
    if yaml.safe_load(p.read_text()) != data:
        raise PartitaError(f"{p}: the file written does not read back equal; disk full?")


def nearest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """'did you mean' text for an unknown name."""
    choices = list(choices)
    close = difflib.get_close_matches(name, choices, n=n, cutoff=0.4)
    if not close:
        close = difflib.get_close_matches(name.lower(), [c.lower() for c in choices], n=n, cutoff=0.4)
    return f"did you mean {', '.join(close)}?" if close else f"valid: {', '.join(sorted(choices))}"


def require_mapping(data: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise PartitaError(f"{what}: expected a mapping, got {type(data).__name__}")
    return data


def check_keys(data: Mapping[str, Any], cls: type, what: str, required: Iterable[str] = ()) -> None:
    """Unknown keys are errors that list the valid ones; missing required keys too."""
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in valid:
            raise PartitaError(f"{what}: unknown key {key!r}; valid keys: {', '.join(valid)}")
    for key in required:
        if key not in data:
            raise PartitaError(f"{what}: missing key {key!r}")


def check_version(data: Mapping[str, Any], supported: int, what: str) -> None:
    version = data.get("schema_version", supported)
    if version != supported:
        raise PartitaError(
            f"{what}: schema_version {version!r} is not supported; this Partita reads version {supported}"
        )


def get_int(data: Mapping[str, Any], key: str, what: str, *, minimum: int = 1, default: Any = ...) -> int:
    value = data.get(key, default)
    if value is ...:
        raise PartitaError(f"{what}: missing key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise PartitaError(f"{what}: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise PartitaError(f"{what}: {key} must be >= {minimum}, got {value}")
    return value


def get_float(data: Mapping[str, Any], key: str, what: str, *, minimum: float = 0.0, default: Any = ..., strict_min: bool = True) -> float:
    value = data.get(key, default)
    if value is ...:
        raise PartitaError(f"{what}: missing key {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise PartitaError(f"{what}: {key} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise PartitaError(f"{what}: {key} must be a finite number, got {value!r}")
    if (number <= minimum) if strict_min else (number < minimum):
        raise PartitaError(f"{what}: {key} must be {'>' if strict_min else '>='} {minimum}, got {value}")
    return number


def get_str(data: Mapping[str, Any], key: str, what: str, *, default: Any = ..., choices: Iterable[str] | None = None) -> str:
    value = data.get(key, default)
    if value is ...:
        raise PartitaError(f"{what}: missing key {key!r}")
    if not isinstance(value, str) or not value:
        raise PartitaError(f"{what}: {key} must be a non-empty string, got {value!r}")
    if choices is not None and value not in choices:
        raise PartitaError(f"{what}: {key} {value!r} is not one of {', '.join(choices)}")
    return value


def get_bool(data: Mapping[str, Any], key: str, what: str, *, default: Any = ...) -> bool:
    value = data.get(key, default)
    if value is ...:
        raise PartitaError(f"{what}: missing key {key!r}")
    if not isinstance(value, bool):
        raise PartitaError(f"{what}: {key} must be true or false, got {value!r}")
    return value


def fingerprint(data: Any) -> str:
    """A short, stable hash of plain data (dicts, lists, numbers, strings)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
