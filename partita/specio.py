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
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from partita import fileio
from partita.errors import PartitaError


# YAML's aliases repeat a node without writing it again; nine levels of nine aliases are a
# billion nodes from a file of a few hundred bytes. Partita's own files use none; a hand-written
# cluster may repeat a node group with one. Aliases may bring in at most this many nodes in all.
MAX_ALIAS_NODES = 10_000
# YAML 1.1 reads 1e-5 and 5e1 as strings (its floats need a dot and a signed exponent); YAML 1.2
# and every other reader take them as numbers, and so does Partita.
_FLOAT_WITHOUT_DOT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _LimitError(yaml.YAMLError):
    """A file past one of the loader's bounds (aliases, depth); its text is the whole message."""


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts the nodes aliases bring in and the nesting depth while it
    composes, before anything is expanded."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}  # id(anchored node) -> its nodes, aliases expanded
        self._open: list[int] = []  # nodes counted so far, per node being composed
        self._alias_nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            target = self.anchors.get(self.peek_event().anchor)
            if target is not None:  # (an undefined alias is PyYAML's error)
                size = self._sizes.get(id(target))
                if size is None:
                    raise _LimitError("an alias refers to a node that contains it (a loop)")
                self._alias_nodes += size
                if self._alias_nodes > MAX_ALIAS_NODES:
                    raise _LimitError(f"aliases expand to more than {MAX_ALIAS_NODES:,} nodes, the most Partita "
                                      f"reads (an alias bomb?); write the repeated parts out")
                if self._open:
                    self._open[-1] += size
            return super().compose_node(parent, index)
        if len(self._open) >= fileio.MAX_DEPTH:
            raise _LimitError(f"nested deeper than {fileio.MAX_DEPTH}")
        self._open.append(1)
        node = super().compose_node(parent, index)
        size = self._open.pop()
        if self._open:
            self._open[-1] += size
        self._sizes[id(node)] = size
        return node


class _Dumper(yaml.SafeDumper):
    """Quotes the strings ``_Loader`` would read as numbers (``'1e5'``), so they stay strings."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_WITHOUT_DOT, list("-+0123456789."))


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file (a regular file of at most 16 MiB: ``fileio.read_text``); a syntax error
    or a file past the loader's bounds is one line naming file and line."""
    return parse_yaml(fileio.read_text(path), str(path))


def parse_yaml(text: str | bytes, where: str = "<string>") -> Any:
    try:
        data = yaml.load(text, Loader=_Loader)
    except _LimitError as e:
        raise PartitaError(f"{where}: {e}") from None
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
    fileio.check_depth(data, where, "YAML")  # aliases can nest what the text does not
    return data


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=100)


def save_yaml(data: Mapping[str, Any], path: str | Path) -> None:
    """Write YAML whole or not at all (``fileio.write_text``: a temporary name, then a rename),
    after checking the text reads back equal, so a file we write is one we can read."""
    text = dump_yaml(data)
    if parse_yaml(text, str(path)) != data:
        raise PartitaError(f"{path}: the YAML to write does not read back equal")
    fileio.write_text(path, text)


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


def check_choices(obj: Any, choices: Iterable[tuple[str, Iterable[str]]]) -> None:
    """Each named field of ``obj`` holds one of its valid values, else one error naming them."""
    for name, valid in choices:
        value = getattr(obj, name)
        if value not in valid:
            raise PartitaError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")


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
