"""What a layer keeps from forward for backward: counted exactly from autograd's saved tensors,
and, on a GPU, read from the CUDA allocator.

``SavedTensors`` hooks every tensor autograd saves during a forward
(``torch.autograd.graph.saved_tensors_hooks``) and sums the bytes of their *storages*, each
storage once: views (a transposed weight, a reshaped activation) share the storage of their
base and cost nothing extra. Storages of the layer's parameters are excluded -- they are
parameter memory, counted apart. The layer's input is included when an op saves it (the first
norm does): in a stack, a layer's input is the previous layer's output, and it is this layer's
backward that keeps it alive.
"""

from __future__ import annotations

from typing import Iterable

import torch


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


class SavedTensors:
    """Context manager: the storages autograd saves for backward while it is active."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {storage_key(t) for t in exclude}
        self.storages: dict[tuple[str, int], int] = {}  # key -> bytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key = storage_key(t)
            nbytes = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            key, nbytes = ("other", id(t)), t.numel() * t.element_size()
        if key not in self._exclude:
            self.storages[key] = nbytes
        return t

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def holds(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self.storages


def tensor_storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters, each shared parameter once."""
    seen, total = set(), 0
    for p in module.parameters():
        key = storage_key(p)
        if key not in seen:
            seen.add(key)
            total += p.untyped_storage().nbytes()
    return total
