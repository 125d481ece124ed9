"""A model spec from whatever names it: a built-in name, a Partita model YAML file, a Hugging
Face ``config.json`` or the model folder that holds one.

    from partita.model_io import load_model
    spec = load_model("llama-2-7b")            # or "model.yaml", "config.json", "path/to/hf-model/"

It sits above ``partita.model`` (the spec and the built-ins) and ``partita.hf`` (the config
mapping), so neither imports the other's way back.
"""

from __future__ import annotations

from pathlib import Path

from partita import specio
from partita.errors import PartitaError
from partita.hf import load_hf_config
from partita.model import BUILTIN, BUILTIN_ALIASES, ModelSpec


def load_model(ref: str) -> ModelSpec:
    """A built-in name, a Partita model YAML file, a Hugging Face config.json or the model
    folder that holds it."""
    if not isinstance(ref, str) or not ref:
        raise PartitaError("model: give a built-in name (see `partita models`), a YAML file or a config.json")
    name = BUILTIN_ALIASES.get(ref, ref)
    if name in BUILTIN:
        return BUILTIN[name]
    path = Path(ref)
    try:
        is_dir = path.is_dir()
        is_file = not is_dir and (path.suffix in (".yaml", ".yml", ".json") or path.exists())
    except (OSError, ValueError):  # a name no file can have (too long, a NUL byte)
        is_dir = is_file = False
    if is_dir:  # a Hugging Face model folder: its config.json
        if not (path / "config.json").is_file():
            raise PartitaError(f"{ref}: a folder without a config.json; give a Hugging Face model folder, "
                               f"a config.json, a model YAML or a built-in name")
        return load_hf_config(path / "config.json")
    if is_file:
        if path.suffix == ".json":
            return load_hf_config(path)
        data = specio.load_yaml(path)
        return ModelSpec.from_dict(data, where=str(path))
    raise PartitaError(f"unknown model {ref!r}; {specio.nearest(ref, list(BUILTIN))}")
